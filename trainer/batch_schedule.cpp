#include "trainer/batch_schedule.h"

#include <fmt/format.h>

#include <algorithm>

namespace trainer {

BatchSchedule::BatchSchedule(const TrainConfig& train, int seq_len, int dp,
                             const std::string& origin)
    : train_(train),
      seq_len_(seq_len),
      per_micro_(int64_t(train.micro_batch) * dp),
      max_accum_(train.grad_accum) {
  if (!ramped()) return;
  max_accum_ = 1;
  for (const auto& [at, sequences] : train.batch_ramp) {
    if (sequences % per_micro_ != 0)
      throw ConfigError(fmt::format(
          "{}: [train] batch_ramp: {} sequences at {} {} do not divide into micro-batches of {} "
          "sequences on each of dp = {} ranks (a multiple of {} is needed)",
          origin, sequences, at, train.batch_ramp_unit, train.micro_batch, dp, per_micro_));
    max_accum_ = std::max<int64_t>(max_accum_, sequences / per_micro_);
  }
}

int BatchSchedule::accum(int64_t step, int64_t samples) const {
  if (!ramped()) return train_.grad_accum;
  const int64_t position = train_.batch_ramp_unit == "tokens" ? samples * seq_len_ : step;
  int64_t sequences = train_.batch_ramp[0][1];
  for (const auto& [at, s] : train_.batch_ramp)
    if (position >= at) sequences = s;
  return int(sequences / per_micro_);
}

int64_t BatchSchedule::samples_at(int64_t step, int64_t from_step, int64_t from_samples) const {
  int64_t samples = from_samples;
  int64_t s = from_step;
  // Step by step while the ramp may still change the batch, then the constant rest at once.
  const int64_t last = train_.batch_ramp.empty() ? 0 : train_.batch_ramp.back()[0];
  auto past_ramp = [&] {
    return !ramped() ||
           (train_.batch_ramp_unit == "tokens" ? samples * seq_len_ >= last : s >= last);
  };
  for (; s < step && !past_ramp(); s++) samples += accum(s, samples) * per_micro_;
  return samples + (step - s) * accum(s, samples) * per_micro_;
}

std::string BatchSchedule::describe() const {
  std::string out;
  for (const auto& [at, sequences] : train_.batch_ramp)
    out += fmt::format("{}{} sequences from {} {}", out.empty() ? "" : ", ", sequences,
                       train_.batch_ramp_unit == "tokens" ? "token" : "step", at);
  return out;
}

}  // namespace trainer
