#include "io/sentencepiece_tokenizer.h"

#include <fmt/format.h>
#include <sentencepiece_processor.h>

#include <stdexcept>

#include "io/errors.h"

namespace trainer {

namespace {

std::unique_ptr<sentencepiece::SentencePieceProcessor> load(const std::string& model,
                                                            const std::string& origin) {
  auto sp = std::make_unique<sentencepiece::SentencePieceProcessor>();
  const auto status = sp->LoadFromSerializedProto(model);
  if (!status.ok()) {
    throw ConfigError(
        fmt::format("{}: expected a SentencePiece model (a serialised ModelProto), "
                    "found {} bytes starting {} that do not load ({})",
                    origin, model.size(), quote_bytes(model, 0, 16), status.ToString()));
  }
  return sp;
}

SpecialTokens specials_of(const sentencepiece::SentencePieceProcessor& sp) {
  SpecialTokens s;
  for (int id : {sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()}) {
    if (id >= 0 && id < sp.GetPieceSize()) s[sp.IdToPiece(id)] = id;
  }
  return s;
}

const SpecFile& model_file(const TokenizerSpec& spec) {
  if (spec.files.size() != 1 || spec.files[0].role != "model") {
    throw ConfigError(fmt::format("sentencepiece tokenizer: expected one 'model' file, found {}",
                                  spec.files.size()));
  }
  return spec.files[0];
}

}  // namespace

SpecialTokens SentencePieceTokenizer::model_specials(const std::string& model,
                                                     const std::string& origin) {
  return specials_of(*load(model, origin));
}

SentencePieceTokenizer::SentencePieceTokenizer(TokenizerSpec spec)
    : Tokenizer(spec.kind, spec.specials, serialize_spec(spec)),
      sp_(load(model_file(spec).bytes, model_file(spec).origin)) {}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

std::vector<int32_t> SentencePieceTokenizer::encode_ordinary(std::string_view text) const {
  std::vector<int> ids;
  const auto status = sp_->Encode(text, &ids);
  if (!status.ok()) throw std::runtime_error("sentencepiece: encode: " + status.ToString());
  return std::vector<int32_t>(ids.begin(), ids.end());
}

std::string SentencePieceTokenizer::decode(const std::vector<int32_t>& tokens) const {
  for (int32_t t : tokens) {
    if (t < 0 || t >= sp_->GetPieceSize()) {
      throw std::out_of_range(
          fmt::format("sentencepiece tokenizer: token id {} is not in the vocabulary", t));
    }
  }
  std::string out;
  const auto status = sp_->Decode(std::vector<int>(tokens.begin(), tokens.end()), &out);
  if (!status.ok()) throw std::runtime_error("sentencepiece: decode: " + status.ToString());
  return out;
}

int SentencePieceTokenizer::vocab_size() const {
  return sp_->GetPieceSize();
}

}  // namespace trainer
