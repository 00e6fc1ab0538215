#include "io/bpe_files.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "io/errors.h"
#include "io/tokenizer_spec.h"

namespace trainer {

namespace {

// -1 for a character outside the standard base64 alphabet.
int base64_value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

// Strict standard base64 with padding; returns the column (0-based) of the first bad character,
// or -1 when `in` decodes.
long base64_decode(std::string_view in, std::string& out) {
  out.clear();
  if (in.empty() || in.size() % 4 != 0) return static_cast<long>(in.size());
  for (size_t i = 0; i < in.size(); i += 4) {
    int v[4];
    int pad = 0;
    for (int k = 0; k < 4; k++) {
      const char c = in[i + k];
      const bool last_group = i + 4 == in.size();
      if (c == '=' && last_group && k >= 2 && (k == 3 || in[i + 3] == '=')) {
        v[k] = 0;
        pad++;
        continue;
      }
      v[k] = base64_value(c);
      if (v[k] < 0 || pad > 0) return static_cast<long>(i + k);
    }
    const uint32_t w = (v[0] << 18) | (v[1] << 12) | (v[2] << 6) | v[3];
    out += static_cast<char>(w >> 16);
    if (pad < 2) out += static_cast<char>((w >> 8) & 0xFF);
    if (pad < 1) out += static_cast<char>(w & 0xFF);
  }
  return -1;
}

void check_every_byte_ranked(const std::unordered_map<std::string, int32_t>& by_bytes,
                             const std::string& origin) {
  for (int b = 0; b < 256; b++) {
    if (!by_bytes.count(std::string(1, static_cast<char>(b)))) {
      throw ConfigError(
          fmt::format("{}: expected every single byte to have a rank (byte-level "
                      "BPE), found none for byte 0x{:02x}",
                      origin, b));
    }
  }
}

// GPT-2's encoder.py bytes_to_unicode, inverted: code point -> byte (-1: not in the alphabet).
// Printable Latin-1 bytes stand for themselves; the others for 256, 257, ... in byte order.
std::array<int, 324> unicode_to_bytes() {
  std::array<int, 324> inv;
  inv.fill(-1);
  int n = 0;
  for (int b = 0; b < 256; b++) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    inv[printable ? b : 256 + n++] = b;
  }
  return inv;
}

// A token as encoder.json and vocab.bpe spell it -> its bytes; "" and `bad` set to the first
// character outside the alphabet (or a UTF-8 error) when it cannot be.
std::string gpt2_token_bytes(std::string_view s, std::string& bad) {
  static const std::array<int, 324> inv = unicode_to_bytes();
  std::string out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    uint32_t cp = 0;
    size_t len = 0;
    if (c < 0x80)
      cp = c, len = 1;
    else if ((c & 0xE0) == 0xC0)
      cp = c & 0x1F, len = 2;
    else if ((c & 0xF0) == 0xE0)
      cp = c & 0x0F, len = 3;
    else if ((c & 0xF8) == 0xF0)
      cp = c & 0x07, len = 4;
    if (len == 0 || i + len > s.size()) {
      bad = fmt::format("invalid UTF-8 at byte {}", i);
      return "";
    }
    for (size_t k = 1; k < len; k++) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    if (cp >= inv.size() || inv[cp] < 0) {
      bad = fmt::format("U+{:04X}", cp);
      return "";
    }
    out += static_cast<char>(inv[cp]);
    i += len;
  }
  return out;
}

}  // namespace

std::vector<RankedToken> parse_tiktoken_ranks(std::string_view bytes, const std::string& origin) {
  std::vector<RankedToken> tokens;
  std::unordered_map<std::string, int32_t> by_bytes;
  std::unordered_map<int32_t, size_t> line_of_rank;
  size_t line_no = 0;
  std::string token;
  for (size_t pos = 0; pos < bytes.size();) {
    line_no++;
    size_t eol = bytes.find('\n', pos);
    const bool unterminated = eol == std::string_view::npos;
    if (unterminated) eol = bytes.size();
    const std::string_view line = bytes.substr(pos, eol - pos);
    const size_t line_pos = pos;
    pos = eol + 1;
    if (line.empty()) continue;  // as tiktoken's load_tiktoken_bpe
    auto fail = [&](const std::string& what) {
      throw ConfigError(
          fmt::format("{}: line {} (offset {}): expected 'BASE64-TOKEN RANK', found "
                      "{} ({})",
                      origin, line_no, line_pos, quote_bytes(line), what));
    };
    // A last line without its newline, after good lines, is where a download stopped. On line 1
    // it is more likely a file of another kind (encoder.json): its form is checked first.
    auto truncated = [&] {
      throw ConfigError(
          fmt::format("{}: line {} (offset {}): expected a line ending in a newline, "
                      "found the end of the file after {} (truncated?)",
                      origin, line_no, line_pos, quote_bytes(line)));
    };
    if (unterminated && !tokens.empty()) truncated();
    const size_t space = line.find(' ');
    if (space == std::string_view::npos) fail("no space");
    const long bad = base64_decode(line.substr(0, space), token);
    if (bad >= 0) fail(fmt::format("not base64 at column {}", bad + 1));
    const std::string_view digits = line.substr(space + 1);
    int32_t rank = -1;
    auto [p, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), rank);
    if (ec != std::errc() || p != digits.data() + digits.size() || rank < 0 || digits.empty()) {
      fail("the rank is not a non-negative 32-bit integer");
    }
    if (auto [it, fresh] = line_of_rank.emplace(rank, line_no); !fresh) {
      fail(fmt::format("rank {} already given on line {}", rank, it->second));
    }
    if (auto [it, fresh] = by_bytes.emplace(token, rank); !fresh) {
      fail(fmt::format("the token already has rank {}", it->second));
    }
    if (unterminated) truncated();
    tokens.push_back({token, rank});
  }
  if (tokens.empty()) {
    throw ConfigError(fmt::format("{}: expected 'BASE64-TOKEN RANK' lines, found {}", origin,
                                  bytes.empty() ? "an empty file" : "only empty lines"));
  }
  check_every_byte_ranked(by_bytes, origin);
  return tokens;
}

Gpt2Vocab parse_gpt2_files(std::string_view encoder_json, const std::string& encoder_origin,
                           std::string_view vocab_bpe, const std::string& vocab_origin) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(encoder_json.begin(), encoder_json.end());
  } catch (const nlohmann::json::parse_error& e) {
    const size_t at = e.byte > 0 ? e.byte - 1 : 0;
    throw ConfigError(
        fmt::format("{}: byte {}: expected JSON (an object of token -> id), found "
                    "{}",
                    encoder_origin, at, quote_bytes(encoder_json, at)));
  }
  if (!j.is_object()) {
    throw ConfigError(fmt::format("{}: expected a JSON object of token -> id, found a JSON {}",
                                  encoder_origin, j.type_name()));
  }
  Gpt2Vocab v;
  std::unordered_map<std::string, int32_t> by_bytes;
  std::unordered_map<int32_t, std::string> key_of_id;
  std::string bad;
  for (const auto& [key, value] : j.items()) {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
        value.get<int64_t>() > INT32_MAX) {
      throw ConfigError(fmt::format("{}: token {}: expected a non-negative integer id, found {}",
                                    encoder_origin, quote_bytes(key), value.dump()));
    }
    const auto id = value.get<int32_t>();
    if (auto [it, fresh] = key_of_id.emplace(id, key); !fresh) {
      throw ConfigError(fmt::format("{}: token {}: expected a unique id, found {}, the id of {}",
                                    encoder_origin, quote_bytes(key), id, quote_bytes(it->second)));
    }
    if (key == "<|endoftext|>") {
      v.specials[key] = id;
      continue;
    }
    std::string bytes = gpt2_token_bytes(key, bad);
    if (bytes.empty()) {
      throw ConfigError(
          fmt::format("{}: token {} (id {}): expected characters of GPT-2's "
                      "byte-to-unicode alphabet, found {}",
                      encoder_origin, quote_bytes(key), id, bad));
    }
    by_bytes.emplace(bytes, id);
    v.tokens.push_back({std::move(bytes), id});
  }
  check_every_byte_ranked(by_bytes, encoder_origin);

  // vocab.bpe: "#version: 0.2" then "LEFT RIGHT" a line; merge k makes the token with id 256 + k.
  size_t line_no = 0, merges = 0;
  for (size_t pos = 0; pos < vocab_bpe.size();) {
    line_no++;
    size_t eol = vocab_bpe.find('\n', pos);
    if (eol == std::string_view::npos) eol = vocab_bpe.size();
    const std::string_view line = vocab_bpe.substr(pos, eol - pos);
    const size_t line_pos = pos;
    pos = eol + 1;
    if (line.empty() || (line_no == 1 && line[0] == '#')) continue;
    auto fail = [&](const std::string& expected, const std::string& found) {
      throw ConfigError(fmt::format("{}: line {} (offset {}): expected {}, found {}", vocab_origin,
                                    line_no, line_pos, expected, found));
    };
    const size_t space = line.find(' ');
    if (space == 0 || space == std::string_view::npos || space + 1 == line.size() ||
        line.find(' ', space + 1) != std::string_view::npos) {
      fail("a merge 'LEFT RIGHT'", quote_bytes(line));
    }
    const std::string left = gpt2_token_bytes(line.substr(0, space), bad);
    const std::string right = left.empty() ? "" : gpt2_token_bytes(line.substr(space + 1), bad);
    if (left.empty() || right.empty()) {
      fail("tokens in GPT-2's byte-to-unicode alphabet",
           fmt::format("{} in {}", bad, quote_bytes(line)));
    }
    const int32_t want = static_cast<int32_t>(256 + merges++);
    auto it = by_bytes.find(left + right);
    if (it == by_bytes.end()) {
      fail(fmt::format("a merge whose result is in {} (with id {})", encoder_origin, want),
           fmt::format("{}, whose result is not", quote_bytes(line)));
    }
    if (it->second != want) {
      fail(fmt::format("merge {} to make id {} of {}", merges, want, encoder_origin),
           fmt::format("{}, which makes id {}", quote_bytes(line), it->second));
    }
  }
  // Every token is a byte or a merge's result: no token without a merge, or the merges are
  // truncated.
  if (v.tokens.size() != 256 + merges) {
    throw ConfigError(
        fmt::format("{}: expected 256 byte tokens + {} merges (one per line after "
                    "the first) = {} tokens as in {}, found {} tokens (truncated?)",
                    vocab_origin, merges, 256 + merges, encoder_origin, v.tokens.size()));
  }
  return v;
}

SpecialTokens pattern_specials(std::string_view pattern_name, size_t n_ranks) {
  if (pattern_name == "gpt2") return {{"<|endoftext|>", 50256}};
  if (pattern_name == "cl100k") {
    return {{"<|endoftext|>", 100257},
            {"<|fim_prefix|>", 100258},
            {"<|fim_middle|>", 100259},
            {"<|fim_suffix|>", 100260},
            {"<|endofprompt|>", 100276}};
  }
  if (pattern_name == "llama3") {
    // meta-llama/llama3 llama/tokenizer.py: 10 named, then reserved ones up to 256 in all.
    const std::vector<std::string> named = {"<|begin_of_text|>",
                                            "<|end_of_text|>",
                                            "<|reserved_special_token_0|>",
                                            "<|reserved_special_token_1|>",
                                            "<|reserved_special_token_2|>",
                                            "<|reserved_special_token_3|>",
                                            "<|start_header_id|>",
                                            "<|end_header_id|>",
                                            "<|reserved_special_token_4|>",
                                            "<|eot_id|>"};
    SpecialTokens s;
    int32_t id = static_cast<int32_t>(n_ranks);
    for (const std::string& name : named) s[name] = id++;
    for (int i = 5; i < 256 - 5; i++) s[fmt::format("<|reserved_special_token_{}|>", i)] = id++;
    return s;
  }
  return {};
}

std::string byte_level_spelling(std::string_view bytes) {
  static const std::array<int, 256> code_point = [] {
    std::array<int, 256> cp{};
    const std::array<int, 324> inv = unicode_to_bytes();
    for (int c = 0; c < 324; c++)
      if (inv[c] >= 0) cp[inv[c]] = c;
    return cp;
  }();
  std::string out;
  for (unsigned char b : bytes) {
    const int c = code_point[b];
    if (c < 0x80) {
      out += char(c);
    } else {  // below 0x800: two bytes of UTF-8
      out += char(0xC0 | (c >> 6));
      out += char(0x80 | (c & 0x3F));
    }
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> bpe_merges(std::vector<RankedToken> tokens) {
  std::unordered_map<std::string, int32_t> rank;
  for (const RankedToken& t : tokens) rank.emplace(t.bytes, t.rank);
  std::sort(tokens.begin(), tokens.end(),
            [](const RankedToken& a, const RankedToken& b) { return a.rank < b.rank; });
  std::vector<std::pair<std::string, std::string>> merges;
  for (const RankedToken& t : tokens) {
    if (t.bytes.size() < 2) continue;
    std::vector<std::string> parts;
    for (char c : t.bytes) parts.emplace_back(1, c);
    for (;;) {  // merge the lowest-ranked pair below the token's own rank
      size_t best = SIZE_MAX;
      int32_t best_rank = t.rank;
      for (size_t i = 0; i + 1 < parts.size(); i++) {
        const auto it = rank.find(parts[i] + parts[i + 1]);
        if (it != rank.end() && it->second < best_rank) best = i, best_rank = it->second;
      }
      if (best == SIZE_MAX) break;
      parts[best] += parts[best + 1];
      parts.erase(parts.begin() + long(best) + 1);
    }
    if (parts.size() != 2)
      throw ConfigError(fmt::format(
          "token {} (rank {}): byte-level BPE leaves it in {} parts, not the 2 of one merge",
          byte_level_spelling(t.bytes), t.rank, parts.size()));
    merges.emplace_back(parts[0], parts[1]);
  }
  return merges;
}

}  // namespace trainer
