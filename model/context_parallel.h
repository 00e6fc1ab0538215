#pragma once
// Context parallelism (Megatron's --context-parallel-size, torchtitan's context_parallel; the
// ring attention of Liu et al. 2023): each sequence is split across the cp ranks of a group,
// every activation and its work shrinking by cp, and attention, the one place where tokens meet,
// passes the keys and values around the ring. Outside attention nothing changes: norms, MLPs,
// the head and the loss work on a rank's tokens alone, and the gradients are summed over the
// data-parallel and context-parallel ranks together (their group is one, for the reducer).
//
// Load balancing (causal): the sequence of T tokens is cut into 2 cp chunks and rank r holds
// chunks r and 2 cp - 1 - r, so that every rank has as many visible query-key pairs as any
// other. Its T / cp tokens of each sequence are those two chunks, one after the other.
//
// Ring attention, forward: each rank starts with its own keys and values; at each of cp steps it
// sends what it holds to the next rank while it attends to them (an online softmax folds the
// parts into the output and each row's log-sum-exp), and receives the previous rank's. Backward
// passes the keys and values round again, each with the gradient of its keys and values
// accumulated so far; after cp steps every gradient is home. Inference (generation with a
// key/value cache) does not split: every rank of the group runs it whole.
//
// The exchange is supplied by whoever holds the group's communicator, so that model code
// includes no communication header.
#include <cstdint>
#include <functional>
#include <utility>

#include "kernels/kernels.h"

namespace trainer {

class ContextParallel {
 public:
  // Starts sending send(n) to the next rank of the ring and receiving recv(n) from the previous
  // one (messages of one `channel` are matched in order); returns what waits for both.
  using Exchange =
      std::function<std::function<void()>(DPtr send, DPtr recv, int64_t n, int channel)>;

  ContextParallel() = default;  // one rank: no split
  ContextParallel(int rank, int size, Exchange exchange)
      : rank_(rank), size_(size), exchange_(std::move(exchange)) {}

  int rank() const { return rank_; }
  int size() const { return size_; }
  bool splits() const { return size_ > 1; }

  // Where rank r's T tokens of a sequence (T / cp of it, T even) sit in the whole sequence.
  TokenChunks chunks_of(int r, int T) const {
    const int chunk = T / 2;
    return {chunk, r * chunk, (2 * size_ - 1 - r) * chunk};
  }
  TokenChunks chunks(int T) const { return chunks_of(rank_, T); }
  // The rank whose keys and values this rank holds at ring step s.
  int holder(int step) const { return (rank_ - step + size_) % size_; }

  std::function<void()> exchange(DPtr send, DPtr recv, int64_t n, int channel) const {
    return exchange_(send, recv, n, channel);
  }

 private:
  int rank_ = 0, size_ = 1;
  Exchange exchange_;
};

}  // namespace trainer
