#pragma once
// A run directory (run.out_dir) belongs to one run: config.toml, metrics.jsonl, status.json and
// the checkpoints (in <out_dir>/checkpoints, or [checkpoint] dir). A fresh run does not start
// among another run's files, whose metrics it would truncate and whose checkpoints a later
// resume = "auto" could pick up; files that are not the trainer's are never touched.
#include <string>
#include <vector>

#include "io/config.h"

namespace trainer {

// The trainer's files a run directory holds (paths), in a stable order; empty for a new one.
std::vector<std::string> run_files(const Config& cfg);

// For a fresh run (checkpoint.resume = "none"): a ConfigError naming the directory and what is
// in it when it holds another run, unless run.overwrite is set.
void check_fresh_run_dir(const Config& cfg, const std::string& config_path);

// run.overwrite: removes the old run's files (only the trainer's).
void remove_run_files(const Config& cfg);

// How the run stands, for whoever launched it (scripts/supervise.sh, the sbatch script), which
// cannot trust a launcher's exit code: mpirun signalled with SIGTERM exits 1 at once while its
// ranks are still writing their checkpoint. Rank 0 writes it atomically to
// <out_dir>/status.json, and to $TRAINER_STATUS_FILE when that is set (so that a supervisor
// finds it without reading the config), as one JSON line:
//   {"code":75,"reason":"...","state":"stopped","step":12,"time":1796326000.5}
// state: "running" (code null) from the start; then "finished" (0), "stopped" (75: a signal,
// a checkpoint written, requeue me) or "failed" (1: a checkpoint could not be written, 3:
// diverged). A final state is written only once every rank has finished its part, checkpoint
// writes included. A run that crashes leaves "running".
struct RunStatus {
  std::string state;
  int code = -1;  // -1: none yet (running)
  int64_t step = 0;
  std::string reason;
};
void write_run_status(const Config& cfg, const RunStatus& status);

}  // namespace trainer
