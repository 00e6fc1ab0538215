#include "io/document_reader.h"

#include <fmt/format.h>

#include <memory>
#include <nlohmann/json.hpp>

#include "io/byte_stream.h"
#include "io/errors.h"

namespace trainer {
namespace {

constexpr size_t kReadBytes = 1 << 20;

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

bool ascii_letter(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}

// Where to end a piece of about `target` bytes of `text`: before a space between two letters,
// searched back to half the target; failing that (no such space: not prose) at `target`, moved
// off the middle of a UTF-8 sequence.
size_t cut_point(std::string_view text, size_t target) {
  for (size_t i = target; i > target / 2; i--)
    if (text[i] == ' ' && ascii_letter(text[i - 1]) && i + 1 < text.size() &&
        ascii_letter(text[i + 1]))
      return i;
  size_t i = target;
  for (int k = 0; k < 3 && (uint8_t(text[i]) & 0xc0) == 0x80; k++) i--;
  return i;
}

}  // namespace

bool is_jsonl(const std::string& path, InputFormat format) {
  if (format != InputFormat::kAuto) return format == InputFormat::kJsonl;
  std::string p = path;
  for (const char* z : {".gz", ".zst", ".zstd"})
    if (ends_with(p, z)) p.resize(p.size() - std::string(z).size());
  return ends_with(p, ".jsonl") || ends_with(p, ".ndjson");
}

DocumentReader::DocumentReader(std::vector<InputFile> files, DocumentReaderOptions options)
    : files_(std::move(files)), opt_(std::move(options)) {}

void DocumentReader::run(const std::function<void(TextChunk&&)>& emit) {
  emit_ = emit;
  for (int32_t f = 0; f < int32_t(files_.size()); f++) {
    if (is_jsonl(files_[f].path, opt_.format))
      read_jsonl(f);
    else
      read_text(f);
  }
  flush();
}

void DocumentReader::flush() {
  if (chunk_.pieces.empty()) return;
  const int64_t seq = chunk_.seq;
  emit_(std::move(chunk_));
  chunk_ = TextChunk{};
  chunk_.seq = seq + 1;
}

void DocumentReader::add_text(std::string_view text, int32_t file, int64_t line, bool first,
                              bool last) {
  if (first) next_document_++;
  DocumentPiece p;
  p.document = next_document_ - 1;
  p.begin = chunk_.text.size();
  p.size = text.size();
  p.first = first;
  p.last = last;
  p.file = file;
  p.line = line;
  chunk_.text.append(text);
  chunk_.pieces.push_back(p);
  if (chunk_.text.size() >= opt_.chunk_bytes) flush();
}

void DocumentReader::read_text(int32_t file) {
  const std::string& path = files_[file].path;
  auto in = open_byte_stream(path);
  std::string carry;  // the document's text not yet added to a chunk
  bool first = true;
  int64_t total = 0;
  std::vector<char> buf(kReadBytes);
  while (size_t n = in->read(buf.data(), buf.size())) {
    carry.append(buf.data(), n);
    total += int64_t(n);
    bytes_read_.store(done_bytes_ + in->file_bytes_read(), std::memory_order_relaxed);
    // Cut as soon as the text passes the room left in the chunk (at least a quarter chunk, so
    // that pieces stay large): where it is cut depends on the text alone, not on read sizes.
    for (;;) {
      const size_t room = std::max(opt_.chunk_bytes / 4, opt_.chunk_bytes - chunk_.text.size());
      if (carry.size() <= room + 1) break;
      const size_t cut = cut_point(carry, room);
      add_text(std::string_view(carry).substr(0, cut), file, 0, first, false);
      first = false;
      carry.erase(0, cut);
    }
  }
  if (total == 0) throw DataError(fmt::format("{}: input text file is empty", path));
  add_text(carry, file, 0, first, true);
  done_bytes_ += in->file_bytes_read();
  bytes_read_.store(done_bytes_, std::memory_order_relaxed);
}

void DocumentReader::read_jsonl(int32_t file) {
  const std::string& path = files_[file].path;
  auto in = open_byte_stream(path);
  std::vector<char> buf(kReadBytes);
  std::string line;
  int64_t line_no = 0;
  auto document = [&]() {
    line_no++;
    if (line.find_first_not_of(" \t\r") == std::string::npos) return;  // a blank line
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      throw DataError(
          fmt::format("{}:{}: not valid JSON (at byte {} of the line)", path, line_no, e.byte));
    }
    const auto it = j.is_object() ? j.find(opt_.field) : j.end();
    if (!j.is_object() || it == j.end() || !it->is_string())
      throw DataError(fmt::format("{}:{}: expected an object with a string field \"{}\"", path,
                                  line_no, opt_.field));
    const std::string& text = it->get_ref<const std::string&>();
    // A document larger than a chunk spans several, cut as in plain text.
    std::string_view rest = text;
    bool first = true;
    while (rest.size() > opt_.chunk_bytes) {
      const size_t cut = cut_point(rest, opt_.chunk_bytes);
      add_text(rest.substr(0, cut), file, line_no, first, false);
      first = false;
      rest.remove_prefix(cut);
    }
    if (!rest.empty() || !first) add_text(rest, file, line_no, first, true);
  };
  while (size_t n = in->read(buf.data(), buf.size())) {
    bytes_read_.store(done_bytes_ + in->file_bytes_read(), std::memory_order_relaxed);
    size_t start = 0;
    for (size_t i = 0; i < n; i++) {
      if (buf[i] != '\n') continue;
      line.append(buf.data() + start, i - start);
      document();
      line.clear();
      start = i + 1;
    }
    line.append(buf.data() + start, n - start);
  }
  if (!line.empty()) document();  // the last line, without its newline
  done_bytes_ += in->file_bytes_read();
  bytes_read_.store(done_bytes_, std::memory_order_relaxed);
}

}  // namespace trainer
