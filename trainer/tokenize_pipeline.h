#pragma once
// prepare's three stages: one thread reads documents into chunks (io/document_reader.h), worker
// threads tokenize chunks, and the calling thread takes the tokenized chunks in input order.
// At most min(threads + 4, kMaxChunksInFlight) chunks are in flight (read and not yet taken), so
// memory stays bounded whatever the corpus size and the number of cores (a chunk of bytes
// tokens takes about 8 times its text: the text, int32 tokens, the tokenizer's own vector), and
// the order taken never depends on the number of threads.
#include <cstdint>
#include <functional>
#include <vector>

#include "io/document_reader.h"
#include "io/tokenizer.h"

namespace trainer {

constexpr int64_t kChunkBytes = 256 << 10;
constexpr int64_t kMaxChunksInFlight = 48;

struct TokenizedChunk {
  int64_t seq = 0;
  std::vector<DocumentPiece> pieces;  // as read; text offsets no longer meaningful
  std::vector<size_t> token_begin;    // piece i's tokens: [token_begin[i], token_begin[i + 1])
  std::vector<int32_t> tokens;
};

// Runs the reader and `threads` tokenizer workers; calls consume with each chunk in order. An
// exception in any stage stops them all and is rethrown here.
void run_tokenize_pipeline(DocumentReader& reader, const Tokenizer& tokenizer, int threads,
                           const std::function<void(const TokenizedChunk&)>& consume);

}  // namespace trainer
