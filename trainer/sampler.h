#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "io/tokenizer.h"
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
// `allowed` (empty: every id): the ids that may be drawn.
std::vector<int32_t> sample_tokens(const NextLogits& next_logits, int vocab_size, int max_T,
                                   std::vector<int32_t> prompt, const SampleOptions& opts,
                                   const std::vector<bool>& allowed = {});
// A whole model (one f32 process) as NextLogits, through its key/value cache.
NextLogits next_logits_of(StageExecutor& model);

// Whether a model of `vocab_size` tokens takes and gives text through `tokenizer`: any tokenizer
// but bytes, and bytes for the byte vocabulary. Otherwise (or without a tokenizer) sampling
// starts from token 0 and prints token ids.
bool takes_text(const Tokenizer* tokenizer, int vocab_size);

// Samples a continuation of `prompt` as text: the prompt encoded by the tokenizer (its special
// tokens allowed), the new tokens decoded, drawn from the tokenizer's ids only (a padded model
// vocabulary has rows no text maps to). Without text (takes_text), the prompt is not used and
// the tokens print as ids after token 0.
std::string sample_text(const NextLogits& next_logits, const Tokenizer* tokenizer, int vocab_size,
                        int max_T, const std::string& prompt, const SampleOptions& opts);

}  // namespace trainer
