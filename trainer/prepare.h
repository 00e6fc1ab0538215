#pragma once
#include <string>
#include <vector>

#include "io/config.h"

namespace trainer {

struct PrepareOptions {
  std::vector<std::string> inputs;  // text files, one document each
  std::string out_dir;              // gets train.bin and val.bin
  double val_fraction = 0.1;        // the last part of each file goes to validation
  TokenizerConfig tokenizer;        // default: bytes
};

// Tokenizes text files into train/val shards that record the tokenizer (io/token_shard.h).
// Each file is one document, followed by the tokenizer's end-of-text token where it has one.
// Returns 0.
int prepare(const PrepareOptions& opts);

}  // namespace trainer
