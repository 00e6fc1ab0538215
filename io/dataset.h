#pragma once
// Training batches: windows of T+1 tokens from one or more shards, in an order that is a pure
// function of (seed, global sample index). In a step that starts at global sample S, micro-step m
// and row b of data-parallel rank r read global sample S + (m * dp + r) * B + b (S grows by
// accum x dp x B a step, accum per the batch schedule), so dp = k with accumulation 1 sees the
// same global batch as dp = 1 with accumulation k, and a resumed run continues exactly.
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "io/blend.h"
#include "io/token_shard.h"

namespace trainer {

// Shard paths with glob patterns ("fineweb_train_*.bin") expanded, each in sorted order;
// a pattern that matches nothing is a DataError. A Megatron pair matched whole (prefix.bin and
// prefix.idx) is listed once, by its .bin.
std::vector<std::string> expand_shard_paths(const std::vector<std::string>& paths);

class Dataset {
 public:
  // `paths`: token shards, in order; glob patterns are expanded (expand_shard_paths).
  // headerless: nanoGPT's uint16 files (data.format = "nanogpt"). zstd-compressed shards are
  // decompressed first, into `cache_dir` if one is given (io/compressed_shard.h). A shard too
  // short for one window of T + 1 tokens adds none; a set with no window at all is a DataError.
  Dataset(const std::vector<std::string>& paths, int vocab_size, int T, bool headerless = false,
          const std::string& cache_dir = "");

  int64_t windows() const { return int64_t(starts_.size()); }
  int64_t tokens() const { return tokens_; }
  // The shards and the layouts their headers said: "1 shard, trainer format", "100 shards,
  // llm.c format", "3 shards: 2 trainer, 1 llm.c".
  std::string describe() const;
  // Refuses (DataError) a shard that records another tokenizer than the one whose identity hash
  // is `hash`; `tokenizer` names it. Shards that record none pass.
  void check_tokenizer(uint64_t hash, const std::string& tokenizer) const;
  // Window w: T+1 tokens split into inputs (T) and targets (T).
  void window(int64_t w, int32_t* inputs, int32_t* targets) const;
  // Window w's T + 1 tokens, whole.
  void read_window(int64_t w, int32_t* tokens) const;

 private:
  std::vector<TokenShard> shards_;
  std::map<std::string, int> decompressed_;  // compressed shards, by what their opening did
  int short_shards_ = 0;
  std::vector<std::pair<int32_t, int64_t>> starts_;  // (shard, first token) of each window
  int T_;
  int64_t tokens_ = 0;
};

// Maps a global sample index to a window: a fresh permutation of all windows per epoch.
class SampleOrder {
 public:
  SampleOrder(int64_t windows, uint64_t seed) : windows_(windows), seed_(seed) {}
  int64_t window(int64_t sample);

 private:
  int64_t windows_;
  uint64_t seed_;
  int64_t epoch_ = -1;
  std::vector<int64_t> perm_;
};

struct Batch {
  int64_t step = 0;  // optimizer steps since the loader started
  int micro = 0;
  std::vector<int32_t> inputs, targets;  // (B, T)
};

// The seed of source k's sample order: the run's seed for the first (a single-source run reads
// what it always has), a stream of its own for each other.
uint64_t source_seed(uint64_t seed, int source);

// Fills batches in a background thread into a bounded queue; next() only pops.
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

  // The next micro-batch in (step, micro) order. Valid until the following call. An error in the
  // producer (a DataError, bad_alloc) is rethrown here.
  const Batch& next();
  // Time next() spent waiting for the producer, in seconds, since the last call.
  double take_wait_seconds();
  // Batches filled and waiting (at most `prefetch`).
  int ready_batches();

 private:
  void produce();

  std::span<const Dataset> sources_;
  int B_, T_, dp_rank_, dp_size_, prefetch_;
  AccumOf accum_of_;
  BlendOrder blend_;
  std::vector<SampleOrder> orders_;  // per source
  int64_t step_sample_;              // the first global sample of the step being filled
  int64_t next_step_ = 0;
  int next_micro_ = 0, step_accum_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Batch> ready_, free_;
  Batch current_;
  bool stop_ = false;
  std::exception_ptr error_;  // the producer failed: next() rethrows it
  double wait_s_ = 0;
  std::thread thread_;
};

// Validation batch `index` of `count`: the count * B windows spread evenly over the whole
// validation set (row j of n reads window j * windows / n: with more rows than windows, each
// window once or twice, evenly), the same every evaluation and in every layout.
void validation_batch(const Dataset& data, int index, int count, int B, int T, Batch& out);

}  // namespace trainer
