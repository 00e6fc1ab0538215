#pragma once
// The byte-level tokenizer: token = byte value, vocab 256. Lossless for any input.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace trainer {

constexpr int kByteVocab = 256;

std::vector<int32_t> byte_encode(std::string_view text);
std::string byte_decode(const std::vector<int32_t>& tokens);

// Until a real tokenizer exists, a model whose vocabulary is not the byte vocabulary takes and
// gives token ids: its samples start from token 0 and print as ids ("5 17 300").
inline bool is_byte_vocabulary(int vocab_size) {
  return vocab_size == kByteVocab;
}
std::string ids_text(const std::vector<int32_t>& tokens);

}  // namespace trainer
