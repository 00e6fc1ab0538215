#pragma once
// What defines a tokenizer, as data: its kind, the exact bytes of its files, its pre-tokenisation
// pattern and its special tokens. Serialised canonically (fields in a fixed order, special tokens
// sorted), so that the bytes, and the hash of them, are the tokenizer's identity.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "io/tokenizer.h"

namespace trainer {

struct SpecFile {
  std::string role;    // "ranks", "encoder.json", "vocab.bpe", "model"
  std::string origin;  // where the bytes came from, for errors; not serialised
  std::string bytes;
};

struct TokenizerSpec {
  std::string kind;
  std::string pattern_name;  // "" where the kind has none
  std::string pattern;       // the regex text itself, so a rebuilt tokenizer needs no table
  SpecialTokens specials;
  std::vector<SpecFile> files;
};

std::string serialize_spec(const TokenizerSpec& spec);
// Throws CheckpointError naming `source`, the offset, what was expected and what was found.
TokenizerSpec parse_spec(std::string_view bytes, const std::string& source);

// 64-bit FNV-1a: simple, stable across runs, machines and compilers (std::hash is none of these).
inline uint64_t fnv1a64(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

// Up to `max` bytes of `bytes` from `offset`, quoted, with non-printable bytes as \xNN: how errors
// show what they found.
std::string quote_bytes(std::string_view bytes, size_t offset = 0, size_t max = 40);

}  // namespace trainer
