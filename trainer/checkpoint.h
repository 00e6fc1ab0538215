#pragma once
// Checkpoints: one directory per step, `<dir>/step_00000100/` holding state.h5 and a copy of the
// resolved config (dir = [checkpoint] dir, by default <out_dir>/checkpoints). The HDF5 layout,
// readable with h5py, is the same whatever parallel layout wrote it:
//   /params/<logical name>      fp32, full logical shape (vocab rows unpadded); the fp32 master
//                               weights when the model computes in 16 bits
//   /optim/m/<name>, /optim/v/<name>   AdamW moments, same shapes
//   /comm/state/rank_<r>        rank r's gradient-compression state (error-feedback residuals,
//                               PowerSGD's Q), when compressing
//   /outer/state/rank_<r>       rank r's part of the outer optimizer's state ([comm.outer],
//                               trainer/outer_optimizer.h)
//   root attributes: format_version, step, tokens, data_samples, data_skipped, with a blend of
//   several sources (io/blend.h) data_blend_weights, data_blend_start, data_blend_base and
//   data_source_samples (each source's samples before data_samples), config (TOML
//   text), config_hash, model dimensions, the loss scaler's state, the layout it was saved
//   from (layout_world, layout_dp, layout_tp, layout_pp, layout_zero, layout_order; layout_cp
//   when it is over 1), the step
//   guard's windows (recent_losses, recent_norms: arrays, when not empty),
//   rng_seed (every random stream is a function of the seed and a step or sample index) and
//   meta_hash (FNV-1a of all of the above as text: the datasets have checksums, the attributes
//   this one). Every attribute is checked against its range and the others before use.
// Written with parallel HDF5: each rank writes only the elements it holds (its tensor-parallel
// slice, its pipeline stage, its ZeRO-1 piece; replicas once) as hyperslabs, collectively.
// Every dataset is chunked with a Fletcher32 checksum. A checkpoint is written under
// step_NNNNNNNN.tmp, flushed, renamed, and only then does `<dir>/latest` move to it.
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "io/blend.h"
#include "io/config.h"
#include "io/errors.h"
#include "io/tokenizer.h"
#include "kernels/cpu/host_memory.h"
#include "model/stage_executor.h"
#include "trainer/adamw.h"
#include "trainer/loss_scaler.h"

namespace trainer {

constexpr int64_t kCheckpointFormatVersion = 4;  // 3: meta_hash; 4: the architecture

// Writing a checkpoint failed (a full disk, a lost file system): the run's state is intact and
// the previous checkpoints are still valid.
class CheckpointWriteError : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The parallel layout a checkpoint was saved from (a record: any layout loads it).
struct Layout {
  int world = 1, dp = 1, tp = 1, pp = 1, zero = 0;
  int cp = 1;  // stored (layout_cp) only when > 1: other checkpoints keep their attributes
  std::string order = "tp-pp-dp";
  bool operator==(const Layout&) const = default;
};

// Where a run is, besides its tensors.
struct TrainState {
  int64_t step = 0;          // optimizer steps completed
  int64_t tokens = 0;        // tokens trained on
  int64_t data_samples = 0;  // global samples the data order has passed (the next one is next)
  int64_t data_skipped = 0;  // of those, skipped by rollbacks
  LossScaler::State scaler;
  Layout layout;
  std::vector<double> recent_losses, recent_norms;  // the step guard's windows of good steps
  // A blend of several training sources: its plan, and each source's samples before
  // data_samples (their sum less the plan's base is data_samples less its start). Empty for one.
  BlendPlan blend;
  std::vector<int64_t> source_samples;
};

// This rank's part of a checkpoint, copied into host memory when it is taken, so that training
// can go on while it is written.
struct Snapshot {
  TrainState state;
  std::string config_text;
  std::string tokenizer;  // Tokenizer::serialize(); "" = none stored
  uint64_t seed = 0;
  // The runs of each parameter's elements this rank writes, in the model's table order and by
  // increasing local index: values at `at` in params, m and v.
  struct Part {
    const ParamInfo* param;
    int64_t begin, count, at;
  };
  std::vector<Part> parts;
  HostVector<float> params, m, v;  // m, v empty without an optimizer
  bool has_moments = false;        // the same on every rank: m and v are written
  // State that is not a tensor, rank by rank, written as <group>/rank_<r> (none where empty).
  struct RankState {
    std::string group;           // "comm/state", "outer/state"
    std::vector<float> mine;     // this rank's
    std::vector<int64_t> sizes;  // every rank's, by world rank
  };
  std::vector<RankState> rank_states;
};

// Copies this rank's part into `out` (its buffers are reused): with `writes` false, nothing (a
// data-parallel replica that is not the leader, without ZeRO). What it writes: the optimizer's
// segments of the parameters it owns (tensor-parallel replicas on tp rank 0, the tied
// embedding on the first stage), or every owned parameter without an optimizer.
void take_snapshot(const StageExecutor& model, const AdamW* optimizer, bool writes, Snapshot& out);

// Writes a snapshot as `<dir>/step_NNNNNNNN` and returns that directory. `comm` (null: a single
// process) is every rank of the job: the file is written by all of them, collectively, and rank
// 0 renames it into place, moves `latest` and deletes all but the newest `keep_last` (0: none).
// Throws CheckpointWriteError on every rank if any rank failed; the temporary is then removed
// and the previous checkpoints stay as they were.
std::string write_checkpoint(const Snapshot& snapshot, const ModelConfig& model, Communicator* comm,
                             const std::string& dir, int keep_last);

// A single process's model and optimizer, written synchronously (with `tokenizer`, when given).
std::string save_checkpoint(const std::string& dir, const Config& cfg, const StageExecutor& model,
                            const AdamW* optimizer, const TrainState& state,
                            const Tokenizer* tokenizer = nullptr);

// The tokenizer a checkpoint stores, or null for one that stores none (written before
// tokenizers were stored, or by save_checkpoint without one).
std::unique_ptr<Tokenizer> checkpoint_tokenizer(const std::string& state_file);
// Refuses (ConfigError) to resume with another tokenizer than the checkpoint was trained with;
// `named` says which one the config names.
void check_same_tokenizer(const std::string& state_file, const Tokenizer& tokenizer,
                          const std::string& named);

// <run.out_dir>/checkpoints unless [checkpoint] dir says otherwise.
std::string checkpoint_dir(const Config& cfg);
// Deletes the temporaries (*.tmp) a crash left in `dir`.
void remove_incomplete_checkpoints(const std::string& dir);

// Accepts a step directory, a checkpoints directory or a run directory (via `latest`), or
// the state.h5 file itself; returns the path of state.h5.
std::string resolve_checkpoint(const std::string& path);

// The config the checkpoint was trained with (to build a matching model).
Config checkpoint_config(const std::string& state_file);
// The optimizer steps a checkpoint holds (its `step` attribute).
int64_t checkpoint_step(const std::string& state_file);

// A checkpoint of another model (vocab_size, seq_len, n_layer, n_head, d_model) is a
// ConfigError naming the key and both values: the config does not fit the run it resumes.
void check_same_model(const std::string& state_file, const ModelConfig& model);

// Reads every tensor of a checkpoint (HDF5 verifies each chunk's Fletcher32 checksum) after its
// format version, config hash and model dimensions. Throws CheckpointError naming what is wrong.
void verify_checkpoint(const std::string& state_file, const ModelConfig& model);

// The state.h5 of the checkpoint to resume under dir ("" if none): the one `latest` names when
// it verifies, else the newest older one that does (all of them when there is no `latest`).
// Each one passed over is reported in `rejected` ("<path>: <why>"), those newer than `latest`
// included.
std::string newest_valid_checkpoint(const std::string& dir, const ModelConfig& model,
                                    std::vector<std::string>& rejected);

// A warm start ([init] from): the checkpoint's weights fit this model, tensor by tensor. Throws
// CheckpointError naming the first tensor missing from it, of another shape or left over.
void check_weights(const std::string& state_file, const ModelConfig& model);
// Loads only the weights of a checkpoint saved in any layout and precision into this rank's
// shard (and the fp32 master of a 16-bit model), after check_weights; the optimizer's moments
// stay as they are.
void load_weights(const std::string& state_file, StageExecutor& model, AdamW* optimizer);

// Loads a checkpoint saved in any parallel layout into this rank's shard, after checking that
// its model matches: the rank's slice of every parameter (into the fp32 master weights too,
// when the model is 16-bit) and, with an optimizer, the Adam moments of the elements it holds.
// Throws CheckpointError naming the file and the mismatch.
TrainState load_checkpoint(const std::string& state_file, StageExecutor& model, AdamW* optimizer);
// Rank `rank`'s state in `group` (Snapshot::RankState), empty when the checkpoint has none.
std::vector<float> rank_state(const std::string& state_file, const std::string& group, int rank);

}  // namespace trainer
