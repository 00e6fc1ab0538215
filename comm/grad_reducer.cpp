#include "comm/grad_reducer.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace trainer {

GradReducer::GradReducer(Kernels& k, DPtr grads, DPtr params, int64_t total, Communicator& dp,
                         Communicator* intra, Communicator* inter, const ReducerOptions& options)
    : k_(k), opts_(options), dp_(dp), grads_(grads) {
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
  bucket_bytes_ = bucket * int64_t(dtype_size(grads.dtype));

  if (options.shard) {  // ZeRO-1's gradient shard; plain data parallelism reduces in place
    shard_elems_ = total / P;
    shard_ = k.alloc(shard_elems_, grads.dtype);
  }
  if (hier) scratch_ = k.alloc(total / L, grads.dtype);
  if (hier && !options.shard) intra_gather_ = intra->dup();
  Communicator* gather = intra_gather_.get();
  // PowerSGD compresses whole matrices: its buckets grow downwards to the start of any weight
  // matrix they would cut (the GPT-2 vocabulary's embedding alone is ~80 MB).
  const bool whole_matrices = options.compression.method == "powersgd";
  for (int64_t end = total, begin; end > 0; end = begin) {
    begin = std::max<int64_t>(0, end - bucket);
    for (bool moved = whole_matrices; moved;) {
      moved = false;
      for (const MatrixView& m : options.matrices)
        if (m.offset < begin && begin < m.offset + m.rows * m.cols) {
          begin = m.offset / unit * unit;
          moved = true;
        }
    }
    const int64_t n = end - begin;
    Bucket b;
    b.begin = begin;
    b.count = n;
    DPtr g = grads + begin, p = params + begin, part = shard_ + begin / P;
    const int64_t piece = n / P;
    pieces_.push_back({begin + piece_index * piece, piece, begin / P});
    b.piece_offset = begin + piece_index * piece;
    const CompressionOptions& co = options.compression;
    if (co.method != "none" && n * 4 >= co.min_bucket_elems * 4) {
      if (grads.dtype != DType::f32)
        throw std::invalid_argument("GradReducer: compression needs fp32 gradients");
      std::vector<MatrixView> inside;
      for (const MatrixView& m : options.matrices)
        if (m.offset >= begin && m.offset + m.rows * m.cols <= end)
          inside.push_back({m.offset - begin, m.rows, m.cols});
      b.compressor = make_compressor(co, n, inside);
    }
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
  if (shard_) k_.free(shard_);
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

void GradReducer::set_step(int64_t step) {
  compressing_ = opts_.compression.method != "none" && step >= opts_.compression.warmup_steps;
}

GradReducer::CompressionStats GradReducer::take_compression_stats() {
  return std::exchange(compression_stats_, {});
}

std::vector<float> GradReducer::compression_state() const {
  std::vector<float> out;
  for (auto it = buckets_.rbegin(); it != buckets_.rend(); ++it)
    if (it->compressor) {
      const std::vector<float> s = it->compressor->state();
      out.insert(out.end(), s.begin(), s.end());
    }
  return out;
}

bool GradReducer::set_compression_state(const std::vector<float>& all) {
  int64_t total = 0;
  for (const Bucket& b : buckets_)
    if (b.compressor) total += b.compressor->state_size();
  if (total != int64_t(all.size())) return false;
  int64_t at = 0;
  for (auto it = buckets_.rbegin(); it != buckets_.rend(); ++it)
    if (it->compressor) {
      it->compressor->set_state(all.data() + at);
      at += it->compressor->state_size();
    }
  return true;
}

// A compressed bucket: a lossy all-reduce over the whole data-parallel group (compressed
// messages are all-gathered or summed, never reduce-scattered), then ZeRO-1 keeps its piece.
void GradReducer::reduce_compressed(Bucket& b) {
  const auto t0 = std::chrono::steady_clock::now();
  // Compressors work on host memory: a GPU's bucket makes a round trip.
  const DPtr bucket = grads_ + b.begin;
  if (bucket.device) {
    host_bucket_.resize(size_t(b.count));
    k_.copy_to_host(host_bucket_.data(), bucket, b.count);
    b.compressor->all_reduce(dp_, host_bucket_.data(), b.count);
    k_.copy_from_host(bucket, host_bucket_.data(), b.count);
  } else {
    b.compressor->all_reduce(dp_, bucket.as<float>(), b.count);
  }
  if (opts_.shard)
    k_.convert(shard_ + b.begin / dp_.size(), grads_ + b.piece_offset, b.count / dp_.size(), 0);
  compression_stats_.uncompressed_bytes += uncompressed_bytes(b.count, dp_.size());
  compression_stats_.seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void GradReducer::ready(int64_t frontier, int layers_left) {
  // Compressed steps reduce at finish(), bucket by bucket, so that blocking compressed
  // exchanges and chains keep one order of collectives on every rank.
  if (!armed_ || !opts_.overlap || compressing_) return;
  for (Bucket& b : buckets_)
    if (!b.launched && b.begin >= frontier) {
      launch(b);
      b.layers_left = layers_left;
    }
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
  started_.clear();
  for (Bucket& b : buckets_) started_.push_back(std::exchange(b.layers_left, -1));
  if (compressing_) {
    for (Bucket& b : buckets_) {
      if (b.compressor) {
        reduce_compressed(b);
      } else {
        launch(b);
        run_chain(b, b.reduce);
        b.launched = false;
      }
    }
    armed_ = false;
    return;
  }
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
