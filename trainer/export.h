#pragma once
// trainer export: a checkpoint's weights out of the trainer, for other tools.
#include <string>

namespace trainer {

struct ExportOptions {
  std::string checkpoint;  // a step directory, a run directory or a state.h5
  std::string format = "safetensors";
  std::string out;
  std::string dtype = "fp32";   // fp32 | bf16 | fp16
  int64_t max_shard_mb = 5000;  // hf: a larger model is split into shards of at most this
};

// safetensors: writes `out` (atomically), the full logical tensors under the model's parameter
// names (the names [init] from reads back), in `dtype`, with the model's config as metadata.
// hf: writes the directory `out` in transformers' layout (trainer/hf_format.h). Returns the exit
// code; throws InputError for a bad checkpoint.
int export_weights(const ExportOptions& opts);

}  // namespace trainer
