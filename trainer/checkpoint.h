#pragma once
// Checkpoints: one directory per step, `<out_dir>/checkpoints/step_00000100/` holding
// state.h5 and a copy of the resolved config. The HDF5 layout (readable with h5py):
//   /params/<logical name>      fp32, full logical shape (vocab rows unpadded)
//   /optim/m/<name>, /optim/v/<name>   AdamW moments, same shapes
//   /comm/residual/rank_<r>   rank r's gradient-compression residuals (with error feedback)
//   root attributes: format_version, step, tokens, config (TOML text), model dimensions,
//   loss_scale.
// A checkpoint is written under step_XXXXXXXX.tmp, flushed, renamed, and only then does
// `checkpoints/latest` (a file naming the directory) move to it.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "io/config.h"
#include "io/errors.h"
#include "model/gpt.h"
#include "trainer/adamw.h"

namespace trainer {

constexpr int64_t kCheckpointFormatVersion = 1;

struct TrainState {
  int64_t step = 0;    // optimizer steps completed
  int64_t tokens = 0;  // tokens consumed
};

// Full logical tensors by parameter name, in table order.
struct NamedTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
};
struct ModelState {
  std::vector<NamedTensor> params, m, v;  // m, v empty without optimizer state
  // Per-rank state: each rank's gradient-compression residuals (its buckets' error feedback,
  // concatenated in buffer order; empty without compression), indexed by world rank.
  std::vector<std::vector<float>> residuals;
  double loss_scale = 1;
};

// Every rank's residuals (concatenated), gathered for the checkpoint.
std::vector<std::vector<float>> gather_per_rank(const std::vector<float>& mine,
                                                Communicator& world);

// Assembles the full logical tensors from every rank's shard: each element comes from exactly
// one rank (the replica leader, dp rank 0, for parameters and unsharded moments; the owner of
// the ZeRO piece for sharded ones; tp rank 0 for replicated parameters; the first stage for the
// tied embedding), and a sum over `world` (null: a single process) puts them together. The
// result is complete on every rank.
ModelState collect_state(const GPT& model, const AdamW* optimizer, Communicator* world,
                         bool replica_leader, bool sharded_optimizer);

// Writes `state` (params, and moments when present); returns the step directory written.
std::string save_checkpoint(const std::string& out_dir, const Config& cfg, const ModelState& model,
                            const TrainState& state);
// A single process's model and optimizer.
inline std::string save_checkpoint(const std::string& out_dir, const Config& cfg, const GPT& model,
                                   const AdamW* optimizer, const TrainState& state) {
  return save_checkpoint(out_dir, cfg, collect_state(model, optimizer, nullptr, true, false),
                         state);
}

// Accepts a step directory, a checkpoints/ directory or a run directory (via `latest`), or
// the state.h5 file itself; returns the path of state.h5.
std::string resolve_checkpoint(const std::string& path);

// The config the checkpoint was trained with (to build a matching model).
Config checkpoint_config(const std::string& state_file);

// Reads every tensor of a checkpoint (HDF5 verifies each chunk's Fletcher32 checksum) after its
// format version and model dimensions. Throws CheckpointError naming what is wrong.
void verify_checkpoint(const std::string& state_file, const GPTConfig& model);

// The state.h5 of the newest checkpoint under out_dir/checkpoints that verifies ("" if none);
// each newer one that does not is reported in `rejected` ("<path>: <why>").
std::string newest_valid_checkpoint(const std::string& out_dir, const GPTConfig& model,
                                    std::vector<std::string>& rejected);

// What a resumed run restores besides the tensors: the loss scale and one rank's gradient-
// compression residuals (empty when the checkpoint has none for it).
struct RunState {
  double loss_scale = 1;
  std::vector<float> residuals;
};

// Loads a checkpoint saved in any parallel layout into this rank's shard, after checking that
// its model matches: the rank's slice of every parameter (into the fp32 master weights too,
// when the model is 16-bit) and, with an optimizer, the Adam moments of the elements it holds;
// with `run`, the loss scale and rank `rank`'s residuals. Throws CheckpointError naming the
// file and the mismatch.
TrainState load_checkpoint(const std::string& state_file, GPT& model, AdamW* optimizer,
                           RunState* run = nullptr, int rank = 0);

}  // namespace trainer
