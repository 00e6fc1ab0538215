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
// A dry run sets everything up on every rank (config, layout, data, memory check, allocation),
// prints the plan of this layout and returns: nothing is trained or written.
int train(const std::string& config_path, const std::vector<std::string>& overrides, World& world,
          bool dry_run = false);

struct EvalOptions {
  std::string checkpoint;              // one of our checkpoints (its config gives the model)
  std::string data;                    // token shards (globs too); "" = the run's validation set
  int batches = 0;                     // micro-batches of windows spread over it; 0 = the run's
  std::vector<std::string> overrides;  // --set: the layout, micro_batch, precision, ...
  // Multiple-choice scoring (HellaSwag's JSON Lines: {"ctx", "endings": [...], "label"}): each
  // ending, after " ", scored by its tokens' loss given the context; the prediction is the
  // ending of lowest mean loss (acc_norm, llm.c's) and of lowest total (acc).
  std::string choices;
};
// The loss and perplexity of a checkpoint's weights on a data set, in any layout under mpirun:
// the windows validation reads (spread over the whole set, the same in every layout), so that
// on the run's validation set it gives the val loss the run logged at that step. Rank 0 prints
// one line. Returns the exit code (2 for bad input, agreed by every rank).
int evaluate(const EvalOptions& opts, World& world);

}  // namespace trainer
