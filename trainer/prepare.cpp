#include "trainer/prepare.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "io/token_shard.h"
#include "io/tokenizer.h"

namespace trainer {

int prepare(const PrepareOptions& opts) {
  const auto tokenizer =
      load_tokenizer(opts.tokenizer.kind, opts.tokenizer.path, {opts.tokenizer.pattern});
  const std::optional<int32_t> end_of_text = end_of_text_token(*tokenizer);
  std::vector<int32_t> train, val;
  for (const auto& path : opts.inputs) {
    // A FIFO or a device (/dev/zero) would be read without end.
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
      throw DataError(fmt::format("{}: not a regular file ({}): an input text file must be one",
                                  path, file_kind(st.st_mode)));
    std::ifstream in(path, std::ios::binary);
    if (!in) throw DataError(fmt::format("{}: cannot open input text file", path));
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    if (text.empty()) throw DataError(fmt::format("{}: input text file is empty", path));
    const std::vector<int32_t> tokens = tokenizer->encode_ordinary(text);
    // Both parts of the document end with the end-of-text token, so that no two files' text
    // runs together in either set.
    const size_t split = tokens.size() - size_t(double(tokens.size()) * opts.val_fraction);
    train.insert(train.end(), tokens.begin(), tokens.begin() + split);
    val.insert(val.end(), tokens.begin() + split, tokens.end());
    if (end_of_text) {
      train.push_back(*end_of_text);
      if (split < tokens.size()) val.push_back(*end_of_text);
    }
    fmt::print("{}: {} tokens ({} train, {} val)\n", path, tokens.size(), split,
               tokens.size() - split);
  }
  fmt::print("tokenizer: {}, {} tokens, identity hash {:016x}\n", tokenizer_name(opts.tokenizer),
             tokenizer->vocab_size(), tokenizer->identity_hash());
  std::filesystem::create_directories(opts.out_dir);
  const std::string train_path = opts.out_dir + "/train.bin", val_path = opts.out_dir + "/val.bin";
  write_token_shard(train_path, train, tokenizer->vocab_size(), tokenizer->identity_hash());
  fmt::print("wrote {} ({} tokens)\n", train_path, train.size());
  if (!val.empty()) {
    write_token_shard(val_path, val, tokenizer->vocab_size(), tokenizer->identity_hash());
    fmt::print("wrote {} ({} tokens)\n", val_path, val.size());
  }
  return 0;
}

}  // namespace trainer
