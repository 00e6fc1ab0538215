#pragma once
// Token shards, memory-mapped. Four layouts are read:
//  - ours: a 64-byte header {magic "TRTOKENS", u32 version (2; 1 is read), u32 bytes per token
//    (2 | 4), u64 token count, u32 vocab size, u32 zero, u64 the tokenizer's identity hash
//    (version 2; io/tokenizer.h), u64 document count D (version 2; 0: no index), zero padding},
//    then the tokens, little-endian, then (version 2, D > 0) the document index: D u64 token
//    offsets at which documents start, strictly increasing and below the token count (a shard
//    may begin inside a document that an earlier shard started);
//  - llm.c: 256 x int32 header {magic, version, token count, ...}, then the tokens: GPT-2's
//    {20240520, 1} with uint16 tokens, Llama-3's {20240801, 7} with uint32 ones;
//  - nanoGPT: a headerless file of uint16 tokens, only when asked for (data.format =
//    "nanogpt"): with no magic to check, a damaged header would otherwise be read as tokens;
//  - Megatron-LM's indexed dataset, a pair `prefix.bin` (the tokens, headerless) and
//    `prefix.idx` {9 bytes "MMIDIDX\0\0", u64 version 1, u8 dtype code (8 uint16, 4 int32; the
//    others, int64 and floats among them, are refused), u64 sequence count S, u64 document index
//    count D, int32 lengths[S], int64 byte offsets into the .bin[S], int64 document indices[D]
//    (sequence numbers, the first 0, the last S)}. It is one token stream, named by either file or
//    by the bare prefix; a .bin with a .idx beside it is always read as Megatron's (whatever
//    data.format says), since the .bin alone has no header. The .idx is checked against the .bin
//    completely (sequences back to back from byte 0, filling the .bin exactly), and its documents
//    become the document index (empty documents, which Megatron's preprocessing writes for empty
//    texts, start no document).
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "io/errors.h"

namespace trainer {

// What a stat() mode is, in words ("a FIFO", "a character device"), for errors about input
// files that are not regular files.
const char* file_kind(unsigned mode);

class TokenShard {
 public:
  // Maps `path` and validates its header, size and that every token is < vocab_size.
  // headerless: the file is nanoGPT's uint16 tokens; else its magic decides. A Megatron pair
  // (see above) is recognised by its .idx in either case.
  TokenShard(const std::string& path, int vocab_size, bool headerless = false);
  ~TokenShard();
  TokenShard(TokenShard&& o) noexcept;
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;
  TokenShard& operator=(TokenShard&&) = delete;

  const std::string& path() const { return path_; }
  const char* format() const { return format_; }
  int64_t size() const { return count_; }
  // The identity hash of the tokenizer the shard was prepared with; 0 where the file does not
  // record one (our version 1, llm.c, nanoGPT, Megatron).
  uint64_t tokenizer_hash() const { return tokenizer_hash_; }
  // The document index (empty where the file has none): documents() documents start in this
  // shard, document i at token document_start(i).
  int64_t documents() const { return documents_; }
  int64_t document_start(int64_t i) const;
  // tokens [start, start + n) as int32
  void read(int64_t start, int64_t n, int32_t* out) const;

 private:
  void open(int vocab_size, bool headerless);
  void open_megatron(const std::string& idx, const std::string& bin, int vocab_size);
  void check_vocabulary(const std::string& file, size_t header, int vocab_size) const;
  void release();

  std::string path_;
  const char* format_ = "";
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const uint8_t* tokens_ = nullptr;
  int width_ = 2;
  int64_t count_ = 0;
  uint64_t tokenizer_hash_ = 0;
  bool signed_ = false;             // int32 tokens (Megatron's): a negative one is named as such
  const uint8_t* index_ = nullptr;  // documents_ u64 starts, in the mapped file (ours)
  std::vector<int64_t> starts_;     // or computed from Megatron's .idx, where index_ is null
  int64_t documents_ = 0;
};

// Writes our shard layout atomically (temporary file, then rename); tokenizer_hash 0: not
// recorded.
void write_token_shard(const std::string& path, const std::vector<int32_t>& tokens, int vocab_size,
                       uint64_t tokenizer_hash = 0);

}  // namespace trainer
