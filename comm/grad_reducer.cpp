#include "comm/grad_reducer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace trainer {

int64_t GradReducer::window_buffer_elems(const std::vector<GradUnit>& units, int dp, int node_ranks,
                                         int windows) {
  const int64_t n = largest_lent_unit(units);
  if (node_ranks <= 0) return windows * (n + n / dp);
  // Hierarchically, the held units' parts summed inside the node too.
  return windows * (n + n / dp + n / node_ranks) + held_end(units) / node_ranks;
}

GradReducer::GradReducer(Kernels& k, DPtr grads, DPtr params, int64_t total, Communicator& dp,
                         Communicator* intra, Communicator* inter, const ReducerOptions& options)
    : k_(k),
      opts_(options),
      dp_(dp),
      intra_(intra && inter ? intra : nullptr),
      inter_(intra && inter ? inter : nullptr),
      gathers_params_(bool(params)),
      grads_(grads) {
  const int64_t P = dp.size(), unit = 16 * P;
  if (total % unit) throw std::invalid_argument("GradReducer: total must be a multiple of 16 dp");
  const bool hier = intra && inter;
  if (hier && intra->size() * inter->size() != P)
    throw std::invalid_argument("GradReducer: intra x inter must be the data-parallel group");
  windowed_ = !options.units.empty();
  if (windowed_ && (!options.shard || options.compression.method != "none"))
    throw std::invalid_argument("GradReducer: gradient units are ZeRO-2's, without compression");
  const int64_t L = hier ? intra->size() : 1, N = hier ? inter->size() : P;
  // This rank's piece of every bucket: its dp rank, or hierarchically, the part its node's
  // reduce-scatter gives it, sub-divided across nodes.
  const int64_t piece_index = hier ? int64_t(intra->rank()) * N + inter->rank() : dp.rank();
  const int64_t bucket = std::max<int64_t>(unit, (options.bucket_elems + unit - 1) / unit * unit);
  bucket_bytes_ = bucket * int64_t(dtype_size(grads.dtype));

  if (options.shard) {  // ZeRO's gradient shard; plain data parallelism reduces in place
    shard_elems_ = total / P;
    shard_ = k.alloc(shard_elems_, grads.dtype);
  }
  node_ranks_ = L;
  // Hierarchically, each bucket's part summed inside the node (ZeRO-2: the held units'; the
  // windows have their own).
  const int64_t node_scratch = windowed_ ? held_end(options.units) / L : total / L;
  if (hier && node_scratch > 0) scratch_ = k.alloc(node_scratch, grads.dtype);
  if (hier && !options.shard) intra_gather_ = intra->dup();
  Communicator* gather = intra_gather_.get();
  // The buckets, from the end of the buffer: cut to the bucket size, or ZeRO-2's units.
  std::vector<std::pair<int64_t, int64_t>> ranges;  // [begin, end)
  if (windowed_) {
    for (auto u = options.units.rbegin(); u != options.units.rend(); ++u) {
      if (u->begin % unit || u->end % unit)
        throw std::invalid_argument("GradReducer: gradient units must be aligned to 16 dp");
      ranges.push_back({u->begin, u->end});
    }
  } else {
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
      ranges.push_back({begin, end});
    }
  }
  for (size_t i = 0; i < ranges.size(); i++) {
    const auto [begin, end] = ranges[i];
    const int64_t n = end - begin;
    Bucket b;
    b.begin = begin;
    b.count = n;
    b.held = windowed_ && options.units[ranges.size() - 1 - i].held;
    DPtr p = params + begin;
    const int64_t piece = n / P;
    pieces_.push_back({begin + piece_index * piece, piece, begin / P});
    b.piece_offset = begin + piece_index * piece;
    const CompressionOptions& co = options.compression;
    const bool gradients_compressed = co.method != "none" && n >= co.min_bucket_elems;
    if (gradients_compressed || options.momentum.on) {
      if (grads.dtype != DType::f32)
        throw std::invalid_argument("GradReducer: compression needs fp32 gradients");
      // Hierarchically only the node's part of the bucket crosses nodes, compressed: this
      // rank's 1/L of it, summed inside the node.
      const int64_t lo = hier ? begin + intra->rank() * (n / L) : begin, hi = lo + n / L;
      // The whole rows of each matrix in it (a node's parts cut matrices: each side's rows are
      // a matrix of their own for PowerSGD).
      std::vector<MatrixView> inside;
      for (const MatrixView& m : options.matrices) {
        const int64_t from = std::max(lo, m.offset), to = std::min(hi, m.offset + m.rows * m.cols);
        const int64_t first = (from - m.offset + m.cols - 1) / m.cols;
        const int64_t last = (to - m.offset) / m.cols;  // past the last whole row
        if (from < to && first < last)
          inside.push_back({m.offset + first * m.cols - lo, last - first, m.cols});
      }
      std::vector<ExactRange> exact;
      for (const ExactRange& r : options.exact) {
        const int64_t from = std::max(r.offset, lo), to = std::min(r.offset + r.count, hi);
        if (from < to) exact.push_back({from - lo, to - from});
      }
      const Communicator& across = hier ? *inter : dp;
      b.make_compressor =
          [part = n / L, inside, exact,
           place = GroupPlace{across.rank(), across.size()}](const CompressionOptions& o) {
            return make_compressor(o, part, inside, exact, place);
          };
      if (gradients_compressed) b.compressor = b.make_compressor(co);
      if (options.momentum.on) {
        b.momentum_compressor = b.make_compressor(options.momentum.compression);
        b.momentum.assign(size_t(n / L), 0.0f);
      }
    }
    if (!hier) {
      if (options.shard) {
        b.reduce = {
            [=, &dp](const Buffers& x) { return dp.ireduce_scatter(x.grads, x.piece, piece); }};
        DPtr mine = p + piece_index * piece;
        b.gather = {[=, &dp] { return dp.iall_gather(mine, p, piece); }};
      } else {
        b.reduce = {
            [=, &dp](const Buffers& x) { return dp.iall_reduce(x.grads, n, ReduceOp::sum); }};
      }
    } else {
      // x.node: this rank's 1/L of the bucket, summed on the node.
      b.reduce = {[=](const Buffers& x) { return intra->ireduce_scatter(x.grads, x.node, n / L); }};
      if (options.shard) {
        b.reduce.push_back(
            [=](const Buffers& x) { return inter->ireduce_scatter(x.node, x.piece, piece); });
        DPtr block = p + intra->rank() * (n / L), mine = block + inter->rank() * piece;
        b.gather = {[=] { return inter->iall_gather(mine, block, piece); },
                    [=] { return intra->iall_gather(block, p, n / L); }};
      } else {
        b.reduce.push_back(
            [=](const Buffers& x) { return inter->iall_reduce(x.node, n / L, ReduceOp::sum); });
        b.reduce.push_back(
            [=](const Buffers& x) { return gather->iall_gather(x.node, x.grads, n / L); });
      }
    }
    buckets_.push_back(std::move(b));
  }
  if (windowed_) {
    for (size_t u = 0; u < options.units.size(); u++)
      unit_bucket_.push_back(int(options.units.size() - 1 - u));
    unit_window_.assign(options.units.size(), -1);
    window_elems_ = largest_lent_unit(options.units);
    bucket_bytes_ = window_elems_ * int64_t(dtype_size(grads.dtype));  // what a bucket can be
    for (int w = 0; w < (window_elems_ > 0 ? options.windows : 0); w++) {
      Window win;
      win.at.grads = k.alloc(window_elems_, grads.dtype);
      win.at.piece = k.alloc(window_elems_ / P, grads.dtype);
      if (hier) win.at.node = k.alloc(window_elems_ / L, grads.dtype);
      windows_.push_back(win);
    }
  }
  // Pieces in buffer order, for the optimizer.
  std::reverse(pieces_.begin(), pieces_.end());
}

GradReducer::~GradReducer() {
  flights_.clear();  // each waited for
  for (Window& w : windows_)
    for (DPtr d : {w.at.grads, w.at.piece, w.at.node})
      if (d) k_.free(d);
  if (shard_) k_.free(shard_);
  if (scratch_) k_.free(scratch_);
}

GradReducer::Buffers GradReducer::flat_buffers(const Bucket& b) const {
  return {grads_ + b.begin, scratch_ ? scratch_ + b.begin / node_ranks_ : DPtr{},
          shard_ ? shard_ + b.begin / dp_.size() : DPtr{}};
}

void GradReducer::launch(Bucket& b, Buffers at, int window) {
  b.launched = true;
  Flight& f = flights_.emplace_back();
  f.bucket = &b;
  f.at = at;
  f.window = window;
  f.next = 1;
  f.pending = b.reduce[0](at);
}

// Starts the next step of each flight whose current step has completed, and retires the
// finished ones at the front.
void GradReducer::progress() {
  size_t issued_before = SIZE_MAX;  // steps the previous flight has started
  for (Flight& f : flights_) {
    const std::vector<Step>& chain = f.bucket->reduce;
    while (f.next < chain.size() && f.next < issued_before && f.pending.test())
      f.pending = chain[f.next++](f.at);
    issued_before = f.next;
  }
  while (!flights_.empty() && flights_.front().next == flights_.front().bucket->reduce.size() &&
         flights_.front().pending.test())
    retire_front();
}

void GradReducer::retire_front() {
  Flight& f = flights_.front();
  const std::vector<Step>& chain = f.bucket->reduce;
  f.pending.wait();
  for (; f.next < chain.size(); f.next++) {
    f.pending = chain[f.next](f.at);
    f.pending.wait();
  }
  if (f.window >= 0) {  // ZeRO-2: this backward's piece joins the earlier ones
    const int64_t piece = f.bucket->count / dp_.size();
    const DPtr into = shard_ + f.bucket->begin / dp_.size();
    k_.residual_forward(into, into, f.at.piece, piece);
    windows_[f.window].lent = false;
  }
  flights_.pop_front();
}

void GradReducer::start_step(int64_t step) {
  exchanging_momentum_ = opts_.momentum.on && step >= opts_.momentum.from_step;
  compressing_ = exchanging_momentum_ ||
                 (opts_.compression.method != "none" && step >= opts_.compression.warmup_steps);
  if (exchanging_momentum_ && opts_.momentum.local)
    for (Bucket& b : buckets_)
      if (b.momentum_compressor) b.momentum_compressor->set_ratio(kept_fraction(step));
  if (windowed_) k_.zero(shard_, shard_elems_);
}

DPtr GradReducer::open(int unit) {
  Bucket& b = buckets_.at(unit_bucket_.at(unit));
  if (b.held || windows_.empty()) throw std::logic_error("GradReducer: no window for this unit");
  auto free_window = [&] {
    for (size_t w = 0; w < windows_.size(); w++)
      if (!windows_[w].lent) return int(w);
    return -1;
  };
  int w;
  while ((w = free_window()) < 0) {
    if (flights_.empty()) throw std::logic_error("GradReducer: every window is open");
    retire_front();
  }
  windows_[w].lent = true;
  unit_window_[unit] = w;
  k_.zero(windows_[w].at.grads, b.count);
  return windows_[w].at.grads;
}

void GradReducer::close(int unit, int layers_left) {
  Bucket& b = buckets_.at(unit_bucket_.at(unit));
  const int w = std::exchange(unit_window_.at(unit), -1);
  if (w < 0) throw std::logic_error("GradReducer: close() without open()");
  b.layers_left = opts_.overlap ? layers_left : -1;  // else backward waits for it: not overlapped
  launch(b, windows_[w].at, w);
  if (opts_.overlap)
    progress();
  else
    while (!flights_.empty()) retire_front();
}

GradReducer::CompressionStats GradReducer::take_compression_stats() {
  return std::exchange(compression_stats_, {});
}

int64_t GradReducer::compression_state_size() const {
  int64_t total = opts_.momentum.on ? 1 : 0;
  for (const Bucket& b : buckets_) {
    if (b.compressor) total += b.compressor->state_size();
    if (b.momentum_compressor)
      total += b.momentum_compressor->state_size() + int64_t(b.momentum.size());
  }
  return total;
}

void GradReducer::compression_state(std::vector<float>& out) const {
  out.resize(size_t(compression_state_size()));
  float* at = out.data();
  for (auto it = buckets_.rbegin(); it != buckets_.rend(); ++it) {
    if (it->compressor) {
      it->compressor->save_state(at);
      at += it->compressor->state_size();
    }
    if (it->momentum_compressor) {
      it->momentum_compressor->save_state(at);
      at += it->momentum_compressor->state_size();
      at = std::copy(it->momentum.begin(), it->momentum.end(), at);
    }
  }
  if (opts_.momentum.on) *at = momentum_ready_ ? 1.0f : 0.0f;
}

std::vector<float> GradReducer::compression_state() const {
  std::vector<float> out;
  compression_state(out);
  return out;
}

bool GradReducer::set_compression_state(const std::vector<float>& all) {
  if (compression_state_size() != int64_t(all.size())) return false;
  const float* at = all.data();
  for (auto it = buckets_.rbegin(); it != buckets_.rend(); ++it) {
    if (it->compressor) {
      it->compressor->set_state(at);
      at += it->compressor->state_size();
    }
    if (it->momentum_compressor) {
      it->momentum_compressor->set_state(at);
      at += it->momentum_compressor->state_size();
      std::copy_n(at, it->momentum.size(), it->momentum.begin());
      at += it->momentum.size();
    }
  }
  if (opts_.momentum.on) momentum_ready_ = all.back() != 0;
  return true;
}

void GradReducer::reset_compression_state() {
  for (Bucket& b : buckets_) {
    if (b.compressor) b.compressor = b.make_compressor(opts_.compression);
    if (b.momentum_compressor)
      b.momentum_compressor = b.make_compressor(opts_.momentum.compression);
    std::fill(b.momentum.begin(), b.momentum.end(), 0.0f);
  }
  momentum_ready_ = false;
}

void GradReducer::read_part(const Bucket& b, const OptimizerReader& read, float* dst) {
  Communicator& across = intra_ ? *inter_ : dp_;
  const int64_t part = b.count / node_ranks_;
  if (!opts_.shard)  // the optimizer holds the whole buffer, as it is laid out
    return read(b.begin + (intra_ ? intra_->rank() : 0) * part, dst, part);
  // Each rank exchanging the part holds one piece of it: they are gathered by a sum.
  const int64_t piece = b.count / dp_.size();
  std::fill(dst, dst + part, 0.0f);
  read(b.begin / dp_.size(), dst + across.rank() * piece, piece);
  across.all_reduce(host_ptr(dst), part, ReduceOp::sum);
}

double GradReducer::kept_fraction(int64_t step) const {
  const auto& o = opts_.momentum;
  const double final = o.compression.topk_ratio, first = std::max(final, 0.25);
  const int64_t t = step - o.from_step;
  if (t >= o.sparsity_warmup_steps || t < 0) return final;
  const double done = double(t) / double(o.sparsity_warmup_steps);
  return std::exp((1 - done) * std::log(first) + done * std::log(final));
}

void GradReducer::start_momentum(const OptimizerReader& momentum) {
  // DGC's velocities are each rank's share of m.
  const float share = opts_.momentum.local ? 1.0f / float((intra_ ? *inter_ : dp_).size()) : 1;
  for (Bucket& b : buckets_)
    if (b.momentum_compressor) {
      read_part(b, momentum, b.momentum.data());
      for (float& x : b.momentum) x *= share;
    }
  momentum_ready_ = true;
}

void GradReducer::skip() {
  started_.assign(buckets_.size(), -1);
  for (Bucket& b : buckets_) b.launched = false;
  armed_ = false;
}

// A compressed bucket: a lossy all-reduce over the whole data-parallel group (compressed
// messages are all-gathered or summed, never reduce-scattered), then ZeRO-1 keeps its piece.
// Hierarchically, compression is for the links between nodes: the bucket is reduce-scattered
// inside the node as it is, each rank's part crosses nodes compressed (with its peers at the
// same place on the other nodes), and the parts are gathered back inside the node.
void GradReducer::reduce_compressed(Bucket& b) {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t L = intra_ ? intra_->size() : 1, part = b.count / L;
  const DPtr bucket = grads_ + b.begin, mine = intra_ ? scratch_ + b.begin / L : bucket;
  if (intra_) intra_->reduce_scatter(bucket, mine, part);
  Communicator& across = intra_ ? *inter_ : dp_;
  // Compressors work on host memory: a GPU's bucket makes a round trip.
  if (mine.device) {
    host_bucket_.resize(size_t(part));
    k_.copy_to_host(host_bucket_.data(), mine, part);
  }
  float* x = mine.device ? host_bucket_.data() : mine.as<float>();
  if (exchanging_momentum_) {  // this rank's share of the momentum, with its gradients
    if (!momentum_ready_)
      throw std::logic_error("GradReducer: momentum exchanged before start_momentum()");
    const float beta = opts_.momentum.beta1, added = (1 - beta) * gradient_scale_;
    if (opts_.momentum.local) {  // DGC: the own velocity is sent (its accumulation, top-k)
      for (int64_t i = 0; i < part; i++) x[i] = b.momentum[i] = beta * b.momentum[i] + added * x[i];
    } else {
      const float kept = beta / float(across.size());
      for (int64_t i = 0; i < part; i++) x[i] = kept * b.momentum[i] + added * x[i];
    }
  }
  active(b)->all_reduce(across, x, part);
  if (exchanging_momentum_) {
    if (!opts_.momentum.local)
      std::copy_n(x, part, b.momentum.begin());
    else if (opts_.momentum.masking)
      b.momentum_compressor->mask_sent(b.momentum.data());
  }
  if (mine.device) k_.copy_from_host(mine, host_bucket_.data(), part);
  if (intra_) intra_->all_gather(mine, bucket, part);
  if (opts_.shard)
    k_.convert(shard_ + b.begin / dp_.size(), grads_ + b.piece_offset, b.count / dp_.size(), 0);
  compression_stats_.uncompressed_bytes += uncompressed_bytes(part, across.size());
  compression_stats_.seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void GradReducer::ready(int64_t frontier, int layers_left) {
  // ZeRO-2's buckets start as their windows close; here the flights are driven on.
  if (windowed_) return progress();
  // Compressed steps reduce at finish(), bucket by bucket, so that blocking compressed
  // exchanges and chains keep one order of collectives on every rank.
  if (!armed_ || !opts_.overlap || compressing_) return;
  for (Bucket& b : buckets_)
    if (!b.launched && b.begin >= frontier) {
      launch(b, flat_buffers(b));
      b.layers_left = layers_left;
    }
  progress();
}

void GradReducer::finish() {
  started_.clear();
  for (Bucket& b : buckets_) started_.push_back(std::exchange(b.layers_left, -1));
  if (compressing_) {
    for (Bucket& b : buckets_) {
      if (active(b)) {
        reduce_compressed(b);
      } else {
        launch(b, flat_buffers(b));
        while (!flights_.empty()) retire_front();
      }
    }
  } else {
    // In bucket order, so that every step kind stays in bucket order (ZeRO-2: the held units;
    // the others were started as their windows closed).
    for (Bucket& b : buckets_)
      if (!b.launched && (!windowed_ || b.held)) launch(b, flat_buffers(b));
    while (!flights_.empty()) retire_front();
  }
  for (Bucket& b : buckets_) b.launched = false;
  armed_ = false;
}

void GradReducer::gather_params() {
  if (!opts_.shard) return;
  if (!gathers_params_)
    throw std::logic_error(
        "GradReducer: no parameter buffer to gather into (ZeRO-3 gathers its "
        "own, comm/param_gatherer.h)");
  for (Bucket& b : buckets_) {
    b.gathered = 1;
    b.gathering = b.gather[0]();
  }
  for (Bucket& b : buckets_) {
    b.gathering.wait();
    for (; b.gathered < b.gather.size(); b.gathered++) {
      b.gathering = b.gather[b.gathered]();
      b.gathering.wait();
    }
  }
}

}  // namespace trainer
