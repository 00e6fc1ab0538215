#pragma once
#include <string>
#include <vector>

namespace trainer {

struct PrepareOptions {
  std::vector<std::string> inputs;  // text files
  std::string out_dir;              // gets train.bin and val.bin
  double val_fraction = 0.1;        // the last part of each file goes to validation
};

// Tokenizes text files with the byte-level tokenizer into train/val shards. Returns 0.
int prepare(const PrepareOptions& opts);

}  // namespace trainer
