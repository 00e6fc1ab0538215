#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "io/config.h"
#include "io/document_reader.h"

namespace trainer {

struct PrepareOptions {
  std::vector<std::string> inputs;  // files, directories, glob patterns (io/input_files.h)
  std::string out_dir;              // gets train.bin and val.bin (or numbered shards)
  double val_fraction = 0.1;        // of the documents (or, for small corpora, of each document)
  TokenizerConfig tokenizer;        // default: bytes
  InputFormat format = InputFormat::kAuto;
  std::string field = "text";  // JSON Lines: each line's field that holds the document
  int threads = 0;             // tokenizer threads; 0: every core
  int64_t shard_tokens = 0;    // at most this many tokens a shard; 0: one train.bin, one val.bin
  bool compress = false;       // zstd-compressed shards, *.bin.zst (io/compressed_shard.h)
};

// Tokenizes documents into train/val shards that record the tokenizer and where each document
// starts (io/token_shard.h), streaming: memory stays bounded whatever the corpus size, and the
// output is the same whatever the number of threads. Each document ends with the tokenizer's
// end-of-text token where it has one. Whole documents go to validation, chosen by a hash of
// their number; a corpus of fewer than kMinSplitDocuments documents is split as before instead,
// the last val_fraction of each document to validation. Returns 0; bad input throws DataError
// and leaves no shard written.
constexpr int64_t kMinSplitDocuments = 100;
int prepare(const PrepareOptions& opts);

}  // namespace trainer
