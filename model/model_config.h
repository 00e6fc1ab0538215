#pragma once
// The shape of a model: which architecture, and its dimensions. Validated by io/config before a
// model is built. Fields that one architecture does not use keep their defaults.
#include <cstdint>
#include <string>

namespace trainer {

enum class Arch { gpt2, llama };

inline const char* arch_name(Arch a) {
  return a == Arch::llama ? "llama" : "gpt2";
}

// Llama 3.1's rotary frequency scaling for long contexts: frequencies whose wavelength exceeds
// original_max_pos / low_freq_factor are divided by `factor`, those below original_max_pos /
// high_freq_factor kept, and those in between interpolated. factor = 0: no scaling.
struct RopeScaling {
  double factor = 0;
  double low_freq_factor = 1;
  double high_freq_factor = 4;
  int original_max_pos = 8192;
  bool operator==(const RopeScaling&) const = default;
};

struct ModelConfig {
  Arch arch = Arch::gpt2;
  int vocab_size = 256;     // V: real vocabulary
  int vocab_multiple = 64;  // Vp = V rounded up to this, so the LM-head GEMM is well shaped
  int seq_len = 256;        // maximum context (GPT-2: the rows of the position embedding)
  int n_layer = 4;
  int n_head = 4;
  int d_model = 128;
  // The LM head shares the token embedding's weights (GPT-2), or has its own (Llama).
  bool tie_embeddings = true;
  double init_std = 0.02;  // of the matrices and embeddings (residual projections scaled down)

  // GPT-2 (arch = "gpt2").
  bool bias = true;  // biases in the linear layers and LayerNorms
  // Training only: the embedding's output and each block's two projections into the residual
  // stream are dropped with this probability (nanoGPT's resid_dropout and embedding dropout;
  // not the attention probabilities).
  double dropout = 0;

  // Llama (arch = "llama").
  int n_kv_head = 0;   // grouped-query attention: key/value heads; 0 = n_head
  int ffn_hidden = 0;  // SwiGLU width; 0 = derived from ffn_dim_multiplier and multiple_of
  double ffn_dim_multiplier = 1.0;
  int multiple_of = 256;
  double norm_eps = 1e-5;  // RMSNorm
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;

  int padded_vocab() const {
    return (vocab_size + vocab_multiple - 1) / vocab_multiple * vocab_multiple;
  }
  int head_size() const { return d_model / n_head; }
  int kv_heads() const { return arch == Arch::llama && n_kv_head > 0 ? n_kv_head : n_head; }
  // The MLP's hidden width: 4 C for GPT-2; for Llama, ffn_hidden, or Llama's rule: 2/3 of 4 C,
  // times ffn_dim_multiplier, rounded up to a multiple of multiple_of.
  int ffn() const {
    if (arch == Arch::gpt2) return 4 * d_model;
    if (ffn_hidden > 0) return ffn_hidden;
    int64_t hidden = int64_t(ffn_dim_multiplier * double(2 * (4 * int64_t(d_model)) / 3));
    return int((hidden + multiple_of - 1) / multiple_of * multiple_of);
  }
  // The weights of one block's matrix multiplies: QKV, the attention's output projection and
  // the MLP (two matrices for GPT-2's, three for SwiGLU).
  int64_t block_matmul_params() const {
    const int64_t C = d_model, kv = int64_t(kv_heads()) * head_size();
    return C * (C + 2 * kv) + C * C + (arch == Arch::llama ? 3 : 2) * C * ffn();
  }
};

}  // namespace trainer
