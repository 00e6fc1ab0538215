#include "trainer/export.h"

#include <fmt/format.h>

#include <chrono>
#include <map>
#include <vector>

#include "io/config.h"
#include "io/hdf5_file.h"
#include "io/safetensors.h"
#include "model/model_definition.h"
#include "trainer/checkpoint.h"

namespace trainer {

int export_weights(const ExportOptions& opts) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string state = resolve_checkpoint(opts.checkpoint);
  const Config cfg = checkpoint_config(state);
  const ModelConfig& m = cfg.model;
  verify_checkpoint(state, m);  // checksums: a damaged checkpoint is not exported
  const std::string dtype = opts.dtype == "bf16" ? "BF16" : opts.dtype == "fp16" ? "F16" : "F32";
  // The model, so that an import can tell another model with the same shapes (n_head), and
  // "pt" as Hugging Face's loaders expect.
  std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"trainer_version", TRAINER_VERSION},
      {"arch", arch_name(m.arch)},
      {"n_layer", std::to_string(m.n_layer)},
      {"n_head", std::to_string(m.n_head)},
      {"d_model", std::to_string(m.d_model)},
      {"vocab_size", std::to_string(m.vocab_size)},
      {"seq_len", std::to_string(m.seq_len)},
      {"step", std::to_string(checkpoint_step(state))},
      {"config", config_to_toml(cfg)},
  };
  const ParamTable table = param_table(m);
  SafetensorsWriter out(opts.out, metadata);
  int64_t numel = 0;
  for (const ParamInfo& p : table.params) out.add(p.name, dtype, p.shape);
  H5File f = H5File::open_read(state);
  std::vector<float> values;
  for (const ParamInfo& p : table.params) {
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    values.resize(size_t(n));
    f.read("params/" + p.name, p.shape, values.data());
    out.write(p.name, values.data());
    numel += n;
  }
  out.close();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("exported {} tensors ({} parameters, {}) of {} to {} in {:.1f} s\n",
             table.params.size(), numel, opts.dtype, state, opts.out, s);
  return 0;
}

}  // namespace trainer
