#include "io/tokenizer.h"

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

}  // namespace trainer
