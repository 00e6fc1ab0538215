#include "trainer/sampler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>

#include "io/errors.h"

namespace trainer {

std::vector<int32_t> sample_tokens(GPT& model, int max_T, std::vector<int32_t> prompt,
                                   const SampleOptions& opts) {
  if (model.dtype() != DType::f32) throw std::invalid_argument("sampling needs an f32 model");
  const int Vp = model.config().padded_vocab();
  auto next_logits = [&](const int32_t* context, int T, std::vector<float>& logits) {
    model.forward(context, nullptr, 1, T);
    logits.resize(Vp);
    model.kernels().copy_to_host(logits.data(), model.logits() + int64_t(T - 1) * Vp, Vp);
  };
  return sample_tokens(next_logits, model.config().vocab_size, max_T, std::move(prompt), opts);
}

std::vector<int32_t> sample_tokens(const NextLogits& next_logits, int V, int max_T,
                                   std::vector<int32_t> prompt, const SampleOptions& opts) {
  for (size_t i = 0; i < prompt.size(); i++)
    if (prompt[i] < 0 || prompt[i] >= V)
      throw ConfigError(fmt::format(
          "prompt: byte {} at position {} is outside the model's vocabulary (vocab_size = {})",
          prompt[i], i, V));
  if (prompt.empty()) prompt.push_back(0);
  std::mt19937_64 rng(opts.seed);
  std::vector<float> logits;
  std::vector<double> probs(V);
  std::vector<int32_t> out;
  for (int i = 0; i < opts.tokens; i++) {
    const int T = std::min<int>(int(prompt.size()), max_T);
    const int32_t* context = prompt.data() + prompt.size() - T;
    next_logits(context, T, logits);
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
    int32_t next = V - 1;
    for (int v = 0; v < V; v++) {
      u -= probs[v];
      if (u < 0) {
        next = v;
        break;
      }
    }
    prompt.push_back(next);
    out.push_back(next);
  }
  return out;
}

}  // namespace trainer
