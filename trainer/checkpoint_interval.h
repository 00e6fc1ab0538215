#pragma once
// How often to checkpoint: the interval that minimises the expected time a run loses to
// checkpoint stalls and to the rework after failures, from what a checkpoint costs and how
// often the job fails (Young 1974, "A first order approximation to the optimum checkpoint
// interval"; Daly 2006, "A higher order estimate of the optimum checkpoint interval for
// restart dumps"). Times in seconds of wall clock.
namespace trainer {

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

}  // namespace trainer
