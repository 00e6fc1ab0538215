// Writes a tiny model's parameters, logits, loss and gradients to HDF5, for the independent
// PyTorch check in tests/torch_reference.py. Usage: dump_reference <out.h5> [VARIANT [HF_DIR]]
// HF_DIR: also the weights in transformers' layout (trainer/hf_format.h), for
// tests/hf_reference.py.
// VARIANT: gpt2 (the default: tied head), gpt2-untied (and no biases), llama (grouped-query
// attention, an untied head, Llama 3.1 rotary scaling), llama-mqa-tied (one key/value head, a tied
// head).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "io/hdf5_file.h"
#include "kernels/kernels.h"
#include "model/init.h"
#include "model/stage_executor.h"
#include "trainer/hf_format.h"

using namespace trainer;

namespace {

ModelConfig variant(const std::string& name) {
  ModelConfig cfg;
  cfg.vocab_size = 100;  // padded to 128: the padding must not leak into logits or grads
  cfg.vocab_multiple = 64;
  cfg.seq_len = 16;
  cfg.n_layer = 2;
  cfg.n_head = 2;
  cfg.d_model = 32;
  if (name == "gpt2") return cfg;
  if (name == "gpt2-untied") {  // and without biases
    cfg.tie_embeddings = false;
    cfg.bias = false;
    return cfg;
  }
  cfg.arch = Arch::llama;
  cfg.n_head = 4;  // head size 8: four rotary frequencies
  cfg.norm_eps = 1e-5;
  if (name == "llama") {
    cfg.tie_embeddings = false;
    cfg.n_kv_head = 2;
    cfg.ffn_hidden = 48;
    // Llama 3.1's scaling with a short original context, so that the 16 positions see all
    // three of its bands: kept, interpolated and slowed down.
    cfg.rope_theta = 500.0;
    cfg.rope_scaling = {8.0, 1.0, 4.0, 32};
    return cfg;
  }
  if (name == "llama-mqa-tied") {
    cfg.tie_embeddings = true;
    cfg.n_kv_head = 1;
    cfg.multiple_of = 16;  // ffn derived: 2/3 of 4 C = 85, rounded up to 96
    return cfg;
  }
  throw std::invalid_argument("unknown variant " + name);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 4) {
    std::fprintf(stderr, "usage: %s <out.h5> [gpt2|gpt2-untied|llama|llama-mqa-tied [HF_DIR]]\n",
                 argv[0]);
    return 2;
  }
  try {
    const ModelConfig cfg = variant(argc >= 3 ? argv[2] : "gpt2");
    const int B = 2, T = 16, V = cfg.vocab_size, Vp = cfg.padded_vocab();
    auto kernels = make_cpu_kernels();
    StageExecutor model(cfg, *kernels, DType::f32, B, T);
    model.init_parameters(1234);

    // Perturb every parameter so that biases and LayerNorm gains are not trivially 0 and 1.
    // At std 0.2 (not the init's 0.02) attention is far from uniform and the GELU inputs reach
    // its curved region, so the check notices e.g. an exact GELU or a wrong attention scale.
    for (const auto& p : model.table().params) {
      std::vector<float> values = model.read<float>(p, model.params());
      const uint64_t stream = hash_name(p.name) ^ 0x5eedULL;
      for (size_t i = 0; i < values.size(); i++)
        values[i] += float(0.2 * normal_at(4321, stream, i));
      model.write(p, model.params(), values);
    }

    std::vector<int32_t> tokens(B * T), targets(B * T);
    for (int i = 0; i < B * T; i++) {
      tokens[i] = int32_t(mix64(2 * i + 1) % V);
      targets[i] = int32_t(mix64(2 * i + 2) % V);
    }

    model.forward(tokens.data(), nullptr, B, T);
    std::vector<float> padded(int64_t(B) * T * Vp), logits(int64_t(B) * T * V);
    kernels->copy_to_host(padded.data(), model.logits(), int64_t(padded.size()));
    for (int64_t r = 0; r < int64_t(B) * T; r++)
      std::copy_n(padded.begin() + r * Vp, V, logits.begin() + r * V);

    const float loss = float(model.forward(tokens.data(), targets.data(), B, T));
    model.zero_grad();
    model.backward(1.0f);

    H5File out = H5File::create(argv[1]);
    for (const auto& p : model.table().params) {
      out.write("params/" + p.name, p.shape, model.read<float>(p, model.params()).data());
      out.write("grads/" + p.name, p.shape, model.read<float>(p, model.grads()).data());
    }
    const std::vector<float> tokens_f(tokens.begin(), tokens.end());
    const std::vector<float> targets_f(targets.begin(), targets.end());
    out.write("reference/tokens", {B, T}, tokens_f.data());
    out.write("reference/targets", {B, T}, targets_f.data());
    out.write("reference/logits", {B, T, V}, logits.data());
    out.write("reference/loss", {1}, &loss);
    out.set_attr("vocab_size", int64_t(cfg.vocab_size));
    out.set_attr("seq_len", int64_t(cfg.seq_len));
    out.set_attr("n_layer", int64_t(cfg.n_layer));
    out.set_attr("n_head", int64_t(cfg.n_head));
    out.set_attr("d_model", int64_t(cfg.d_model));
    out.set_attr("arch", std::string(arch_name(cfg.arch)));
    out.set_attr("tie_embeddings", int64_t(cfg.tie_embeddings));
    out.set_attr("bias", int64_t(cfg.bias));
    out.set_attr("n_kv_head", int64_t(cfg.kv_heads()));
    out.set_attr("ffn_hidden", int64_t(cfg.ffn()));
    out.set_attr("norm_eps", cfg.norm_eps);
    out.set_attr("rope_theta", cfg.rope_theta);
    out.set_attr("rope_scaling_factor", cfg.rope_scaling.factor);
    out.set_attr("rope_low_freq_factor", cfg.rope_scaling.low_freq_factor);
    out.set_attr("rope_high_freq_factor", cfg.rope_scaling.high_freq_factor);
    out.set_attr("rope_original_max_pos", int64_t(cfg.rope_scaling.original_max_pos));
    out.flush();
    if (argc == 4)
      write_hf(
          cfg,
          [&](const std::string& name) {
            return model.read<float>(model.table().at(name), model.params());
          },
          argv[3], "F32", {{"format", "pt"}}, int64_t(1) << 40);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dump_reference: %s\n", e.what());
    return 1;
  }
  return 0;
}
