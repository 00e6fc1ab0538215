#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/gpt.h"

namespace trainer {

struct SampleOptions {
  int tokens = 200;
  double temperature = 1.0;
  int top_k = 0;  // 0 = sample from the full distribution
  uint64_t seed = 0;
};

// Continues `prompt` by `opts.tokens` tokens, sampling autoregressively with the model's
// context window (the last min(len, max_T) tokens). Deterministic in (weights, prompt, opts).
std::vector<int32_t> sample_tokens(GPT& model, int max_T, std::vector<int32_t> prompt,
                                   const SampleOptions& opts);

}  // namespace trainer
