#pragma once
// Byte-level BPE as tiktoken does it: a pre-tokenizer splits the text into pieces and each piece
// is merged on its own, the adjacent pair whose bytes have the lowest rank first, until no pair
// has a rank; the token ids are the ranks. GPT-2's encoder.json + vocab.bpe and tiktoken rank
// files both become such a rank table (io/bpe_files.h).
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "io/pretokenizer.h"
#include "io/tokenizer.h"
#include "io/tokenizer_spec.h"

namespace trainer {

struct RankedToken {
  std::string bytes;
  int32_t rank;  // also the token's id
};

class BpeRanks {
 public:
  static constexpr int32_t kNoRank = INT32_MAX;
  // Every single byte must be ranked (checked by the file parsers), so that any bytes encode.
  explicit BpeRanks(const std::vector<RankedToken>& tokens);

  int32_t rank(std::string_view bytes) const {
    auto it = ranks_.find(bytes);
    return it == ranks_.end() ? kNoRank : it->second;
  }
  // Appends the ids of one piece. Pieces up to kLinearMax bytes take tiktoken's byte_pair_merge
  // (a rescan of the piece per merge: fastest for the short pieces text is made of); longer ones
  // (a run of 10,000 spaces) a heap, O(n log n), with the same merges in the same order.
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  void encode_piece_linear(std::string_view piece, std::vector<int32_t>& out) const;
  void encode_piece_heap(std::string_view piece, std::vector<int32_t>& out) const;
  static constexpr size_t kLinearMax = 256;

  size_t size() const { return ranks_.size(); }
  int32_t max_rank() const { return max_rank_; }

 private:
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
  };
  std::unordered_map<std::string, int32_t, Hash, std::equal_to<>> ranks_;
  int32_t max_rank_ = -1;
};

class BpeTokenizer : public Tokenizer {
 public:
  // spec.specials must not reuse a rank's id (ConfigError naming the first file).
  BpeTokenizer(const TokenizerSpec& spec, const std::vector<RankedToken>& tokens);

  std::vector<int32_t> encode_ordinary(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& tokens) const override;
  int vocab_size() const override { return static_cast<int>(decoder_.size()); }
  bool has_token(int32_t id) const override { return id >= 0 && id < vocab_size() && has_id_[id]; }

 private:
  BpeRanks ranks_;
  Pretokenizer pre_;
  std::vector<std::string> decoder_;  // id -> bytes (special tokens: their names)
  std::vector<bool> has_id_;
};

}  // namespace trainer
