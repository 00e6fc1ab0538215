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
#include "trainer/hf_format.h"
#include "trainer/llmc_format.h"

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
  H5File f = H5File::open_read(state);
  auto read = [&](const std::string& name) {
    const ParamInfo& p = table.at(name);
    std::vector<float> values(size_t(p.logical_numel()));
    f.read("params/" + name, p.shape, values.data());
    return values;
  };
  int64_t numel = 0;
  for (const ParamInfo& p : table.params) numel += p.logical_numel();
  size_t written = table.params.size();
  if (opts.format == "llmc") {
    if (dtype == "F16")
      throw ConfigError("--dtype fp16: llm.c's format holds fp32 (version 3) or bf16 (version 5)");
    write_llmc(m, read, opts.out, dtype);
  } else if (opts.format == "hf") {
    // The tokenizer the checkpoint stores (transformers' files for the kinds it has them).
    const std::unique_ptr<Tokenizer> tokenizer = checkpoint_tokenizer(state);
    written = write_hf(m, read, opts.out, dtype, metadata, opts.max_shard_mb << 20, tokenizer.get())
                  .size();
  } else {
    SafetensorsWriter out(opts.out, metadata);
    for (const ParamInfo& p : table.params) out.add(p.name, dtype, p.shape);
    for (const ParamInfo& p : table.params) out.write(p.name, read(p.name).data());
    out.close();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("exported {} ({} parameters, {}) of {} to {}: {} in {:.1f} s\n",
             opts.format == "hf"     ? std::string("the model in transformers' layout")
             : opts.format == "llmc" ? std::string("the model in llm.c's format")
                                     : fmt::format("{} tensors", written),
             numel, opts.dtype, state, opts.out,
             opts.format == "hf" ? fmt::format("{} files", written) : std::string("one file"), s);
  return 0;
}

}  // namespace trainer
