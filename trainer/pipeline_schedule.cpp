#include "trainer/pipeline_schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

namespace trainer {

std::vector<PipeAction> one_f_one_b(int stage, int stages, int micro_batches) {
  if (stages < 1 || stage < 0 || stage >= stages || micro_batches < 1)
    throw std::invalid_argument("one_f_one_b: bad stage, stages or micro_batches");
  const int prev = stage > 0 ? stage - 1 : -1;
  const int next = stage + 1 < stages ? stage + 1 : -1;
  auto fwd = [&](int m) { return PipeAction{PipeAction::forward, m, prev, next}; };
  auto bwd = [&](int m) { return PipeAction{PipeAction::backward, m, next, prev}; };

  const int warmup = std::min(stages - stage - 1, micro_batches);
  std::vector<PipeAction> actions;
  int f = 0, b = 0;
  for (; f < warmup; f++) actions.push_back(fwd(f));
  for (; f < micro_batches; f++, b++) {
    actions.push_back(fwd(f));
    actions.push_back(bwd(b));
  }
  for (; b < micro_batches; b++) actions.push_back(bwd(b));
  return actions;
}

double pipeline_bubble(int stages, int micro_batches) {
  return pipeline_bubble(std::vector<double>(size_t(stages), 1.0), micro_batches);
}

double pipeline_bubble(const std::vector<double>& stage_costs, int micro_batches) {
  constexpr double kForward = 1, kBackward = 2;
  const int stages = int(stage_costs.size());
  std::vector<std::vector<PipeAction>> plan(stages);
  for (int s = 0; s < stages; s++) plan[s] = one_f_one_b(s, stages, micro_batches);
  // done[kind][stage][micro]: finish time of that action, or -1 while not run.
  std::vector<std::vector<std::vector<double>>> done(
      2, std::vector<std::vector<double>>(stages, std::vector<double>(micro_batches, -1)));
  std::vector<size_t> next(stages, 0);
  std::vector<double> clock(stages, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < stages; s++) {
      if (next[s] == plan[s].size()) continue;
      const PipeAction& a = plan[s][next[s]];
      double ready = clock[s];
      if (a.recv >= 0) {  // the producing action on the neighbour stage must have finished
        const double t = done[a.kind][a.recv][a.micro];
        if (t < 0) continue;
        ready = std::max(ready, t);
      }
      clock[s] = ready + (a.kind == PipeAction::forward ? kForward : kBackward) * stage_costs[s];
      done[a.kind][s][a.micro] = clock[s];
      next[s]++;
      progress = true;
    }
  }
  for (int s = 0; s < stages; s++)
    if (next[s] != plan[s].size()) throw std::logic_error("pipeline schedule deadlocks");
  const double makespan = *std::max_element(clock.begin(), clock.end());
  const double slowest = *std::max_element(stage_costs.begin(), stage_costs.end());
  const double busy = micro_batches * (kForward + kBackward) * slowest;
  return std::max(0.0, 1.0 - busy / makespan);
}

std::string to_string(const PipeAction& a) {
  return fmt::format("{}{}", a.kind == PipeAction::forward ? 'F' : 'B', a.micro);
}

}  // namespace trainer
