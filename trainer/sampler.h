#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/stage_executor.h"

namespace trainer {

struct SampleOptions {
  int tokens = 200;
  double temperature = 1.0;
  int top_k = 0;  // 0 = sample from the full distribution
  uint64_t seed = 0;
};

// Continues `prompt` by `opts.tokens` tokens, sampling autoregressively with the model's
// context window (the last min(len, max_T) tokens). The prompt is run once, then each new token
// alone against the key/value cache; once the window is full and slides, every token re-runs
// it. Deterministic in (weights, prompt, opts).
std::vector<int32_t> sample_tokens(StageExecutor& model, int max_T, std::vector<int32_t> prompt,
                                   const SampleOptions& opts);

// The same with the model behind a function that gives the (padded) vocabulary's logits of the
// token after position pos0 + n - 1, given the n tokens at positions [pos0, pos0 + n) and the
// key/value cache of the earlier ones (pos0 = 0 starts afresh): a pipeline of model shards, say.
using NextLogits =
    std::function<void(const int32_t* tokens, int n, int pos0, std::vector<float>& logits)>;
std::vector<int32_t> sample_tokens(const NextLogits& next_logits, int vocab_size, int max_T,
                                   std::vector<int32_t> prompt, const SampleOptions& opts);

}  // namespace trainer
