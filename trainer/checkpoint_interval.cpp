#include "trainer/checkpoint_interval.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "io/config.h"
#include "trainer/metrics.h"

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

IntervalAdvisor::IntervalAdvisor(const CheckpointConfig& cfg, int64_t total_steps,
                                 CheckpointCosts costs)
    : costs(costs), cfg_(cfg), total_steps_(total_steps) {}

int64_t IntervalAdvisor::step_timed(double seconds) {
  steps_s_ += seconds;
  return ++steps_timed_;
}

void IntervalAdvisor::advise(MetricsLog& log) {
  if (costs.mtbf_s <= 0 || steps_timed_ == 0) return;
  const bool auto_interval = cfg_.every_steps == CheckpointConfig::kAutoSteps;
  const double step_s = steps_s_ / double(steps_timed_);
  const double optimum = optimum_interval_s(costs);
  const int optimum_steps = int(std::clamp(std::round(optimum / step_s), 1.0, 1e9));
  const int every = auto_interval ? optimum_steps : cfg_.every_steps;
  // The configured interval in seconds: every N steps, every M minutes, or only at the end.
  const double interval = every > 0                ? every * step_s
                          : cfg_.every_minutes > 0 ? cfg_.every_minutes * 60
                                                   : double(total_steps_) * step_s;
  const bool changed = auto_interval && optimum_steps != auto_every_;
  auto_every_ = auto_interval ? optimum_steps : 0;
  log.event({{"checkpoint_advice",
              {{"stall_s", costs.stall_s},
               {"write_s", costs.write_s},
               {"mtbf_s", costs.mtbf_s},
               {"step_s", step_s},
               {"optimum_s", optimum},
               {"optimum_steps", optimum_steps},
               {"interval_s", interval},
               {"loss_per_failure_s", expected_loss_s(interval, costs)},
               {"waste", expected_waste(interval, costs)}}}});
  if (advised_ && !changed) return;
  advised_ = true;
  fmt::print(
      "checkpoint interval: stall {:.3g} s, write {:.3g} s, steps of {:.3g} s, mtbf {:.4g} h: "
      "Young/Daly's optimum is every {:.4g} s ({} steps{}); {} a failure loses {:.4g} s on "
      "average, and stalls and rework take {:.3g}% of the time ({:.3g}% at the optimum)\n",
      costs.stall_s, costs.write_s, step_s, costs.mtbf_s / 3600, optimum, optimum_steps,
      auto_interval ? ", every_steps = \"auto\" uses it" : "",
      every > 0                ? fmt::format("every {} steps ({:.4g} s)", every, interval)
      : cfg_.every_minutes > 0 ? fmt::format("every {:.4g} minutes", interval / 60)
                               : std::string("with a checkpoint only at the end,"),
      expected_loss_s(interval, costs), 100 * expected_waste(interval, costs),
      100 * expected_waste(optimum, costs));
}

}  // namespace trainer
