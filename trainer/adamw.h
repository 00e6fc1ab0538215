#pragma once
// AdamW over the model's flat buffers: first and second moments use the parameter table's
// offsets, so the update is one kernel call per parameter with its own weight decay.
#include "io/config.h"
#include "model/gpt.h"

namespace trainer {

class AdamW {
 public:
  AdamW(GPT& model, const OptimConfig& cfg);
  ~AdamW();
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;

  // One update with learning rate lr; gradients are multiplied by grad_scale first (clipping).
  // `step` is the 1-based count of updates, for bias correction.
  void update(float lr, float grad_scale, int64_t step);
  float weight_decay(const ParamInfo& p) const;

  DPtr m() const { return m_; }
  DPtr v() const { return v_; }

 private:
  GPT& model_;
  OptimConfig cfg_;
  DPtr m_, v_;
};

}  // namespace trainer
