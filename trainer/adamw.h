#pragma once
// AdamW over spans of the model's flat buffers. With a 16-bit model the optimizer keeps the
// fp32 master weights of its segments (next to the moments, so ZeRO-1 shards them too) and
// rounds each update into the model's compute copy. Each segment is a run of elements with one
// weight decay: the parameter at `offset`, its gradient and its moments at `state_offset` in
// the gradient and state buffers. Without ZeRO the segments are the parameters and the state
// offsets are their own; with ZeRO-1 they are this rank's pieces of the data-parallel shard,
// whose gradients the reducer leaves in a buffer of the shard's size. With ZeRO-3 the model keeps
// no whole parameters: the compute weights are in a buffer of the shard's size too
// (shard_weights, indexed like the state), which the parameter gatherer all-gathers from.
#include <vector>

#include "io/config.h"
#include "model/stage_executor.h"

namespace trainer {

class AdamW {
 public:
  struct Segment {
    int64_t offset, count, state_offset;
    float weight_decay;
  };
  // Every parameter of the model, gradients in model.grads().
  AdamW(StageExecutor& model, const OptimConfig& cfg);
  // The given segments; grads and the moments hold state_elems elements, and shard_weights
  // (ZeRO-3; else null: the weights are model.params()) too.
  AdamW(StageExecutor& model, const OptimConfig& cfg, std::vector<Segment> segments, DPtr grads,
        int64_t state_elems, DPtr shard_weights = {});
  ~AdamW();
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;

  // One update with learning rate lr; gradients are multiplied by grad_scale first (clipping).
  // `step` is the 1-based count of updates, for bias correction.
  void update(float lr, float grad_scale, int64_t step);
  // Mixed precision: the master weights from a flat fp32 buffer laid out like the parameters.
  void init_master(DPtr full);
  // ZeRO-3: the initial weights of the segments into the shard weights (and the master), made
  // one parameter at a time: the whole model is never held.
  void init_shard(uint64_t seed);
  // bf16: round the master weights into the compute copy stochastically (seeded per step).
  void set_stochastic_rounding(uint64_t seed) { stochastic_seed_ = seed; }
  // Rounds the master weights into the compute copy as update `step` did (a resumed run's
  // compute copy then equals the uninterrupted run's, stochastic rounding included).
  void round_master(int64_t step);
  static float weight_decay(const OptimConfig& cfg, const ParamInfo& p);

  const std::vector<Segment>& segments() const { return segments_; }
  DPtr grads() const { return grads_; }
  DPtr master() const { return master_; }                // null unless the model is 16-bit
  DPtr shard_weights() const { return shard_weights_; }  // ZeRO-3's compute weights, or null
  // The exact fp32 weights indexed like the state: the master weights of a 16-bit model, or
  // ZeRO-3's shard of an fp32 one; null when they are model.params() (at segment offsets).
  DPtr state_weights() const { return master_ ? master_ : shard_weights_; }
  // Where segment s's compute weights are.
  DPtr weights_of(const Segment& s) const {
    return shard_weights_ ? shard_weights_ + s.state_offset : model_.params() + s.offset;
  }
  DPtr m() const { return m_; }
  DPtr v() const { return v_; }
  int64_t state_elems() const { return state_elems_; }

 private:
  void round_into_model(const Segment& s, int64_t step);

  StageExecutor& model_;
  OptimConfig cfg_;
  std::vector<Segment> segments_;
  DPtr grads_, m_, v_, master_, shard_weights_;
  int64_t state_elems_;
  uint64_t stochastic_seed_ = 0;
};

}  // namespace trainer
