#include "trainer/outer_optimizer.h"

#include <algorithm>
#include <stdexcept>

namespace trainer {
OuterOptimizer::OuterOptimizer(const OuterConfig& cfg, StageExecutor& model, AdamW& inner,
                               Communicator& inter, Communicator& intra, bool sharded)
    : cfg_(cfg),
      model_(model),
      inner_(inner),
      inter_(inter),
      intra_(intra),
      sharded_(sharded),
      split_(!sharded && intra.size() > 1) {
  if (!cfg.on()) throw std::invalid_argument("OuterOptimizer: [comm.outer] every_steps is 0");
  for (const AdamW::Segment& s : inner.segments()) n_ += s.count;
  slice_ = split_ ? (n_ + intra.size() - 1) / intra.size() : n_;
  outer_.resize(n_);
  momentum_.assign(n_, 0.0f);
  if (cfg.quantize == "int8") {
    // Copies that must stay equal are exchanged exact: tensor-parallel replicas sit among
    // other neighbours, and a tied embedding's two ends are cut into other ZeRO pieces.
    std::vector<ExactRange> exact;
    const int64_t lo = split_ ? intra.rank() * slice_ : 0, hi = lo + slice_;
    int64_t at = 0;
    for (const AdamW::Segment& s : inner.segments()) {
      for (const ParamInfo& p : model.table().params)
        if (p.offset <= s.offset && s.offset < p.offset + p.numel &&
            p.has_copies(model.shard().stages)) {
          const int64_t from = std::max(at, lo), to = std::min(at + s.count, hi);
          if (from < to) exact.push_back({from - lo, to - from});
        }
      at += s.count;
    }
    CompressionOptions o;
    o.method = "int8";
    quantizer_ = make_compressor(o, slice_, {}, exact, {inter.rank(), inter.size()});
  }
}

void OuterOptimizer::read_weights(float* dst) const {
  for (const AdamW::Segment& s : inner_.segments()) {
    if (inner_.state_weights())  // the fp32 master (wherever it lives)
      inner_.read_state(AdamW::State::weights, s.state_offset, dst, s.count);
    else  // an fp32 model's own weights
      model_.kernels().download_f32(dst, model_.params() + s.offset, s.count);
    dst += s.count;
  }
}

void OuterOptimizer::write_weights(const float* src, int64_t update) {
  for (const AdamW::Segment& s : inner_.segments()) {
    if (inner_.state_weights())
      inner_.write_state(AdamW::State::weights, s.state_offset, src, s.count);
    else
      model_.kernels().upload_f32(model_.params() + s.offset, src, s.count);
    src += s.count;
  }
  inner_.round_master(update);  // a 16-bit model's compute copy from the master
}

void OuterOptimizer::read_moments(AdamW::State which, float* dst) const {
  for (const AdamW::Segment& s : inner_.segments()) {
    inner_.read_state(which, s.state_offset, dst, s.count);
    dst += s.count;
  }
}

void OuterOptimizer::write_moments(AdamW::State which, const float* src) {
  for (const AdamW::Segment& s : inner_.segments()) {
    inner_.write_state(which, s.state_offset, src, s.count);
    src += s.count;
  }
}

void OuterOptimizer::reset() {
  read_weights(outer_.data());
  std::fill(momentum_.begin(), momentum_.end(), 0.0f);
  if (quantizer_) quantizer_->set_state(std::vector<float>(quantizer_->state_size()).data());
}

void OuterOptimizer::step(int64_t update) {
  // This worker's move, outer - local (padded to whole slices without ZeRO).
  std::vector<float> delta(split_ ? slice_ * intra_.size() : n_, 0.0f);
  read_weights(delta.data());
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n_; i++) delta[i] = outer_[i] - delta[i];
  // Summed over the workers: this rank's slice across nodes, then the slices inside the node.
  std::vector<float> slice(delta.begin() + (split_ ? intra_.rank() * slice_ : 0),
                           delta.begin() + (split_ ? intra_.rank() * slice_ : 0) + slice_);
  if (quantizer_)
    quantizer_->all_reduce(inter_, slice.data(), slice_);
  else
    inter_.all_reduce(host_ptr(slice.data()), slice_, ReduceOp::sum);
  if (split_)
    intra_.all_gather(host_ptr(slice.data()), host_ptr(delta.data()), slice_);
  else
    delta = std::move(slice);
  // SGD with (Nesterov) momentum on the mean, as PyTorch's: v = mu v + g; g + mu v (Nesterov)
  // or v is the step.
  const float inv = 1.0f / float(inter_.size()), mu = float(cfg_.momentum), lr = float(cfg_.lr);
  const bool nesterov = cfg_.nesterov;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n_; i++) {
    const float g = delta[i] * inv;
    float u = g;
    if (mu > 0) {
      momentum_[i] = mu * momentum_[i] + g;
      u = nesterov ? g + mu * momentum_[i] : momentum_[i];
    }
    outer_[i] -= lr * u;
  }
  write_weights(outer_.data(), update);
}

// What each rank keeps, so that the ranks together hold each thing once: the outer weights and
// momentum (the same on every node) on the first node; each other node's weights and inner
// moments (the first node's are the checkpoint's tensors); of a node's ranks without ZeRO (which
// all hold the same) the first alone; and every rank's error-feedback residual.
void OuterOptimizer::state(std::vector<float>& out) const {
  const int64_t kept = saves() ? (inter_.rank() == 0 ? 2 : 3) * n_ : 0;
  out.resize(size_t(kept + (quantizer_ ? quantizer_->state_size() : 0)));
  float* at = out.data();
  if (saves() && inter_.rank() == 0) {
    at = std::copy(outer_.begin(), outer_.end(), at);
    at = std::copy(momentum_.begin(), momentum_.end(), at);
  } else if (saves()) {
    read_weights(at);
    read_moments(AdamW::State::m, at + n_);
    read_moments(AdamW::State::v, at + 2 * n_);
    at += 3 * n_;
  }
  if (quantizer_) quantizer_->save_state(at);
}

bool OuterOptimizer::set_state(const std::vector<float>& saved, Communicator& world,
                               int64_t update) {
  const int64_t kept = saves() ? (inter_.rank() == 0 ? 2 : 3) * n_ : 0;
  const int64_t residual = quantizer_ ? quantizer_->state_size() : 0;
  double misfits = int64_t(saved.size()) == kept + residual ? 0 : 1;
  world.all_reduce(host_ptr(&misfits), 1, ReduceOp::max);
  if (misfits > 0) return false;
  // The outer state from the first node's ranks (without ZeRO, from its first rank).
  std::vector<float> buf(2 * n_);
  if (inter_.rank() == 0) {
    if (saves()) std::copy(saved.begin(), saved.begin() + 2 * n_, buf.begin());
    if (!sharded_) intra_.broadcast(host_ptr(buf.data()), 2 * n_, 0);
  }
  inter_.broadcast(host_ptr(buf.data()), 2 * n_, 0);
  std::copy(buf.begin(), buf.begin() + n_, outer_.begin());
  std::copy(buf.begin() + n_, buf.end(), momentum_.begin());
  // The other nodes' own weights and moments.
  if (inter_.rank() != 0) {
    buf.resize(3 * n_);
    if (saves()) std::copy(saved.begin(), saved.begin() + 3 * n_, buf.begin());
    if (!sharded_) intra_.broadcast(host_ptr(buf.data()), 3 * n_, 0);
    write_weights(buf.data(), update);
    write_moments(AdamW::State::m, buf.data() + n_);
    write_moments(AdamW::State::v, buf.data() + 2 * n_);
  }
  if (quantizer_) quantizer_->set_state(saved.data() + kept);
  return true;
}

}  // namespace trainer
