#pragma once
// The fp16 loss scale. Gradients are computed for loss x scale, so that small ones do not flush
// to zero in fp16, and divided by the scale before the update. Dynamically: a step whose
// gradients overflowed (inf/NaN anywhere, on any rank) is skipped and, after `hysteresis`
// overflows in a row, the scale backs off; after `growth_interval` clean steps it grows. At the
// minimum scale, `max_min_scale_overflows` overflows in a row mean that training has diverged:
// that is an error, not a loop. bf16 and fp32 use a fixed scale of 1; a static fp16 scale never
// changes.
#include <cstdint>
#include <stdexcept>

#include "io/config.h"

namespace trainer {

class TrainingDiverged : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

class LossScaler {
 public:
  explicit LossScaler(const PrecisionConfig& cfg);

  double scale() const { return scale_; }
  // Everything that decides future scales, for checkpoints: a resumed run continues exactly.
  struct State {
    double scale = 1;
    int64_t clean_steps = 0, hysteresis_left = 1, min_scale_overflows = 0, overflows = 0;
  };
  State state() const;
  void set_state(const State& s);
  bool dynamic() const { return dynamic_; }
  // After a step's gradients are known: overflow = they hold inf or NaN (the step is skipped).
  void update(bool overflow);
  int64_t overflows() const { return overflows_; }  // skipped steps so far

 private:
  bool dynamic_;
  double scale_, growth_factor_, backoff_factor_, min_scale_;
  int growth_interval_, hysteresis_, max_min_scale_overflows_;
  int clean_steps_ = 0, hysteresis_left_, min_scale_overflows_ = 0;
  int64_t overflows_ = 0;
};

}  // namespace trainer
