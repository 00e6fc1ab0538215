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
//
// 1-bit Adam ([optim] name = "onebit_adam") is AdamW for its first freeze_step updates; after
// them v stays as it was, and the gradient each update gets is the momentum itself, exchanged
// across the data-parallel ranks in 1 bit by the reducer (comm/grad_reducer.h), which the update
// takes as m (AdamWArgs::variance_step). DGC ([optim] name = "dgc_adam") the same, its m the
// sum of the ranks' top-k messages of their own momentum.
//
// Offload (ZeRO-Offload, Ren et al. 2021; DeepSpeed's offload_optimizer): the fp32 master
// weights (for an fp32 model too) and both moments live in host memory (pinned on a GPU) and the
// update runs on CPU threads. Segment by segment, its gradients come to the host while the
// previous segment is updated on a worker thread, and each updated segment's weights go back to
// the device while the next is updated. Host code alone touches the host state; the device's
// buffers are reached only by the backend's copies (download_f32, upload_f32, convert), so the
// CPU backend runs the GPU's code path up to the memcpy, and the update is the same function
// on the same values: bitwise the device update.
#include <utility>
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
  AdamW(StageExecutor& model, const OptimConfig& cfg, bool offload = false);
  // The given segments; grads and the moments hold state_elems elements, and shard_weights
  // (ZeRO-3; else null: the weights are model.params()) too.
  AdamW(StageExecutor& model, const OptimConfig& cfg, std::vector<Segment> segments, DPtr grads,
        int64_t state_elems, DPtr shard_weights = {}, bool offload = false);
  ~AdamW();
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;

  // One update with learning rate lr; gradients are multiplied by grad_scale first (clipping).
  // `step` is the 1-based count of updates, for bias correction.
  void update(float lr, float grad_scale, int64_t step);
  // Mixed precision: the master weights from a flat fp32 buffer laid out like the parameters.
  void init_master(DPtr full);
  // The initial weights (model.initial_values) one parameter at a time: exact fp32 into the
  // master's segments, rounded to nearest into the model, with no whole-model temporary.
  void init_parameters(uint64_t seed);
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
  // The fp32 master weights: of a 16-bit model, or with offload of any model (then in host
  // memory); else null.
  DPtr master() const { return master_; }
  bool offloaded() const { return offload_; }
  // Offload's work since the last call: segments updated on the host, the seconds the host's
  // updates took, and those the caller waited for them (what the copies did not hide).
  struct OffloadStats {
    int64_t segments = 0;
    double update_s = 0, waited_s = 0;
  };
  OffloadStats take_offload_stats() { return std::exchange(offload_stats_, {}); }
  // The state (which: master or shard weights, m, v) at state offset `at`, to and from host
  // fp32: through the backend's copies, or for offloaded state a host copy. Writing the weights
  // writes the master and ZeRO-3's shard weights, whichever there are.
  enum class State { weights, m, v };
  void read_state(State which, int64_t at, float* dst, int64_t n) const;
  void write_state(State which, int64_t at, const float* src, int64_t n);
  // Host bytes offload holds besides the state: two segments' gradients in fp32.
  static int64_t offload_host_elems(const std::vector<Segment>& segments);
  DPtr shard_weights() const { return shard_weights_; }  // ZeRO-3's compute weights, or null
  // The exact fp32 weights indexed like the state: the master weights of a 16-bit model, or
  // ZeRO-3's shard of an fp32 one; null when they are model.params() (at segment offsets).
  DPtr state_weights() const { return master_ ? master_ : shard_weights_; }
  // Where segment s's compute weights are.
  DPtr weights_of(const Segment& s) const {
    return shard_weights_ ? shard_weights_ + s.state_offset : model_.params() + s.offset;
  }
  // The moments' buffers (in host memory when offloaded: read_state() reaches either).
  DPtr m() const { return m_; }
  DPtr v() const { return v_; }
  int64_t state_elems() const { return state_elems_; }

 private:
  void round_into_model(const Segment& s, int64_t step);
  void update_offloaded(float lr, float grad_scale, int64_t step);
  AdamWArgs args_of(const Segment& s, float lr, float grad_scale, int64_t step) const;
  DPtr state(State which) const {
    return which == State::m ? m_ : which == State::v ? v_ : master_;
  }

  StageExecutor& model_;
  OptimConfig cfg_;
  std::vector<Segment> segments_;
  DPtr grads_, m_, v_, master_, shard_weights_;
  int64_t state_elems_;
  bool offload_ = false;
  std::vector<float> host_grads_[2];  // offload: the segments' gradients, in turn
  DPtr staging_;  // offload with a 16-bit model: a segment's master weights on the device
  OffloadStats offload_stats_;
  uint64_t stochastic_seed_ = 0;
};

}  // namespace trainer
