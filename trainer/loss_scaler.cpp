#include "trainer/loss_scaler.h"

#include <fmt/format.h>

#include <algorithm>

namespace trainer {

LossScaler::LossScaler(const PrecisionConfig& cfg)
    : dynamic_(cfg.compute == "fp16" && cfg.loss_scale == 0),
      scale_(cfg.compute != "fp16" ? 1.0
             : dynamic_            ? cfg.initial_scale
                                   : cfg.loss_scale),
      growth_factor_(cfg.growth_factor),
      backoff_factor_(cfg.backoff_factor),
      min_scale_(cfg.min_scale),
      growth_interval_(cfg.growth_interval),
      hysteresis_(cfg.hysteresis),
      max_min_scale_overflows_(cfg.max_min_scale_overflows),
      hysteresis_left_(cfg.hysteresis) {}

LossScaler::State LossScaler::state() const {
  return {scale_, clean_steps_, hysteresis_left_, min_scale_overflows_, overflows_};
}

void LossScaler::set_state(const State& s) {
  scale_ = s.scale;
  clean_steps_ = int(s.clean_steps);
  hysteresis_left_ = int(s.hysteresis_left);
  min_scale_overflows_ = int(s.min_scale_overflows);
  overflows_ = s.overflows;
}

void LossScaler::update(bool overflow) {
  if (!overflow) {
    min_scale_overflows_ = 0;
    if (dynamic_ && ++clean_steps_ == growth_interval_) {
      clean_steps_ = 0;
      hysteresis_left_ = hysteresis_;
      scale_ *= growth_factor_;
    }
    return;
  }
  overflows_++;
  if (!dynamic_) return;
  clean_steps_ = 0;
  if (scale_ <= min_scale_ && ++min_scale_overflows_ >= max_min_scale_overflows_)
    throw TrainingDiverged(
        fmt::format("the gradients overflowed in {} steps in a row at the minimum loss scale {} "
                    "(precision.min_scale): the loss or the gradients are not finite even unscaled",
                    min_scale_overflows_, min_scale_));
  if (--hysteresis_left_ <= 0) {
    scale_ = std::max(scale_ * backoff_factor_, min_scale_);
    hysteresis_left_ = hysteresis_;
  }
}

}  // namespace trainer
