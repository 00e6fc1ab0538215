#pragma once
// The global batch of each step: micro_batch x accumulation x dp sequences, where the
// accumulation is train.grad_accum, or with a batch ramp (train.batch_ramp, Megatron's
// rampup-batch-size) the table's sequences at that step divided by micro_batch x dp. A ramp by
// tokens looks up the tokens the data position has passed when the step starts (samples x
// seq_len), so the schedule is a pure function of (step, samples) and a resumed run continues it
// exactly. The micro-batch stays fixed: the batch grows through accumulation.
#include <cstdint>
#include <string>

#include "io/config.h"

namespace trainer {

class BatchSchedule {
 public:
  // origin: the config file, for the error when a row does not divide into micro-batches of
  // every data-parallel rank.
  BatchSchedule(const TrainConfig& train, int seq_len, int dp, const std::string& origin);

  // Micro-batches of the step that starts at global sample `samples`.
  int accum(int64_t step, int64_t samples) const;
  // The most micro-batches of any step (the pipeline's activation slots).
  int max_accum() const { return max_accum_; }
  // The global samples consumed before `step`, from a step whose data position is known.
  int64_t samples_at(int64_t step, int64_t from_step, int64_t from_samples) const;
  bool ramped() const { return !train_.batch_ramp.empty(); }
  // "32 sequences from step 0, 64 from step 2000, 128 from step 10000".
  std::string describe() const;

 private:
  TrainConfig train_;
  int64_t seq_len_;
  int64_t per_micro_;  // sequences per micro-batch across the data-parallel ranks
  int max_accum_;
};

}  // namespace trainer
