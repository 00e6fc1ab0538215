#include "io/dataset.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <stdexcept>

#include "io/compressed_shard.h"
#include "io/input_files.h"
#include "model/init.h"

namespace trainer {

std::vector<std::string> expand_shard_paths(const std::vector<std::string>& paths) {
  std::vector<std::string> out;
  for (const std::string& p : paths) {
    if (p.find_first_of("*?[") == std::string::npos) {
      out.push_back(p);
      continue;
    }
    const std::vector<std::string> matched = glob_sorted(p, "token shard");
    const std::set<std::string> all(matched.begin(), matched.end());
    for (const std::string& m : matched)  // a Megatron pair is one dataset: its .bin names it
      if (!m.ends_with(".idx") || !all.count(m.substr(0, m.size() - 4) + ".bin")) out.push_back(m);
  }
  return out;
}

Dataset::Dataset(const std::vector<std::string>& patterns, int vocab_size, int T, bool headerless,
                 const std::string& cache_dir)
    : T_(T) {
  ShardDecompressor decompressor(cache_dir);
  open(patterns, vocab_size, headerless, decompressor);
}

Dataset::Dataset(const std::vector<std::string>& patterns, int vocab_size, int T, bool headerless,
                 ShardDecompressor& decompressor)
    : T_(T) {
  open(patterns, vocab_size, headerless, decompressor);
}

void Dataset::open(const std::vector<std::string>& patterns, int vocab_size, bool headerless,
                   ShardDecompressor& decompressor) {
  const int T = T_;
  const std::vector<std::string> paths = expand_shard_paths(patterns);
  int64_t longest = 0;
  for (const auto& p : paths) {
    // By name as well as magic: a headerless or Megatron .bin may begin with any two tokens.
    if (!headerless && p.ends_with(".zst") && is_zstd_file(p)) {
      const DecompressedShard d = decompressor.open(p);
      try {
        shards_.emplace_back(d.path, vocab_size, headerless);
      } catch (...) {
        decompressor.mapped(d);
        throw;
      }
      decompressor.mapped(d);  // a temporary may go: the mapping stays
      decompressed_[d.how]++;
    } else {
      shards_.emplace_back(p, vocab_size, headerless);
    }
    const TokenShard& s = shards_.back();
    tokens_ += s.size();
    // A shard may hold less than a window (a set's last, from prepare --shard-tokens): it adds
    // none. Windows never span shards.
    const int64_t n = (s.size() - 1) / T;
    if (n < 1) short_shards_++;
    longest = std::max(longest, s.size());
    for (int64_t k = 0; k < n; k++) starts_.emplace_back(int32_t(shards_.size() - 1), k * T);
  }
  if (starts_.empty())
    throw DataError(
        paths.size() == 1
            ? fmt::format("{}: {} tokens are fewer than one window of seq_len + 1 = {}", paths[0],
                          longest, T + 1)
            : fmt::format("{} and {} more shards: each is shorter than one window of seq_len + 1 "
                          "= {} tokens (the longest has {}; windows do not span shards)",
                          paths[0], paths.size() - 1, T + 1, longest));
}

void Dataset::check_tokenizer(uint64_t hash, const std::string& tokenizer) const {
  for (const TokenShard& s : shards_)
    if (s.tokenizer_hash() != 0 && s.tokenizer_hash() != hash)
      throw DataError(fmt::format(
          "{}: prepared with another tokenizer (identity hash {:016x}) than [tokenizer] {} "
          "({:016x}): prepare the data again with this tokenizer, or configure the one it was "
          "prepared with",
          s.path(), s.tokenizer_hash(), tokenizer, hash));
}

std::string Dataset::describe() const {
  std::map<std::string, int> by_format;
  for (const TokenShard& s : shards_) by_format[s.format()]++;
  const size_t n = shards_.size();
  std::string out;
  if (by_format.size() == 1) {
    out = fmt::format("{} shard{}, {} format", n, n == 1 ? "" : "s", by_format.begin()->first);
  } else {
    std::string parts;
    for (const auto& [format, count] : by_format)
      parts += fmt::format("{}{} {}", parts.empty() ? "" : ", ", count, format);
    out = fmt::format("{} shards: {}", n, parts);
  }
  for (const auto& [how, count] : decompressed_)
    out += fmt::format("; {} zstd-compressed, {}", count, how);
  if (short_shards_ > 0) out += fmt::format("; {} shorter than a window, unused", short_shards_);
  return out;
}

void Dataset::read_window(int64_t w, int32_t* tokens) const {
  const auto [shard, start] = starts_[w];
  shards_[shard].read(start, T_ + 1, tokens);
}

void Dataset::window(int64_t w, int32_t* inputs, int32_t* targets) const {
  const auto [shard, start] = starts_[w];
  shards_[shard].read(start, T_, inputs);
  shards_[shard].read(start + 1, T_, targets);
}

int64_t SampleOrder::window(int64_t sample) {
  const int64_t epoch = sample / windows_;
  if (epoch != epoch_) {
    perm_.resize(windows_);
    for (int64_t i = 0; i < windows_; i++) perm_[i] = i;
    std::mt19937_64 rng(mix64(seed_ ^ mix64(uint64_t(epoch) + 0x5eed)));
    // Fisher-Yates with our own index draw: std::shuffle's use of the engine is unspecified,
    // and the order must be identical across standard libraries.
    for (int64_t i = windows_ - 1; i > 0; i--) std::swap(perm_[i], perm_[rng() % uint64_t(i + 1)]);
    epoch_ = epoch;
  }
  return perm_[sample % windows_];
}

uint64_t source_seed(uint64_t seed, int source) {
  return source == 0 ? seed : mix64(seed ^ mix64(uint64_t(source) + 0x50u));
}

void validation_batch(const Dataset& data, int index, int count, int B, int T, Batch& out) {
  out.inputs.resize(size_t(B) * T);
  out.targets.resize(size_t(B) * T);
  const int64_t n = int64_t(count) * B, windows = data.windows();
  for (int r = 0; r < B; r++) {
    const int64_t j = int64_t(index) * B + r;
    const int64_t w = int64_t(__int128(j) * windows / n);
    data.window(w, out.inputs.data() + int64_t(r) * T, out.targets.data() + int64_t(r) * T);
  }
}

}  // namespace trainer
