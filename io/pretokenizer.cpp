#include "io/pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fmt/format.h>
#include <pcre2.h>

#include <array>
#include <memory>
#include <stdexcept>

#include "io/errors.h"

namespace trainer {

namespace {

struct Named {
  const char* name;
  const char* pattern;
};
// gpt2: GPT-2's encoder.py (tiktoken's r50k_base has the same text). cl100k: the npm tiktoken
// package's encoders/cl100k_base.json pat_str. llama3: meta-llama/llama3 llama/tokenizer.py
// Tokenizer.pat_str.
constexpr std::array<Named, 3> kPatterns = {{
    {"gpt2", R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)"},
    {"cl100k",
     R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
    {"llama3",
     R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
}};

// Unicode White_Space, as a class body.
constexpr std::string_view kWhiteSpace =
    R"(\t-\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";

pcre2_code* code_of(void* p) {
  return static_cast<pcre2_code*>(p);
}

}  // namespace

const char* named_pattern(std::string_view name) {
  for (const Named& n : kPatterns)
    if (name == n.name) return n.pattern;
  return nullptr;
}

std::string pattern_names() {
  std::string out;
  for (const Named& n : kPatterns) out += (out.empty() ? "" : ", ") + std::string(n.name);
  return out;
}

std::string pcre2_pattern(std::string_view p) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); i++) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      i++;
      if (e == 's') {
        out += in_class ? std::string(kWhiteSpace) : fmt::format("[{}]", kWhiteSpace);
      } else if (e == 'S' && !in_class) {
        out += fmt::format("[^{}]", kWhiteSpace);
      } else if (e == 'S') {
        // [^\S...] has no class-body spelling; none of the named patterns needs it.
        throw std::invalid_argument("pcre2_pattern: \\S inside a character class");
      } else {
        out += c;
        out += e;
      }
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      // A ']' or '^]' right after '[' is a literal, not the end of the class.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

Pretokenizer::Pretokenizer(const std::string& pattern, const std::string& origin) {
  std::string translated;
  try {
    translated = pcre2_pattern(pattern);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(fmt::format("{}: pattern {}: {}", origin, pattern, e.what()));
  }
  int error = 0;
  PCRE2_SIZE offset = 0;
  // UCP: \p{L}, \p{N} and case-insensitivity by Unicode's tables. MATCH_INVALID_UTF: invalid
  // UTF-8 never matches (and never crashes); split() turns it into pieces of its own.
  pcre2_code* code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                    PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error, &offset, nullptr);
  if (!code) {
    std::array<PCRE2_UCHAR, 256> msg{};
    pcre2_get_error_message(error, msg.data(), msg.size());
    throw ConfigError(
        fmt::format("{}: pattern offset {}: expected a regular expression, found {} "
                    "({})",
                    origin, offset, pattern, reinterpret_cast<char*>(msg.data())));
  }
  // Without JIT (an architecture PCRE2 cannot JIT for) the interpreter gives the same pieces.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  code_ = code;
}

Pretokenizer::~Pretokenizer() {
  pcre2_code_free(code_of(code_));
}

void Pretokenizer::split(std::string_view text,
                         const std::function<void(std::string_view)>& emit) const {
  pcre2_code* code = code_of(code_);
  // Per call, so that one Pretokenizer serves many threads. The JIT stack grows to 8 MiB: the
  // default 32 KiB is too little for lookaheads over long whitespace runs.
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
      pcre2_match_data_create_from_pattern(code, nullptr), &pcre2_match_data_free);
  std::unique_ptr<pcre2_match_context, decltype(&pcre2_match_context_free)> mc(
      pcre2_match_context_create(nullptr), &pcre2_match_context_free);
  std::unique_ptr<pcre2_jit_stack, decltype(&pcre2_jit_stack_free)> stack(
      pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr), &pcre2_jit_stack_free);
  if (!md || !mc || !stack) throw std::bad_alloc();
  pcre2_jit_stack_assign(mc.get(), nullptr, stack.get());
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
  size_t pos = 0;
  while (pos < text.size()) {
    const int rc = pcre2_match(code, subject, text.size(), pos, 0, md.get(), mc.get());
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      std::array<PCRE2_UCHAR, 256> msg{};
      pcre2_get_error_message(rc, msg.data(), msg.size());
      throw std::runtime_error(fmt::format("pre-tokenizer: PCRE2 failed at byte {}: {}", pos,
                                           reinterpret_cast<char*>(msg.data())));
    }
    size_t start = ov[0], end = ov[1];
    if (start > pos) emit(text.substr(pos, start - pos));  // bytes no match covers
    if (end == start) end = start + 1;  // an empty match (none of the named patterns has one)
    emit(text.substr(start, end - start));
    pos = end;
  }
  if (pos < text.size()) emit(text.substr(pos));
}

}  // namespace trainer
