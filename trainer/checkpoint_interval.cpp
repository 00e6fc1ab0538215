#include "trainer/checkpoint_interval.h"

#include <cmath>

namespace trainer {

double optimum_interval_s(const CheckpointCosts& c) {
  const double d = c.stall_s, M = c.mtbf_s;
  if (d >= 2 * M) return M;
  const double young = std::sqrt(2 * d * M);
  return young * (1 + std::sqrt(d / (2 * M)) / 3 + d / (18 * M)) - d;
}

double expected_loss_s(double interval_s, const CheckpointCosts& c) {
  return (interval_s + c.stall_s) / 2 + c.write_s;
}

double expected_waste(double interval_s, const CheckpointCosts& c) {
  return c.stall_s / (interval_s + c.stall_s) + expected_loss_s(interval_s, c) / c.mtbf_s;
}

}  // namespace trainer
