#pragma once
// Training batches: windows of T+1 tokens from one or more shards, in an order that is a pure
// function of (seed, global sample index). In a step that starts at global sample S, micro-step m
// and row b of data-parallel rank r read global sample S + (m * dp + r) * B + b (S grows by
// accum x dp x B a step, accum per the batch schedule), so dp = k with accumulation 1 sees the
// same global batch as dp = 1 with accumulation k, and a resumed run continues exactly.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "io/compressed_shard.h"
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
  // Compressed shards through `decompressor` (a run's shares the work among a node's ranks).
  Dataset(const std::vector<std::string>& paths, int vocab_size, int T, bool headerless,
          ShardDecompressor& decompressor);

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
  void open(const std::vector<std::string>& patterns, int vocab_size, bool headerless,
            ShardDecompressor& decompressor);

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

// Validation batch `index` of `count`: the count * B windows spread evenly over the whole
// validation set (row j of n reads window j * windows / n: with more rows than windows, each
// window once or twice, evenly), the same every evaluation and in every layout.
void validation_batch(const Dataset& data, int index, int count, int B, int T, Batch& out);

}  // namespace trainer
