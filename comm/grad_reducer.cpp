#include "comm/grad_reducer.h"

#include <algorithm>
#include <stdexcept>

namespace trainer {

GradReducer::GradReducer(Kernels& k, DPtr grads, DPtr params, int64_t total, Communicator& dp,
                         Communicator* intra, Communicator* inter, const ReducerOptions& options)
    : k_(k), opts_(options) {
  const int64_t P = dp.size(), unit = 16 * P;
  if (total % unit) throw std::invalid_argument("GradReducer: total must be a multiple of 16 dp");
  const bool hier = intra && inter;
  if (hier && intra->size() * inter->size() != P)
    throw std::invalid_argument("GradReducer: intra x inter must be the data-parallel group");
  const int64_t L = hier ? intra->size() : 1, N = hier ? inter->size() : P;
  // This rank's piece of every bucket: its dp rank, or hierarchically, the part its node's
  // reduce-scatter gives it, sub-divided across nodes.
  const int64_t piece_index = hier ? int64_t(intra->rank()) * N + inter->rank() : dp.rank();
  const int64_t bucket = std::max<int64_t>(unit, (options.bucket_elems + unit - 1) / unit * unit);

  shard_elems_ = total / P;
  shard_ = k.alloc(shard_elems_, grads.dtype);
  if (hier) scratch_ = k.alloc(total / L, grads.dtype);
  if (hier && !options.shard) intra_gather_ = intra->dup();
  Communicator* gather = intra_gather_.get();
  for (int64_t end = total; end > 0; end -= bucket) {
    const int64_t begin = std::max<int64_t>(0, end - bucket), n = end - begin;
    Bucket b;
    b.begin = begin;
    b.count = n;
    DPtr g = grads + begin, p = params + begin, part = shard_ + begin / P;
    const int64_t piece = n / P;
    pieces_.push_back({begin + piece_index * piece, piece, begin / P});
    if (!hier) {
      if (options.shard) {
        b.reduce = {[=, &dp] { return dp.ireduce_scatter(g, part, piece); }};
        DPtr mine = p + piece_index * piece;
        b.gather = {[=, &dp] { return dp.iall_gather(mine, p, piece); }};
      } else {
        b.reduce = {[=, &dp] { return dp.iall_reduce(g, n, ReduceOp::sum); }};
      }
    } else {
      DPtr node_part = scratch_ + begin / L;  // this rank's 1/L of the bucket, summed on the node
      b.reduce = {[=] { return intra->ireduce_scatter(g, node_part, n / L); }};
      if (options.shard) {
        b.reduce.push_back([=] { return inter->ireduce_scatter(node_part, part, piece); });
        DPtr block = p + intra->rank() * (n / L), mine = block + inter->rank() * piece;
        b.gather = {[=] { return inter->iall_gather(mine, block, piece); },
                    [=] { return intra->iall_gather(block, p, n / L); }};
      } else {
        b.reduce.push_back([=] { return inter->iall_reduce(node_part, n / L, ReduceOp::sum); });
        b.reduce.push_back([=] { return gather->iall_gather(node_part, g, n / L); });
      }
    }
    buckets_.push_back(std::move(b));
  }
  // Pieces in buffer order, for the optimizer.
  std::reverse(pieces_.begin(), pieces_.end());
}

GradReducer::~GradReducer() {
  for (Bucket& b : buckets_) b.pending.wait();
  k_.free(shard_);
  if (scratch_) k_.free(scratch_);
}

void GradReducer::launch(Bucket& b) {
  b.launched = true;
  b.next = 1;
  b.pending = b.reduce[0]();
}

// Starts the next step of each launched chain whose current step has completed.
void GradReducer::progress() {
  size_t issued_before = SIZE_MAX;  // steps the previous bucket has started
  for (Bucket& b : buckets_) {
    if (!b.launched) break;
    while (b.next < b.reduce.size() && b.next < issued_before && b.pending.test())
      b.pending = b.reduce[b.next++]();
    issued_before = b.next;
  }
}

void GradReducer::ready(int64_t frontier) {
  if (!armed_ || !opts_.overlap) return;
  for (Bucket& b : buckets_)
    if (!b.launched && b.begin >= frontier) launch(b);
  progress();
}

void GradReducer::run_chain(Bucket& b, const std::vector<Step>& chain) {
  b.pending.wait();
  for (; b.next < chain.size(); b.next++) {
    b.pending = chain[b.next]();
    b.pending.wait();
  }
}

void GradReducer::finish() {
  for (Bucket& b : buckets_)
    if (!b.launched) launch(b);
  // In bucket order, so that every step kind stays in bucket order.
  for (Bucket& b : buckets_) run_chain(b, b.reduce);
  for (Bucket& b : buckets_) b.launched = false;
  armed_ = false;
}

void GradReducer::gather_params() {
  if (!opts_.shard) return;
  for (Bucket& b : buckets_) {
    b.next = 1;
    b.pending = b.gather[0]();
  }
  for (Bucket& b : buckets_) run_chain(b, b.gather);
}

}  // namespace trainer
