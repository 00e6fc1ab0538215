#include "trainer/adamw.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <stdexcept>

#include "kernels/cpu/cpu_ops.h"
#include "model/init.h"

namespace trainer {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

std::vector<AdamW::Segment> whole_model(const StageExecutor& model, const OptimConfig& cfg) {
  std::vector<AdamW::Segment> segments;
  for (const ParamInfo& p : model.table().params)
    segments.push_back({p.offset, p.numel, p.offset, AdamW::weight_decay(cfg, p)});
  return segments;
}

AdamW::AdamW(StageExecutor& model, const OptimConfig& cfg, bool offload)
    : AdamW(model, cfg, whole_model(model, cfg), model.grads(), model.table().total, DPtr{},
            offload) {}

AdamW::AdamW(StageExecutor& model, const OptimConfig& cfg, std::vector<Segment> segments,
             DPtr grads, int64_t state_elems, DPtr shard_weights, bool offload)
    : model_(model),
      cfg_(cfg),
      segments_(std::move(segments)),
      grads_(grads),
      shard_weights_(shard_weights),
      state_elems_(state_elems),
      offload_(offload) {
  if (model.windowed_params() && !shard_weights)
    throw std::invalid_argument("AdamW: a model without whole parameters needs shard weights");
  Kernels& k = model.kernels();
  if (offload) {
    if (model.dtype() == DType::f64) throw std::invalid_argument("AdamW: offload is fp32 state");
    // Host memory, zeroed: nothing but host code reads or writes it.
    auto host = [&] {
      auto* p = static_cast<std::byte*>(k.alloc_host(state_elems * 4));
      std::memset(p, 0, size_t(state_elems) * 4);
      return DPtr{p, DType::f32, false};
    };
    m_ = host();
    v_ = host();
    master_ = host();
    const int64_t largest = offload_host_elems(segments_) / 2;
    for (std::vector<float>& g : host_grads_) g.resize(size_t(largest));
    if (is_half(model.dtype())) staging_ = k.alloc(std::max<int64_t>(largest, 1), DType::f32);
    return;
  }
  const DType state = is_half(model.dtype()) ? DType::f32 : model.dtype();
  m_ = k.alloc(state_elems, state);
  v_ = k.alloc(state_elems, state);
  if (is_half(model.dtype())) master_ = k.alloc(state_elems, DType::f32);
}

AdamW::~AdamW() {
  Kernels& k = model_.kernels();
  if (offload_) {
    for (DPtr p : {m_, v_, master_}) k.free_host(p.p);
    if (staging_) k.free(staging_);
    return;
  }
  k.free(m_);
  k.free(v_);
  if (master_) k.free(master_);
}

int64_t AdamW::offload_host_elems(const std::vector<Segment>& segments) {
  int64_t largest = 0;
  for (const Segment& s : segments) largest = std::max(largest, s.count);
  return 2 * largest;
}

void AdamW::read_state(State which, int64_t at, float* dst, int64_t n) const {
  const DPtr src = which == State::weights && !master_ ? shard_weights_ : state(which);
  if (offload_)  // all of it on the host (an offloading optimizer always keeps a master)
    std::memcpy(dst, src.as<float>() + at, size_t(n) * 4);
  else
    model_.kernels().download_f32(dst, src + at, n);
}

void AdamW::write_state(State which, int64_t at, const float* src, int64_t n) {
  Kernels& k = model_.kernels();
  if (which == State::weights && shard_weights_) k.upload_f32(shard_weights_ + at, src, n);
  if (which == State::weights && !master_) return;
  if (offload_)
    std::memcpy(state(which).as<float>() + at, src, size_t(n) * 4);
  else
    k.upload_f32(state(which) + at, src, n);
}

void AdamW::init_master(DPtr full) {
  for (const Segment& s : segments_) {
    if (!offload_) {
      model_.kernels().convert(master_ + s.state_offset, full + s.offset, s.count, 0);
      continue;
    }
    model_.kernels().download_f32(master_.as<float>() + s.state_offset, full + s.offset, s.count);
  }
}

void AdamW::init_parameters(uint64_t seed) {
  // In chunks, as StageExecutor::init_parameters: the host never holds a whole parameter.
  constexpr int64_t kChunk = StageExecutor::kInitChunk;
  for (const ParamInfo& p : model_.table().params)
    for (int64_t at = 0; at < p.local_numel(); at += kChunk) {
      const int64_t to = std::min(p.local_numel(), at + kChunk);
      const std::vector<double> values = model_.initial_values(seed, p, at, to);
      const std::vector<float> exact(values.begin(), values.end());
      model_.kernels().upload_f32(model_.params() + p.offset + at, exact.data(), to - at);
      if (!master_) continue;
      for (const Segment& s : segments_) {  // a segment lies within one parameter
        if (s.offset < p.offset || s.offset >= p.offset + p.numel) continue;
        // The segment's elements of this parameter, [begin, end), within the chunk.
        const int64_t begin = s.offset - p.offset, end = std::min(begin + s.count, p.local_numel());
        const int64_t lo = std::max(begin, at), hi = std::min(end, to);
        if (hi > lo)
          write_state(State::weights, s.state_offset + (lo - begin), exact.data() + (lo - at),
                      hi - lo);
      }
    }
}

void AdamW::init_shard(uint64_t seed) {
  Kernels& k = model_.kernels();
  k.zero(shard_weights_, state_elems_);                     // padding rows
  if (master_ && !offload_) k.zero(master_, state_elems_);  // (offloaded: zeroed when made)
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
        write_state(State::weights, to, chunk.data(), n);  // rounded to nearest when 16-bit
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

AdamWArgs AdamW::args_of(const Segment& s, float lr, float grad_scale, int64_t step) const {
  const bool sgd = cfg_.name == "sgd";
  // 1-bit Adam and DGC after their warm-up: v as the last warm-up update left it.
  const bool frozen = cfg_.exchanges_momentum() && step > cfg_.freeze_step;
  return {lr,
          sgd ? float(cfg_.momentum) : float(cfg_.betas[0]),
          float(cfg_.betas[1]),
          float(cfg_.eps),
          s.weight_decay,
          step,
          grad_scale,
          sgd,
          frozen ? cfg_.freeze_step : 0};
}

void AdamW::update(float lr, float grad_scale, int64_t step) {
  if (offload_) return update_offloaded(lr, grad_scale, step);
  for (const Segment& s : segments_) {
    const AdamWArgs args = args_of(s, lr, grad_scale, step);
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

// Gradients of segment i come to the host while a worker thread updates segment i - 1, whose
// weights then go back to the device while the worker updates segment i.
void AdamW::update_offloaded(float lr, float grad_scale, int64_t step) {
  Kernels& k = model_.kernels();
  std::future<void> running;
  const Segment* updating = nullptr;  // the segment `running` updates
  const int threads = omp_get_max_threads();
  for (size_t i = 0; i < segments_.size(); i++) {
    const Segment& s = segments_[i];
    float* grad = host_grads_[i % 2].data();
    k.download_f32(grad, grads_ + s.state_offset, s.count);
    const auto t0 = std::chrono::steady_clock::now();
    if (running.valid()) running.get();
    offload_stats_.waited_s += seconds_since(t0);
    const Segment* done = updating;
    const AdamWArgs args = args_of(s, lr, grad_scale, step);
    running = std::async(std::launch::async, [this, &s, grad, args, threads] {
      omp_set_num_threads(threads);  // a new thread: this rank's share of the cores, not all
      const auto start = std::chrono::steady_clock::now();
      const int64_t at = s.state_offset;
      cpu::adamw_update<float>(master_.as<float>() + at, grad, m_.as<float>() + at,
                               v_.as<float>() + at, s.count, args);
      offload_stats_.update_s += seconds_since(start);  // one update at a time
    });
    updating = &s;
    offload_stats_.segments++;
    if (done) round_into_model(*done, step);
  }
  const auto t0 = std::chrono::steady_clock::now();
  if (running.valid()) running.get();
  offload_stats_.waited_s += seconds_since(t0);
  if (updating) round_into_model(*updating, step);
}

void AdamW::round_into_model(const Segment& s, int64_t step) {
  const uint64_t seed =
      stochastic_seed_
          ? mix64(stochastic_seed_ ^ mix64(uint64_t(step) << 32 ^ uint64_t(s.offset))) | 1
          : 0;
  Kernels& k = model_.kernels();
  if (!offload_) return k.convert(weights_of(s), master_ + s.state_offset, s.count, seed);
  // From the host: straight into fp32 weights, or through the device's staging buffer into
  // 16-bit ones (the same conversion, stochastic rounding included, as from a device master).
  const float* master = master_.as<float>() + s.state_offset;
  if (!staging_) return k.upload_f32(weights_of(s), master, s.count);
  k.upload_f32(staging_, master, s.count);
  k.convert(weights_of(s), staging_, s.count, seed);
}

void AdamW::round_master(int64_t step) {
  if (master_)
    for (const Segment& s : segments_) round_into_model(s, step);
}

}  // namespace trainer
