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
//
// Sequence parallelism (Korthikanti et al. 2022, Megatron's --sequence-parallel): outside the
// tensor-parallel regions (norms, dropout, the residual stream) each rank holds only its
// 1/size of the B x T rows, so those activations and their work shrink by the group's size.
// The pairs become: entering a column-parallel region all-gathers the rows (backward:
// reduce-scatters the input gradient), leaving a row-parallel one reduce-scatters the partial
// outputs (backward: all-gathers the gradient). A norm's parameter gradients, computed from this
// rank's rows only, are summed over the group. Rows are split as a flat (B x T, C) matrix: rank
// r holds rows [r R, (r + 1) R), R = B T / size.
#include <cstdint>
#include <functional>
#include <utility>

#include "kernels/dtype.h"

namespace trainer {

class TensorParallel {
 public:
  // In place over the group: buf(n) = the sum (or the max) of every rank's buf(n).
  using AllReduce = std::function<void(DPtr buf, int64_t n, bool max)>;
  // recv(size x count) = every rank's send(count) in rank order (send may be recv's own block);
  // and recv(count) = the sum over ranks of their send's block rank().
  using AllGather = std::function<void(DPtr send, DPtr recv, int64_t count)>;
  using ReduceScatter = std::function<void(DPtr send, DPtr recv, int64_t count)>;

  TensorParallel() = default;  // one rank: nothing to communicate
  TensorParallel(int rank, int size, AllReduce all_reduce, AllGather all_gather = {},
                 ReduceScatter reduce_scatter = {})
      : rank_(rank),
        size_(size),
        all_reduce_(std::move(all_reduce)),
        all_gather_(std::move(all_gather)),
        reduce_scatter_(std::move(reduce_scatter)) {}

  int rank() const { return rank_; }
  int size() const { return size_; }

  // --- sequence parallelism (model/model_definition.h's helpers use these) ---------------------
  // Whether the group can split rows (its communicator gave the two collectives; size > 1).
  bool splits_rows() const { return size_ > 1 && all_gather_ && reduce_scatter_; }
  // full(size x count) from every rank's `local` block (which may be full + rank() x count).
  void gather_rows(DPtr local, DPtr full, int64_t count) const { all_gather_(local, full, count); }
  // local(count) = the sum over ranks of their full's block rank().
  void scatter_rows(DPtr full, DPtr local, int64_t count) const {
    reduce_scatter_(full, local, count);
  }
  void sum_norm_grads(DPtr g, int64_t n) const { sum(g, n); }

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
  AllGather all_gather_;
  ReduceScatter reduce_scatter_;
};

}  // namespace trainer
