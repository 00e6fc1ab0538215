#include "trainer/adamw.h"

#include <algorithm>
#include <stdexcept>

#include "model/init.h"

namespace trainer {

std::vector<AdamW::Segment> whole_model(const StageExecutor& model, const OptimConfig& cfg) {
  std::vector<AdamW::Segment> segments;
  for (const ParamInfo& p : model.table().params)
    segments.push_back({p.offset, p.numel, p.offset, AdamW::weight_decay(cfg, p)});
  return segments;
}

AdamW::AdamW(StageExecutor& model, const OptimConfig& cfg)
    : AdamW(model, cfg, whole_model(model, cfg), model.grads(), model.table().total) {}

AdamW::AdamW(StageExecutor& model, const OptimConfig& cfg, std::vector<Segment> segments,
             DPtr grads, int64_t state_elems, DPtr shard_weights)
    : model_(model),
      cfg_(cfg),
      segments_(std::move(segments)),
      grads_(grads),
      shard_weights_(shard_weights),
      state_elems_(state_elems) {
  if (model.windowed_params() && !shard_weights)
    throw std::invalid_argument("AdamW: a model without whole parameters needs shard weights");
  const DType state = is_half(model.dtype()) ? DType::f32 : model.dtype();
  m_ = model.kernels().alloc(state_elems, state);
  v_ = model.kernels().alloc(state_elems, state);
  if (is_half(model.dtype())) master_ = model.kernels().alloc(state_elems, DType::f32);
}

AdamW::~AdamW() {
  model_.kernels().free(m_);
  model_.kernels().free(v_);
  if (master_) model_.kernels().free(master_);
}

void AdamW::init_master(DPtr full) {
  for (const Segment& s : segments_)
    model_.kernels().convert(master_ + s.state_offset, full + s.offset, s.count, 0);
}

void AdamW::init_shard(uint64_t seed) {
  Kernels& k = model_.kernels();
  k.zero(shard_weights_, state_elems_);  // padding rows
  if (master_) k.zero(master_, state_elems_);
  for (const ParamInfo& p : model_.table().params)
    for (const Segment& s : segments_) {  // a segment lies within one parameter
      if (s.offset < p.offset || s.offset >= p.offset + p.numel) continue;
      const int64_t begin = s.offset - p.offset, end = std::min(begin + s.count, p.local_numel());
      // In chunks: the host holds a few hundred kB, never a parameter's piece.
      constexpr int64_t kChunk = 1 << 16;
      for (int64_t at = begin; at < end; at += kChunk) {
        const int64_t n = std::min(kChunk, end - at), to = s.state_offset + (at - begin);
        const std::vector<double> values = model_.initial_values(seed, p, at, at + n);
        const std::vector<float> chunk(values.begin(), values.end());
        k.upload_f32(shard_weights_ + to, chunk.data(), n);  // rounded to nearest when 16-bit
        if (master_) k.upload_f32(master_ + to, chunk.data(), n);
      }
    }
}

float AdamW::weight_decay(const OptimConfig& cfg, const ParamInfo& p) {
  switch (p.kind) {
    case ParamKind::matrix:
      return float(cfg.weight_decay);
    case ParamKind::embedding:
      return cfg.decay_embeddings ? float(cfg.weight_decay) : 0.0f;
    case ParamKind::bias:
    case ParamKind::norm:
      return cfg.decay_norms_and_biases ? float(cfg.weight_decay) : 0.0f;
  }
  return 0.0f;
}

void AdamW::update(float lr, float grad_scale, int64_t step) {
  for (const Segment& s : segments_) {
    AdamWArgs args{lr,
                   float(cfg_.betas[0]),
                   float(cfg_.betas[1]),
                   float(cfg_.eps),
                   s.weight_decay,
                   step,
                   grad_scale};
    Kernels& k = model_.kernels();
    if (!master_) {
      k.adamw_update(weights_of(s), grads_ + s.state_offset, m_ + s.state_offset,
                     v_ + s.state_offset, s.count, args);
      continue;
    }
    // 16-bit model: the update goes to the fp32 master weights, which are then rounded into the
    // compute copy (stochastically with a seed per step and segment, when asked).
    k.adamw_update(master_ + s.state_offset, grads_ + s.state_offset, m_ + s.state_offset,
                   v_ + s.state_offset, s.count, args);
    round_into_model(s, step);
  }
}

void AdamW::round_into_model(const Segment& s, int64_t step) {
  const uint64_t seed =
      stochastic_seed_
          ? mix64(stochastic_seed_ ^ mix64(uint64_t(step) << 32 ^ uint64_t(s.offset))) | 1
          : 0;
  model_.kernels().convert(weights_of(s), master_ + s.state_offset, s.count, seed);
}

void AdamW::round_master(int64_t step) {
  if (master_)
    for (const Segment& s : segments_) round_into_model(s, step);
}

}  // namespace trainer
