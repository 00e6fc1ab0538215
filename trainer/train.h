#pragma once
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "io/config.h"

namespace trainer {

// SIGTERM and SIGUSR1 (what Slurm and scripts/supervise.sh send before a preemption or a time
// limit) ask the run to stop: every rank finishes the step, a checkpoint is written, and the
// ranks exit 75. main() installs this before anything slow (MPI start-up, data, checkpoints),
// so that a signal arriving early stops the run after its first step rather than killing it.
void catch_stop_signals();

// Trains the model the config at `config_path` (with `overrides`) describes, on every rank of
// `world`, in the [parallel] layout. Rank 0 writes config.toml, metrics.jsonl and checkpoints
// to run.out_dir and prints the log. Set-up errors (config, data, layout) are agreed on: every
// rank returns exit code 2 and the first failing rank prints the error. Returns the exit code.
int train(const std::string& config_path, const std::vector<std::string>& overrides, World& world);

}  // namespace trainer
