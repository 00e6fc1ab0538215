#pragma once
// How often to checkpoint: the interval that minimises the expected time a run loses to
// checkpoint stalls and to the rework after failures, from what a checkpoint costs and how
// often the job fails (Young 1974, "A first order approximation to the optimum checkpoint
// interval"; Daly 2006, "A higher order estimate of the optimum checkpoint interval for
// restart dumps"). Times in seconds of wall clock.
#include <cstdint>

namespace trainer {

struct CheckpointConfig;
class MetricsLog;

struct CheckpointCosts {
  double stall_s = 0;  // what training is blocked for (the host copy, or a synchronous write)
  double write_s = 0;  // until the checkpoint is on disk and usable (background writes)
  double mtbf_s = 0;   // the job's mean time between failures
};

// Daly's optimum compute time between checkpoints: sqrt(2 d M) (Young's) corrected to higher
// order, for a stall d below 2M; M when a checkpoint costs more than that.
double optimum_interval_s(const CheckpointCosts& c);
// The work a failure loses on average with `interval_s` of training between checkpoints: half
// a period (the interval and its stall), and the write in flight, whose checkpoint is not
// usable until it is written.
double expected_loss_s(double interval_s, const CheckpointCosts& c);
// The share of the wall clock lost at that interval: the stalls, and the rework of failures.
double expected_waste(double interval_s, const CheckpointCosts& c);

// The advice during a run (rank 0): from the mean step time (steps timed so far) and the costs
// measured, Young/Daly's interval and what the configured one loses, logged each time it is
// asked and printed the first time (and again when every_steps = "auto" changes its interval).
class IntervalAdvisor {
 public:
  IntervalAdvisor(const CheckpointConfig& cfg, int64_t total_steps, CheckpointCosts costs);
  CheckpointCosts costs;  // the latest measurements (the stall, the write)
  // One more step of `seconds` (the first of a process aside: warm-up); the steps timed so far.
  int64_t step_timed(double seconds);
  // every_steps = "auto": the steps between checkpoints, once advised (0 before, or otherwise).
  int auto_every() const { return auto_every_; }
  // Nothing without an mtbf or before a step is timed.
  void advise(MetricsLog& log);

 private:
  const CheckpointConfig& cfg_;
  int64_t total_steps_;
  double steps_s_ = 0;
  int64_t steps_timed_ = 0;
  int auto_every_ = 0;
  bool advised_ = false;
};

}  // namespace trainer
