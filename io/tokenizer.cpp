#include "io/tokenizer.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "io/bpe.h"
#include "io/bpe_files.h"
#include "io/errors.h"
#include "io/pretokenizer.h"
#include "io/sentencepiece_tokenizer.h"
#include "io/tokenizer_spec.h"

namespace trainer {

std::vector<int32_t> byte_encode(std::string_view text) {
  std::vector<int32_t> out(text.size());
  for (size_t i = 0; i < text.size(); i++) out[i] = static_cast<uint8_t>(text[i]);
  return out;
}

std::string ids_text(const std::vector<int32_t>& tokens) {
  std::string out;
  for (size_t i = 0; i < tokens.size(); i++) {
    if (i > 0) out += ' ';
    out += std::to_string(tokens[i]);
  }
  return out;
}

std::string byte_decode(const std::vector<int32_t>& tokens) {
  std::string out(tokens.size(), '\0');
  for (size_t i = 0; i < tokens.size(); i++) out[i] = static_cast<char>(tokens[i] & 0xFF);
  return out;
}

Tokenizer::Tokenizer(std::string kind, SpecialTokens specials, std::string serialized)
    : kind_(std::move(kind)),
      specials_(std::move(specials)),
      serialized_(std::move(serialized)),
      hash_(fnv1a64(serialized_)) {}

std::set<std::string> Tokenizer::all_special() const {
  std::set<std::string> out;
  for (const auto& [name, id] : specials_) out.insert(name);
  return out;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text,
                                       const std::set<std::string>& allowed_special) const {
  struct Active {
    std::string_view name;
    int32_t id;
    size_t next;  // where it next occurs at or after the last position searched from
  };
  std::vector<Active> active;
  for (const std::string& name : allowed_special) {
    auto it = specials_.find(name);
    if (it != specials_.end() && !name.empty()) active.push_back({it->first, it->second, 0});
  }
  if (active.empty()) return encode_ordinary(text);
  for (Active& a : active) a.next = text.find(a.name);
  std::vector<int32_t> out;
  size_t pos = 0;
  while (true) {
    // The earliest special token from pos; of two at the same place, the longer.
    const Active* best = nullptr;
    for (Active& a : active) {
      if (a.next < pos) a.next = text.find(a.name, pos);
      if (a.next == std::string_view::npos) continue;
      if (!best || a.next < best->next ||
          (a.next == best->next && a.name.size() > best->name.size())) {
        best = &a;
      }
    }
    const size_t end = best ? best->next : text.size();
    const std::vector<int32_t> part = encode_ordinary(text.substr(pos, end - pos));
    out.insert(out.end(), part.begin(), part.end());
    if (!best) break;
    out.push_back(best->id);
    pos = end + best->name.size();
  }
  return out;
}

namespace {

class ByteTokenizer : public Tokenizer {
 public:
  explicit ByteTokenizer(const TokenizerSpec& spec)
      : Tokenizer(spec.kind, spec.specials, serialize_spec(spec)) {}
  std::vector<int32_t> encode_ordinary(std::string_view text) const override {
    return byte_encode(text);
  }
  std::string decode(const std::vector<int32_t>& tokens) const override {
    for (int32_t t : tokens) {
      if (t < 0 || t >= kByteVocab) {
        throw std::out_of_range(
            fmt::format("bytes tokenizer: token id {} is not in the vocabulary", t));
      }
    }
    return byte_decode(tokens);
  }
  int vocab_size() const override { return kByteVocab; }
};

std::string read_file(const std::filesystem::path& path, const std::string& why) {
  std::ifstream f(path, std::ios::binary);
  if (!f || std::filesystem::is_directory(path)) {
    throw ConfigError(
        fmt::format("{}: expected a readable file ({}), found {}", path.string(), why,
                    std::filesystem::exists(path) ? "one that cannot be read" : "no such file"));
  }
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

const SpecFile& file_of(const TokenizerSpec& spec, std::string_view role) {
  for (const SpecFile& f : spec.files)
    if (f.role == role) return f;
  throw ConfigError(fmt::format("{} tokenizer: expected a '{}' file, found none", spec.kind, role));
}

// A spec whose specials are known (load_tokenizer derives them from the files and pattern;
// tokenizer_from_bytes reads them) -> the tokenizer.
std::unique_ptr<Tokenizer> build(const TokenizerSpec& spec) {
  if (spec.kind == "bytes") return std::make_unique<ByteTokenizer>(spec);
  if (spec.kind == "gpt2") {
    const SpecFile& enc = file_of(spec, "encoder.json");
    const SpecFile& bpe = file_of(spec, "vocab.bpe");
    return std::make_unique<BpeTokenizer>(
        spec, parse_gpt2_files(enc.bytes, enc.origin, bpe.bytes, bpe.origin).tokens);
  }
  if (spec.kind == "tiktoken") {
    const SpecFile& ranks = file_of(spec, "ranks");
    return std::make_unique<BpeTokenizer>(spec, parse_tiktoken_ranks(ranks.bytes, ranks.origin));
  }
  if (spec.kind == "sentencepiece") return std::make_unique<SentencePieceTokenizer>(spec);
  throw ConfigError(
      fmt::format("tokenizer kind: expected bytes, gpt2, tiktoken or "
                  "sentencepiece, found '{}'",
                  spec.kind));
}

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& kind, const std::string& path,
                                          const TokenizerOptions& options) {
  namespace fs = std::filesystem;
  TokenizerSpec spec;
  spec.kind = kind;
  if (kind == "bytes") return build(spec);
  if (kind == "gpt2") {
    // A directory with both files, or encoder.json with vocab.bpe beside it.
    const fs::path enc = fs::is_directory(path) ? fs::path(path) / "encoder.json" : fs::path(path);
    const fs::path bpe = enc.parent_path() / "vocab.bpe";
    const std::string why = "gpt2 needs encoder.json and vocab.bpe side by side";
    spec.files.push_back({"encoder.json", enc.string(), read_file(enc, why)});
    spec.files.push_back({"vocab.bpe", bpe.string(), read_file(bpe, why)});
    spec.pattern_name = "gpt2";
    spec.pattern = named_pattern("gpt2");
    const SpecFile &e = spec.files[0], &b = spec.files[1];
    spec.specials = parse_gpt2_files(e.bytes, e.origin, b.bytes, b.origin).specials;
    return build(spec);
  }
  if (kind == "tiktoken") {
    const char* pattern = named_pattern(options.pattern);
    if (!pattern) {
      throw ConfigError(fmt::format("{}: tiktoken pattern: expected one of {}, found '{}'", path,
                                    pattern_names(), options.pattern));
    }
    spec.files.push_back({"ranks", path, read_file(path, "a tiktoken rank file")});
    spec.pattern_name = options.pattern;
    spec.pattern = pattern;
    const size_t n_ranks = parse_tiktoken_ranks(spec.files[0].bytes, path).size();
    spec.specials = pattern_specials(options.pattern, n_ranks);
    return build(spec);
  }
  if (kind == "sentencepiece") {
    spec.files.push_back({"model", path, read_file(path, "a SentencePiece .model file")});
    spec.specials = SentencePieceTokenizer::model_specials(spec.files[0].bytes, path);
    return build(spec);
  }
  return build(spec);  // an unknown kind: build names the known ones
}

std::unique_ptr<Tokenizer> tokenizer_from_bytes(std::string_view bytes, const std::string& source) {
  const TokenizerSpec spec = parse_spec(bytes, source);
  try {
    return build(spec);
  } catch (const ConfigError& e) {
    // File errors already name the source (through the files' origins); others get it here.
    const std::string what = e.what();
    throw CheckpointError(what.find(source) == std::string::npos ? source + ": " + what : what);
  }
}

std::optional<int32_t> end_of_text_token(const Tokenizer& tokenizer) {
  for (const char* name : {"<|endoftext|>", "<|end_of_text|>", "</s>"})
    if (auto it = tokenizer.special_tokens().find(name); it != tokenizer.special_tokens().end())
      return it->second;
  return std::nullopt;
}

}  // namespace trainer
