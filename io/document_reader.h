#pragma once
// Documents from input files, in chunks of about `chunk_bytes` of text that tokenizer threads
// take one at a time. A plain-text file is one document; a JSON Lines file gives one document per
// line (a string field of each line's object). Small documents share a chunk; a large one spans
// several, cut where a space stands between two ASCII letters: BPE pre-tokenisation (GPT-2,
// cl100k, Llama 3) and SentencePiece split there anyway, so the pieces tokenize as the whole
// document would. Chunks are the same whatever the number of threads, and so are the tokens.
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "io/input_files.h"

namespace trainer {

enum class InputFormat { kAuto, kText, kJsonl };  // auto: *.jsonl / *.ndjson (also .gz, .zst)

// A part of one document inside a chunk's text.
struct DocumentPiece {
  int64_t document = 0;              // global document number, from 0, in input order
  size_t begin = 0, size = 0;        // bytes of TextChunk::text
  bool first = false, last = false;  // the document's first / last piece
  int32_t file = 0;                  // index into the input files
  int64_t line = 0;                  // JSON Lines: the document's line (from 1); 0 for plain text
};

struct TextChunk {
  int64_t seq = 0;  // chunks are numbered from 0 in input order
  std::string text;
  std::vector<DocumentPiece> pieces;
};

struct DocumentReaderOptions {
  InputFormat format = InputFormat::kAuto;
  std::string field = "text";  // JSON Lines: the field that holds a document's text
  size_t chunk_bytes = 1 << 20;
};

// Whether `path` is read as JSON Lines under `format`.
bool is_jsonl(const std::string& path, InputFormat format);

class DocumentReader {
 public:
  DocumentReader(std::vector<InputFile> files, DocumentReaderOptions options);
  // Reads every file and calls emit with each chunk, in order. A bad line, an empty plain-text
  // file and damaged compressed data throw DataError naming the file (and line or offset).
  // Documents of no text are skipped (a document is never empty).
  void run(const std::function<void(TextChunk&&)>& emit);
  // Bytes of the input files consumed so far (another thread may ask).
  int64_t file_bytes_read() const { return bytes_read_.load(std::memory_order_relaxed); }
  int64_t documents() const { return next_document_; }  // after run()

 private:
  void read_text(int32_t file);
  void read_jsonl(int32_t file);
  // Adds a document's text (or, for a plain-text file, a part of it) to the chunk.
  void add_text(std::string_view text, int32_t file, int64_t line, bool first, bool last);
  void flush();

  std::vector<InputFile> files_;
  DocumentReaderOptions opt_;
  std::function<void(TextChunk&&)> emit_;
  TextChunk chunk_;
  int64_t next_document_ = 0;
  int64_t done_bytes_ = 0;  // of the files finished
  std::atomic<int64_t> bytes_read_{0};
};

}  // namespace trainer
