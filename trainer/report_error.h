#pragma once
// Every failure ends with one line on stderr and an exit code: 2 for bad input (config, data,
// checkpoint, files, memory), 3 for a run that diverged, 1 for everything else.
#include <exception>

namespace trainer {

constexpr int kExitBadInput = 2;
// Training diverged (overflows at the minimum loss scale, bad steps with nothing to roll back
// to, or coming back after rollbacks): running it again would do the same.
constexpr int kExitDiverged = 3;
// Stopped by SIGTERM/SIGUSR1 after writing a checkpoint: run the job again to resume
// (EX_TEMPFAIL; scripts and Slurm requeue on it).
constexpr int kExitRequeue = 75;

// Prints the error's line and returns its exit code.
int report_error(const std::exception_ptr& error);

}  // namespace trainer
