#pragma once
// Tokenizers behind one interface: bytes (token = byte value, vocab 256), byte-level BPE from
// GPT-2's encoder.json + vocab.bpe or from a tiktoken rank file (gpt2, cl100k, llama3
// pre-tokenisation patterns), and SentencePiece models. Each is defined by a TokenizerSpec (its
// kind, files, pattern and special tokens) that serialises to bytes and rebuilds the same
// tokenizer, so that a checkpoint can carry the tokenizer it was trained with.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace trainer {

constexpr int kByteVocab = 256;

std::vector<int32_t> byte_encode(std::string_view text);
std::string byte_decode(const std::vector<int32_t>& tokens);

// A model trained with the bytes tokenizer on a vocabulary other than the byte vocabulary (an
// llm.c shard's, say) takes and gives token ids: its samples start from token 0 and print as ids
// ("5 17 300").
inline bool is_byte_vocabulary(int vocab_size) {
  return vocab_size == kByteVocab;
}
std::string ids_text(const std::vector<int32_t>& tokens);

using SpecialTokens = std::map<std::string, int32_t>;  // name -> id; ordered, so hashes are stable

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Special tokens are recognised only when named in `allowed_special` (tiktoken's
  // allowed_special): by default "<|endoftext|>" in the text is ordinary text. Names that are not
  // special tokens of this tokenizer are ignored.
  std::vector<int32_t> encode(std::string_view text,
                              const std::set<std::string>& allowed_special = {}) const;
  virtual std::vector<int32_t> encode_ordinary(std::string_view text) const = 0;
  // The bytes the tokens stand for (special tokens as their names). An id outside the vocabulary
  // throws std::out_of_range.
  virtual std::string decode(const std::vector<int32_t>& tokens) const = 0;
  virtual int vocab_size() const = 0;  // one past the largest id, special tokens included
  // Whether decode() knows `id` (a rank file may leave ids below vocab_size() unused).
  virtual bool has_token(int32_t id) const { return id >= 0 && id < vocab_size(); }
  const SpecialTokens& special_tokens() const { return specials_; }
  std::set<std::string> all_special() const;
  const std::string& kind() const { return kind_; }  // "bytes", "gpt2", "tiktoken", ...
  // A stable 64-bit FNV-1a hash of serialize(): the kind, the exact bytes of the files that
  // define the tokenizer, the pattern and the special tokens. The same on every run and machine.
  uint64_t identity_hash() const { return hash_; }
  // Everything that defines the tokenizer, files included; tokenizer_from_bytes rebuilds it.
  const std::string& serialize() const { return serialized_; }

 protected:
  Tokenizer(std::string kind, SpecialTokens specials, std::string serialized);

 private:
  std::string kind_;
  SpecialTokens specials_;
  std::string serialized_;
  uint64_t hash_;
};

struct TokenizerOptions {
  // The pre-tokenisation pattern of a tiktoken rank file: "gpt2", "cl100k" or "llama3". It also
  // picks the special tokens (gpt2: <|endoftext|> 50256; cl100k: OpenAI's five; llama3: Meta's 256
  // after the ranks).
  std::string pattern;
};

// kind "bytes" (path unused), "gpt2" (a directory holding encoder.json and vocab.bpe, or the
// encoder.json with vocab.bpe beside it), "tiktoken" (a rank file; options.pattern required),
// "sentencepiece" (a .model file). Bad files throw ConfigError with one line naming the file, the
// line or offset, what was expected and what was found.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& kind, const std::string& path,
                                          const TokenizerOptions& options = {});
// The token that ends a document: <|endoftext|> (GPT-2, cl100k), <|end_of_text|> (Llama 3) or
// SentencePiece's </s>; none for bytes.
std::optional<int32_t> end_of_text_token(const Tokenizer& tokenizer);

// Rebuilds a tokenizer from its serialize() bytes; `source` names them in errors (e.g. a
// checkpoint's path). Damaged bytes throw CheckpointError.
std::unique_ptr<Tokenizer> tokenizer_from_bytes(std::string_view bytes, const std::string& source);

}  // namespace trainer
