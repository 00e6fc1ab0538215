#pragma once
#include <cstdint>

namespace trainer {

// The shape of a GPT-2 model. Validated by io/config before a model is built.
struct GPTConfig {
  int vocab_size = 256;     // V: real vocabulary
  int vocab_multiple = 64;  // Vp = V rounded up to this, so the LM-head GEMM is well shaped
  int seq_len = 256;        // maximum context, the rows of the position embedding
  int n_layer = 4;
  int n_head = 4;
  int d_model = 128;

  int padded_vocab() const {
    return (vocab_size + vocab_multiple - 1) / vocab_multiple * vocab_multiple;
  }
  int head_size() const { return d_model / n_head; }
};

}  // namespace trainer
