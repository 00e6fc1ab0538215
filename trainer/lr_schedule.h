#pragma once
#include <cstdint>

#include "io/config.h"

namespace trainer {

// Learning rate for 0-based `step` of `total_steps`: linear warm-up to lr over warmup_steps,
// then cosine, linear or constant decay to min_lr at the last step.
double lr_at(const OptimConfig& cfg, int64_t step, int64_t total_steps);

}  // namespace trainer
