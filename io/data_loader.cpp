#include "io/data_loader.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <utility>

namespace trainer {

DataLoader::DataLoader(std::span<const Dataset> sources, BlendOrder blend, int B, int T,
                       AccumOf accum, uint64_t seed, int prefetch, int64_t first_sample,
                       int dp_rank, int dp_size)
    : sources_(sources),
      B_(B),
      T_(T),
      dp_rank_(dp_rank),
      dp_size_(dp_size),
      accum_of_(std::move(accum)),
      blend_(std::move(blend)),
      step_sample_(first_sample),
      step_accum_(accum_of_(0, first_sample)),
      // The pools hold what the queues do and one buffer for each hand that holds one: the
      // reader's rows and the assembler's; the assembler's batch and next()'s result.
      free_rows_(size_t(prefetch) + 2),
      rows_(size_t(prefetch)),
      free_batches_(size_t(prefetch) + 2),
      batches_(size_t(prefetch)) {
  if (blend_.plan().weights.size() != sources.size())
    throw std::logic_error("the blend's weights are not one per source");
  if (prefetch < 1) throw std::logic_error("the loader needs prefetch >= 1");
  for (size_t k = 0; k < sources.size(); k++)
    orders_.emplace_back(sources[k].windows(), source_seed(seed, int(k)));
  for (int i = 0; i < prefetch + 2; i++)
    free_rows_.push({0, 0, std::vector<int32_t>(size_t(B) * (T + 1))});
  for (int i = 0; i < prefetch + 2; i++) {
    Batch b;
    b.inputs.resize(size_t(B) * T);
    b.targets.resize(size_t(B) * T);
    free_batches_.push(std::move(b));
  }
  reader_ = std::thread([this] { run_stage(&DataLoader::read_stage); });
  assembler_ = std::thread([this] { run_stage(&DataLoader::assemble_stage); });
}

DataLoader::~DataLoader() {
  close_queues();
  reader_.join();
  assembler_.join();
}

void DataLoader::close_queues() {
  free_rows_.close();
  rows_.close();
  free_batches_.close();
  batches_.close();
}

void DataLoader::run_stage(void (DataLoader::*stage)()) {
  try {
    (this->*stage)();
  } catch (...) {  // reaches the consumer: next() rethrows it
    {
      std::lock_guard lock(mu_);
      if (!error_) error_ = std::current_exception();
    }
    close_queues();
  }
}

void DataLoader::read_stage() {
  for (;;) {
    std::optional<Rows> rows = free_rows_.pop();
    if (!rows) return;
    rows->step = read_step_;
    rows->micro = read_micro_;
    // Row r of micro-batch m on data-parallel rank d: the step's global sample (m dp + d) B + r.
    const int64_t first = step_sample_ + (int64_t(read_micro_) * dp_size_ + dp_rank_) * B_;
    for (int r = 0; r < B_; r++) {
      const BlendOrder::Pick pick = blend_.at(first + r);
      sources_[pick.source].read_window(orders_[pick.source].window(pick.index),
                                        rows->tokens.data() + int64_t(r) * (T_ + 1));
    }
    if (++read_micro_ == step_accum_) {
      step_sample_ += int64_t(step_accum_) * dp_size_ * B_;
      read_micro_ = 0;
      step_accum_ = accum_of_(++read_step_, step_sample_);
    }
    if (!rows_.push(std::move(*rows))) return;
  }
}

void DataLoader::assemble_stage() {
  for (;;) {
    std::optional<Rows> rows = rows_.pop();
    if (!rows) return;
    std::optional<Batch> b = free_batches_.pop();
    if (!b) return;
    b->step = rows->step;
    b->micro = rows->micro;
    for (int r = 0; r < B_; r++) {
      const int32_t* row = rows->tokens.data() + int64_t(r) * (T_ + 1);
      std::copy_n(row, T_, b->inputs.begin() + int64_t(r) * T_);
      std::copy_n(row + 1, T_, b->targets.begin() + int64_t(r) * T_);
    }
    if (!free_rows_.push(std::move(*rows)) || !batches_.push(std::move(*b))) return;
  }
}

const Batch& DataLoader::next() {
  const auto t0 = std::chrono::steady_clock::now();
  std::optional<Batch> b = batches_.pop();
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  {
    std::lock_guard lock(mu_);
    if (!b) {
      if (error_) std::rethrow_exception(error_);
      throw std::logic_error("the data loader was stopped");
    }
    wait_s_ += waited;
  }
  // The previous result goes back to the pool (which has room for it) once the wait is timed:
  // waking the assembler may take this thread's core for a moment, which is not a data wait.
  if (!current_.inputs.empty()) free_batches_.push(std::move(current_));
  current_ = std::move(*b);
  return current_;
}

double DataLoader::take_wait_seconds() {
  std::lock_guard lock(mu_);
  return std::exchange(wait_s_, 0.0);
}

}  // namespace trainer
