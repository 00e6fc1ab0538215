#pragma once
// Streams tokens into a set of our shards (io/token_shard.h, version 2 with a document index):
// `name`.bin, or with shard_tokens > 0 shards of at most that many tokens, `name`_000000.bin,
// `name`_000001.bin, ... Every shard is written under a temporary name (<path>.XXXXXX.tmp) and
// renamed into place only by commit(), once the whole input has been read: a failed or killed
// run leaves no file under a shard's name that is not complete.
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace trainer {

class ShardSetWriter {
 public:
  // compress: commit() writes each shard zstd-compressed, as <shard>.bin.zst
  // (io/compressed_shard.h), instead of <shard>.bin.
  ShardSetWriter(std::string out_dir, std::string name, int64_t shard_tokens, int vocab_size,
                 uint64_t tokenizer_hash, bool compress = false);
  ~ShardSetWriter();  // removes the temporaries of a set never committed
  ShardSetWriter(const ShardSetWriter&) = delete;
  ShardSetWriter& operator=(const ShardSetWriter&) = delete;

  // The next token appended starts a document (recorded in the index of the shard it lands in).
  void begin_document() { document_pending_ = true; }
  void append(const int32_t* tokens, size_t n);
  int64_t tokens() const { return total_tokens_; }

  // Finishes the last shard and renames every shard into place (then removes numbered shards of
  // this name left by an earlier run that made more). Returns each shard's path and token count;
  // none for a set that received no tokens.
  std::vector<std::pair<std::string, int64_t>> commit();

  // Removes the temporaries of shards (train*.bin.*.tmp, val*.bin.*.tmp) that an interrupted run
  // left in out_dir.
  static void remove_stale_temporaries(const std::string& out_dir);

 private:
  void open_shard();
  void close_shard();
  void write_index_entries();

  std::string out_dir_, name_;
  int64_t shard_tokens_;
  int vocab_size_;
  uint64_t tokenizer_hash_;
  bool compress_;
  int width_;
  bool document_pending_ = false;
  int64_t total_tokens_ = 0;

  // The shard being written.
  FILE* file_ = nullptr;
  std::string tmp_path_;
  int64_t count_ = 0, documents_ = 0;
  std::vector<uint64_t> index_;  // starts not yet spilled
  FILE* index_spill_ = nullptr;  // the index beyond what memory holds, until the shard closes
  std::vector<char> convert_;

  std::vector<std::pair<std::string, int64_t>> closed_;  // (temporary path, tokens)
  bool committed_ = false;
};

}  // namespace trainer
