#pragma once
// An input file read as a stream of bytes, decompressed on the fly where its first bytes are the
// magic of gzip (1f 8b) or zstd (28 b5 2f fd, or a skippable frame 5? 2a 4d 18): prepare reads
// corpora far larger than memory, so nothing here holds more than one buffer of the file.
#include <cstdint>
#include <memory>
#include <string>

namespace trainer {

class ByteStream {
 public:
  virtual ~ByteStream() = default;
  // Up to n decompressed bytes into out; 0 only at the end. A damaged or truncated compressed
  // file throws DataError naming the file and the compressed offset.
  virtual size_t read(char* out, size_t n) = 0;
  // Bytes of the file itself consumed so far (compressed bytes for a compressed file).
  virtual int64_t file_bytes_read() const = 0;
  // "text", "gzip" or "zstd".
  virtual const char* encoding() const = 0;
};

// Opens `path` (a regular file, else DataError) and picks the decoder from its magic bytes.
std::unique_ptr<ByteStream> open_byte_stream(const std::string& path);

}  // namespace trainer
