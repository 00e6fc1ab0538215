#include "trainer/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace trainer {

double lr_at(const OptimConfig& cfg, int64_t step, int64_t total_steps) {
  if (step < cfg.warmup_steps) return cfg.lr * double(step + 1) / double(cfg.warmup_steps);
  if (cfg.schedule == "constant") return cfg.lr;
  const int64_t decay_steps = std::max<int64_t>(1, total_steps - 1 - cfg.warmup_steps);
  const double progress =
      std::clamp(double(step - cfg.warmup_steps) / double(decay_steps), 0.0, 1.0);
  const double factor = cfg.schedule == "linear"
                            ? 1.0 - progress
                            : 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return cfg.min_lr + factor * (cfg.lr - cfg.min_lr);
}

}  // namespace trainer
