#include "trainer/sampler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>

#include "io/errors.h"

namespace trainer {

NextLogits next_logits_of(StageExecutor& model) {
  if (model.dtype() != DType::f32) throw std::invalid_argument("sampling needs an f32 model");
  return [&model](const int32_t* tokens, int n, int pos0, std::vector<float>& logits) {
    const int Vp = model.config().padded_vocab();
    model.infer(tokens, n, pos0);
    logits.resize(Vp);
    model.kernels().copy_to_host(logits.data(), model.logits() + int64_t(n - 1) * Vp, Vp);
  };
}

std::vector<int32_t> sample_tokens(StageExecutor& model, int max_T, std::vector<int32_t> prompt,
                                   const SampleOptions& opts) {
  return sample_tokens(next_logits_of(model), model.config().vocab_size, max_T, std::move(prompt),
                       opts);
}

std::vector<int32_t> sample_tokens(const NextLogits& next_logits, int V, int max_T,
                                   std::vector<int32_t> prompt, const SampleOptions& opts,
                                   const std::vector<bool>& allowed) {
  for (size_t i = 0; i < prompt.size(); i++)
    if (prompt[i] < 0 || prompt[i] >= V)
      throw ConfigError(fmt::format(
          "prompt: token {} at position {} is outside the model's vocabulary (vocab_size = {})",
          prompt[i], i, V));
  if (prompt.empty()) prompt.push_back(0);
  std::mt19937_64 rng(opts.seed);
  std::vector<float> logits;
  std::vector<double> probs(V);
  std::vector<int32_t> out;
  int cached = 0;  // positions of the prompt in the key/value cache
  for (int i = 0; i < opts.tokens; i++) {
    const int len = int(prompt.size());
    if (len <= max_T) {  // the new tokens against the cache
      next_logits(prompt.data() + cached, len - cached, cached, logits);
      cached = len;
    } else {  // the window slides: positions change, so it is run afresh
      next_logits(prompt.data() + len - max_T, max_T, 0, logits);
    }
    if (!allowed.empty())
      for (int v = 0; v < V; v++)
        if (!allowed[v]) logits[v] = -INFINITY;
    double mx = *std::max_element(logits.begin(), logits.begin() + V);
    double cutoff = -INFINITY;
    if (opts.top_k > 0 && opts.top_k < V) {
      std::vector<float> sorted(logits.begin(), logits.begin() + V);
      std::nth_element(sorted.begin(), sorted.begin() + opts.top_k - 1, sorted.end(),
                       std::greater<float>());
      cutoff = sorted[opts.top_k - 1];
    }
    double sum = 0;
    for (int v = 0; v < V; v++) {
      probs[v] = logits[v] >= cutoff ? std::exp((logits[v] - mx) / opts.temperature) : 0.0;
      sum += probs[v];
    }
    // Inverse-CDF draw from 53 random bits: portable, unlike std::discrete_distribution.
    double u = double(rng() >> 11) * 0x1.0p-53 * sum;
    int32_t next = -1;
    for (int v = 0; v < V && next < 0; v++) {
      u -= probs[v];
      if (u < 0) next = v;
    }
    if (next < 0)  // rounding left u at or above 0: the last token with any probability
      for (int v = V - 1; v >= 0 && next < 0; v--)
        if (probs[v] > 0) next = v;
    prompt.push_back(next);
    out.push_back(next);
  }
  return out;
}

bool takes_text(const Tokenizer* tokenizer, int vocab_size) {
  return tokenizer && (tokenizer->kind() != "bytes" || is_byte_vocabulary(vocab_size));
}

std::string sample_text(const NextLogits& next_logits, const Tokenizer* tokenizer, int vocab_size,
                        int max_T, const std::string& prompt, const SampleOptions& opts) {
  if (!takes_text(tokenizer, vocab_size))
    return ids_text(sample_tokens(next_logits, vocab_size, max_T, {0}, opts));
  std::vector<int32_t> start = tokenizer->encode(prompt, tokenizer->all_special());
  if (start.empty())
    if (const auto eot = end_of_text_token(*tokenizer)) start.push_back(*eot);
  const int V = std::min(vocab_size, tokenizer->vocab_size());
  std::vector<bool> allowed(V);
  for (int v = 0; v < V; v++) allowed[v] = tokenizer->has_token(v);
  return tokenizer->decode(sample_tokens(next_logits, V, max_T, std::move(start), opts, allowed));
}

}  // namespace trainer
