#pragma once
// Splits text into the pieces that byte-level BPE encodes one by one, with a tiktoken-style
// regex run by PCRE2 (JIT-compiled where available). The pieces tile the input exactly, whatever
// its bytes: what the regex cannot match (invalid UTF-8) becomes pieces of its own.
#include <functional>
#include <string>
#include <string_view>

namespace trainer {

// The named patterns, as tiktoken and Meta write them: "gpt2" (GPT-2, r50k), "cl100k" (GPT-4's,
// as the npm tiktoken package ships it) and "llama3" (Meta's llama/tokenizer.py: the same text as
// cl100k). Returns nullptr for an unknown name.
const char* named_pattern(std::string_view name);
std::string pattern_names();  // "gpt2, cl100k, llama3", for errors

class Pretokenizer {
 public:
  // Throws ConfigError naming `origin` where PCRE2 cannot compile the pattern.
  Pretokenizer(const std::string& pattern, const std::string& origin);
  ~Pretokenizer();
  Pretokenizer(const Pretokenizer&) = delete;
  Pretokenizer& operator=(const Pretokenizer&) = delete;

  // Calls emit(piece) for each piece in order; concatenated, the pieces are `text`.
  void split(std::string_view text, const std::function<void(std::string_view)>& emit) const;

 private:
  void* code_;  // pcre2_code_8; void here so that users do not need PCRE2's headers
};

// tiktoken's patterns are written for Rust's regex, where \s is Unicode White_Space; PCRE2's \s
// also matches U+180E (MONGOLIAN VOWEL SEPARATOR, no longer White_Space since Unicode 6.3). The
// pattern PCRE2 runs spells \s and \S out as White_Space. Exposed for the tests.
std::string pcre2_pattern(std::string_view pattern);

}  // namespace trainer
