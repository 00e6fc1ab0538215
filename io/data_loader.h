#pragma once
// The training loader: micro-batches made ahead of the step by two stages, each its own thread,
// joined by bounded queues (io/bounded_queue.h):
//
//   read      each row's window through the blend and its source's order, T + 1 tokens copied
//             out of the mapped shard (page faults on cold storage are paid here), a
//             micro-batch's B rows at a time, up to prefetch x B rows ahead
//   assemble  rows into micro-batches of inputs and targets, up to `prefetch` batches ahead
//   next()    pops a batch: the step's data wait is the time spent here
//
// Buffers go round: each stage takes an empty one from a pool, fills it, passes it on, and
// the one after gives it back, so nothing is allocated once the loader runs.
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "io/blend.h"
#include "io/bounded_queue.h"
#include "io/dataset.h"

namespace trainer {

class DataLoader {
 public:
  // Micro-batches in the loader's step k (0: the first it fills), which starts at global sample
  // `samples`.
  using AccumOf = std::function<int(int64_t step, int64_t samples)>;
  static AccumOf constant(int accum) {
    return [accum](int64_t, int64_t) { return accum; };
  }

  // Data-parallel rank dp_rank of dp_size reads its own, disjoint part of every global batch:
  // in a step of `accum` micro-batches, micro-batch m of rank r holds the step's global samples
  // [(m * dp + r) * B, + B), so dp = k with one micro-batch reads what dp = 1 with k does. The
  // first step starts at global sample `first_sample` (the samples consumed before: a resumed
  // run continues with the next unseen one whatever its layout). Global samples come from
  // `sources` as `blend` mixes them (io/blend.h).
  DataLoader(std::span<const Dataset> sources, BlendOrder blend, int B, int T, AccumOf accum,
             uint64_t seed, int prefetch, int64_t first_sample, int dp_rank = 0, int dp_size = 1);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // The next micro-batch in (step, micro) order. Valid until the following call. An error in a
  // stage (a DataError, bad_alloc) is rethrown here.
  const Batch& next();
  // Time next() spent waiting for the stages, in seconds, since the last call.
  double take_wait_seconds();
  // Each stage's output queue: batches assembled and waiting (at most prefetch), rows read and
  // waiting to be assembled (at most prefetch x B).
  int ready_batches() const { return int(batches_.size()); }
  int ready_rows() const { return int(rows_.size()) * B_; }

 private:
  // One micro-batch's windows, read (handed on whole: a queue per row would wake a thread per
  // row, which costs more than the copy).
  struct Rows {
    int64_t step = 0;
    int micro = 0;
    std::vector<int32_t> tokens;  // B x (T + 1)
  };
  void read_stage();
  void assemble_stage();
  // Runs a stage; its error stops every stage and waits in error_ for next().
  void run_stage(void (DataLoader::*stage)());
  void close_queues();

  std::span<const Dataset> sources_;
  int B_, T_, dp_rank_, dp_size_;
  AccumOf accum_of_;
  BlendOrder blend_;
  std::vector<SampleOrder> orders_;  // per source
  // The reader's place (its thread's alone): the step being read starts at global sample
  // step_sample_ and has step_accum_ micro-batches.
  int64_t step_sample_, read_step_ = 0;
  int read_micro_ = 0, step_accum_;

  BoundedQueue<Rows> free_rows_, rows_;         // read -> assemble, and back
  BoundedQueue<Batch> free_batches_, batches_;  // assemble -> next(), and back
  Batch current_;                               // next()'s result, until the following call

  std::mutex mu_;
  std::exception_ptr error_;  // the first stage that failed
  double wait_s_ = 0;
  std::thread reader_, assembler_;  // last: they start once everything above is built
};

}  // namespace trainer
