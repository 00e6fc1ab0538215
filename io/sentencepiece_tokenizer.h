#pragma once
// SentencePiece models (.model files, BPE or unigram) through Debian's libsentencepiece.
#include <memory>
#include <string>
#include <vector>

#include "io/tokenizer.h"
#include "io/tokenizer_spec.h"

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace trainer {

class SentencePieceTokenizer : public Tokenizer {
 public:
  // spec.files: one "model" file. Its special tokens are the ones the model declares (unk, bos,
  // eos, pad where present), by their pieces.
  explicit SentencePieceTokenizer(TokenizerSpec spec);
  ~SentencePieceTokenizer() override;

  std::vector<int32_t> encode_ordinary(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& tokens) const override;
  int vocab_size() const override;

  // The special tokens a model declares, or ConfigError naming `origin` if it does not load.
  static SpecialTokens model_specials(const std::string& model, const std::string& origin);

 private:
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
};

}  // namespace trainer
