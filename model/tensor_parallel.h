#pragma once
// Tensor-parallel communication, in one place: Megatron's conjugate pairs. A model definition
// marks where its activations enter and leave the tensor-parallel regions and calls both halves
// of each pair (forward in forward, backward in backward); only this class decides which half
// communicates. The reduction itself is supplied by whoever holds the group's communicator (the
// stage executor), so model code includes no communication header.
//
//   copy   (Megatron's f): entering a column-parallel region (QKV, MLP up, a vocab-parallel
//          head). Forward: the replicated input is used as it is. Backward: each rank holds a
//          partial input gradient; they are summed.
//   reduce (Megatron's g): leaving a row-parallel region (the projections back into the
//          residual stream, a vocab-parallel embedding). Forward: partial outputs are summed.
//          Backward: the output gradient is replicated; used as it is.
#include <cstdint>
#include <functional>
#include <utility>

#include "kernels/dtype.h"

namespace trainer {

class TensorParallel {
 public:
  // In place over the group: buf(n) = the sum (or the max) of every rank's buf(n).
  using AllReduce = std::function<void(DPtr buf, int64_t n, bool max)>;

  TensorParallel() = default;  // one rank: nothing to communicate
  TensorParallel(int rank, int size, AllReduce all_reduce)
      : rank_(rank), size_(size), all_reduce_(std::move(all_reduce)) {}

  int rank() const { return rank_; }
  int size() const { return size_; }

  void copy_forward(DPtr, int64_t) const {}
  void copy_backward(DPtr dx, int64_t n) const { sum(dx, n); }
  void reduce_forward(DPtr y, int64_t n) const { sum(y, n); }
  void reduce_backward(DPtr, int64_t) const {}

  // The vocab-parallel loss combines per-row statistics (never the logits) across the group.
  void row_max(DPtr buf, int64_t n) const {
    if (size_ > 1) all_reduce_(buf, n, true);
  }
  void row_sum(DPtr buf, int64_t n) const { sum(buf, n); }

 private:
  void sum(DPtr buf, int64_t n) const {
    if (size_ > 1) all_reduce_(buf, n, false);
  }
  int rank_ = 0, size_ = 1;
  AllReduce all_reduce_;
};

}  // namespace trainer
