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

}  // namespace trainer
