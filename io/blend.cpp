#include "io/blend.h"

#include <fmt/format.h>

#include <cmath>
#include <numeric>
#include <stdexcept>

namespace trainer {

BlendPlan BlendPlan::fresh(const std::vector<double>& weights) {
  BlendPlan p;
  const double sum = std::accumulate(weights.begin(), weights.end(), 0.0);
  for (double w : weights) p.weights.push_back(w / sum);
  p.base.assign(weights.size(), 0);
  return p;
}

constexpr int kFixedBits = 32;

BlendOrder::BlendOrder(BlendPlan plan)
    : plan_(std::move(plan)), cursor_(plan_.start), counts_(plan_.weights.size(), 0) {
  if (plan_.weights.empty() || plan_.base.size() != plan_.weights.size())
    throw std::logic_error("a blend needs a weight and a base position per source");
  for (double w : plan_.weights) fixed_.push_back(std::llround(std::ldexp(w, kFixedBits)));
}

BlendOrder::BlendOrder(BlendPlan plan, int64_t sample, const std::vector<int64_t>& positions)
    : BlendOrder(std::move(plan)) {
  if (positions.size() != counts_.size() || sample < plan_.start)
    throw std::logic_error("a blend's known point needs a position per source, after its start");
  int64_t since = 0;
  for (size_t s = 0; s < counts_.size(); s++) {
    counts_[s] = positions[s] - plan_.base[s];
    if (counts_[s] < 0) throw std::logic_error("a blend position before its base");
    since += counts_[s];
  }
  if (since != sample - plan_.start)
    throw std::logic_error(
        fmt::format("blend positions account for {} samples, not {}", since, sample - plan_.start));
  cursor_ = sample;
}

int BlendOrder::next_source() const {
  const __int128 i = cursor_ - plan_.start + 1;
  auto lag = [&](size_t s) {
    return __int128(fixed_[s]) * i - (__int128(counts_[s]) << kFixedBits);
  };
  int best = 0;
  __int128 most = lag(0);
  for (size_t s = 1; s < counts_.size(); s++)
    if (const __int128 l = lag(s); l > most) best = int(s), most = l;
  return best;
}

void BlendOrder::seek(int64_t sample) {
  if (sample < plan_.start)
    throw std::logic_error(
        fmt::format("sample {} precedes the blend's start {}", sample, plan_.start));
  if (sample < cursor_) {
    cursor_ = plan_.start;
    counts_.assign(counts_.size(), 0);
  }
  if (counts_.size() == 1) {  // one source: every sample is its
    counts_[0] = sample - plan_.start;
    cursor_ = sample;
    return;
  }
  for (; cursor_ < sample; cursor_++) counts_[next_source()]++;
}

BlendOrder::Pick BlendOrder::at(int64_t sample) {
  seek(sample);
  const int s = next_source();
  return {s, plan_.base[s] + counts_[s]};
}

std::vector<int64_t> BlendOrder::positions(int64_t sample) {
  seek(sample);
  std::vector<int64_t> p(counts_.size());
  for (size_t s = 0; s < p.size(); s++) p[s] = plan_.base[s] + counts_[s];
  return p;
}

std::string format_weights(const std::vector<double>& weights) {
  return fmt::format("{:.4g}", fmt::join(weights, ", "));
}

}  // namespace trainer
