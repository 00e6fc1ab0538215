#include "io/tokenizer_spec.h"

#include <fmt/format.h>

#include <charconv>

#include "io/errors.h"

namespace trainer {

namespace {

constexpr std::string_view kMagic = "trainer-tokenizer 1\n";

// One record: "NAME LENGTH\n" then LENGTH bytes then "\n". Lengths, not delimiters, so that any
// bytes (a binary SentencePiece model) travel unchanged.
void put(std::string& out, std::string_view name, std::string_view value) {
  out += name;
  out += ' ';
  out += std::to_string(value.size());
  out += '\n';
  out += value;
  out += '\n';
}

class Reader {
 public:
  Reader(std::string_view bytes, const std::string& source) : b_(bytes), source_(source) {}

  [[noreturn]] void fail(const std::string& expected) const {
    throw CheckpointError(fmt::format("{}: tokenizer bytes, offset {}: expected {}, found {}",
                                      source_, pos_, expected,
                                      pos_ < b_.size() ? quote_bytes(b_, pos_) : "the end"));
  }
  bool at_end() const { return pos_ == b_.size(); }
  void expect(std::string_view s) {
    if (b_.substr(pos_, s.size()) != s) fail(quote_bytes(s));
    pos_ += s.size();
  }
  // The next record, which must be called `name`.
  std::string_view record(std::string_view name) {
    const size_t start = pos_;
    expect(name);
    expect(" ");
    size_t n = 0;
    const char* first = b_.data() + pos_;
    const char* last = b_.data() + b_.size();
    auto [p, ec] = std::from_chars(first, last, n);
    if (ec != std::errc() || p == first) fail("a length");
    pos_ += p - first;
    expect("\n");
    if (n > b_.size() - pos_) {
      pos_ = start;
      fail(fmt::format("a '{}' record of {} bytes (the bytes are truncated)", name, n));
    }
    std::string_view value = b_.substr(pos_, n);
    pos_ += n;
    expect("\n");
    return value;
  }
  bool next_is(std::string_view name) const {
    return b_.substr(pos_, name.size() + 1) == std::string(name) + " ";
  }

 private:
  std::string_view b_;
  const std::string& source_;
  size_t pos_ = 0;
};

}  // namespace

std::string quote_bytes(std::string_view bytes, size_t offset, size_t max) {
  std::string out = "\"";
  const std::string_view s = bytes.substr(std::min(offset, bytes.size()), max);
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      out += fmt::format("\\x{:02x}", c);
    }
  }
  out += '"';
  if (bytes.size() - std::min(offset, bytes.size()) > max) out += "...";
  return out;
}

std::string serialize_spec(const TokenizerSpec& spec) {
  std::string out(kMagic);
  put(out, "kind", spec.kind);
  put(out, "pattern_name", spec.pattern_name);
  put(out, "pattern", spec.pattern);
  for (const auto& [name, id] : spec.specials) put(out, "special", fmt::format("{} {}", id, name));
  for (const SpecFile& f : spec.files) {
    put(out, "file", f.role);
    put(out, "bytes", f.bytes);
  }
  out += "end\n";
  return out;
}

TokenizerSpec parse_spec(std::string_view bytes, const std::string& source) {
  Reader r(bytes, source);
  r.expect(kMagic);
  TokenizerSpec spec;
  spec.kind = r.record("kind");
  spec.pattern_name = r.record("pattern_name");
  spec.pattern = r.record("pattern");
  while (r.next_is("special")) {
    const std::string_view v = r.record("special");
    const size_t space = v.find(' ');
    int32_t id = -1;
    auto [p, ec] = std::from_chars(v.data(), v.data() + std::min(space, v.size()), id);
    if (space == std::string_view::npos || ec != std::errc() || id < 0 || p != v.data() + space) {
      throw CheckpointError(
          fmt::format("{}: tokenizer bytes: expected a special token 'ID NAME', "
                      "found {}",
                      source, quote_bytes(v)));
    }
    spec.specials[std::string(v.substr(space + 1))] = id;
  }
  while (r.next_is("file")) {
    SpecFile f;
    f.role = r.record("file");
    f.origin = fmt::format("{} (tokenizer file '{}')", source, f.role);
    f.bytes = r.record("bytes");
    spec.files.push_back(std::move(f));
  }
  r.expect("end\n");
  if (!r.at_end()) r.fail("nothing after 'end'");
  return spec;
}

}  // namespace trainer
