#include "io/byte_stream.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <zlib.h>
#include <zstd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "io/errors.h"
#include "io/token_shard.h"

namespace trainer {
namespace {

constexpr size_t kBufferBytes = 1 << 20;

// The file's own bytes, through one buffer; the decoders below read from it.
class RawFile {
 public:
  explicit RawFile(const std::string& path) : path_(path) {
    // A FIFO or a device (/dev/zero) would be read without end.
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
      throw DataError(fmt::format("{}: not a regular file ({}): an input text file must be one",
                                  path, file_kind(st.st_mode)));
    f_ = std::fopen(path.c_str(), "rb");
    if (!f_) throw DataError(fmt::format("{}: cannot open input text file", path));
    buf_.resize(kBufferBytes);
  }
  ~RawFile() {
    if (f_) std::fclose(f_);
  }
  RawFile(const RawFile&) = delete;
  RawFile& operator=(const RawFile&) = delete;

  // Fills the buffer when it is used up; false at the end of the file.
  bool fill() {
    if (pos_ < end_) return true;
    end_ = std::fread(buf_.data(), 1, buf_.size(), f_);
    if (end_ == 0 && std::ferror(f_))
      throw DataError(fmt::format("{}: read failed: {}", path_, strerror(errno)));
    pos_ = 0;
    return end_ > 0;
  }
  const char* data() const { return buf_.data() + pos_; }
  size_t available() const { return end_ - pos_; }
  void consume(size_t n) {
    pos_ += n;
    consumed_ += int64_t(n);
  }
  int64_t consumed() const { return consumed_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  FILE* f_ = nullptr;
  std::vector<char> buf_;
  size_t pos_ = 0, end_ = 0;
  int64_t consumed_ = 0;
};

class PlainStream : public ByteStream {
 public:
  explicit PlainStream(std::unique_ptr<RawFile> f) : f_(std::move(f)) {}
  size_t read(char* out, size_t n) override {
    if (!f_->fill()) return 0;
    const size_t k = std::min(n, f_->available());
    std::memcpy(out, f_->data(), k);
    f_->consume(k);
    return k;
  }
  int64_t file_bytes_read() const override { return f_->consumed(); }
  const char* encoding() const override { return "text"; }

 private:
  std::unique_ptr<RawFile> f_;
};

class GzipStream : public ByteStream {
 public:
  explicit GzipStream(std::unique_ptr<RawFile> f) : f_(std::move(f)) {
    // 15 + 16: gzip framing only (the magic said gzip).
    if (inflateInit2(&z_, 15 + 16) != Z_OK)
      throw DataError(fmt::format("{}: cannot start a gzip decoder", f_->path()));
  }
  ~GzipStream() override { inflateEnd(&z_); }
  size_t read(char* out, size_t n) override {
    z_.next_out = reinterpret_cast<Bytef*>(out);
    z_.avail_out = uInt(std::min<size_t>(n, 1u << 30));
    while (z_.avail_out > 0) {
      const bool more = f_->fill();
      if (!more && !in_member_) break;  // the end, where the last member ended
      if (!in_member_) {
        // gzip files may hold several members back to back (pigz, cat a.gz b.gz).
        inflateReset(&z_);
        in_member_ = true;
      }
      z_.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(f_->data()));
      z_.avail_in = uInt(f_->available());
      const uInt before = z_.avail_out;
      const int rc = inflate(&z_, Z_NO_FLUSH);
      f_->consume(f_->available() - z_.avail_in);
      if (rc == Z_STREAM_END) {
        in_member_ = false;
      } else if (rc != Z_OK && rc != Z_BUF_ERROR) {
        throw DataError(fmt::format("{}: offset {}: corrupt gzip data: {}", f_->path(),
                                    f_->consumed(), z_.msg ? z_.msg : zError(rc)));
      } else if (!more && z_.avail_out == before) {
        // No input left and nothing more from the decoder's window: the member is cut short.
        throw DataError(fmt::format(
            "{}: offset {}: truncated gzip stream (the file ends inside compressed data)",
            f_->path(), f_->consumed()));
      }
    }
    return n - z_.avail_out;
  }
  int64_t file_bytes_read() const override { return f_->consumed(); }
  const char* encoding() const override { return "gzip"; }

 private:
  std::unique_ptr<RawFile> f_;
  z_stream z_{};
  bool in_member_ = true;
};

class ZstdStream : public ByteStream {
 public:
  explicit ZstdStream(std::unique_ptr<RawFile> f) : f_(std::move(f)), z_(ZSTD_createDStream()) {
    if (!z_) throw DataError(fmt::format("{}: cannot start a zstd decoder", f_->path()));
  }
  ~ZstdStream() override { ZSTD_freeDStream(z_); }
  size_t read(char* out, size_t n) override {
    ZSTD_outBuffer o{out, n, 0};
    while (o.pos < o.size) {
      const bool more = f_->fill();
      if (!more && pending_ == 0) break;  // the end, where a frame ended and was flushed
      // At most 64 KB a call: an error's offset is then that close to the damage.
      ZSTD_inBuffer in{f_->data(), std::min<size_t>(f_->available(), 64 << 10), 0};
      const size_t before = o.pos;
      const int64_t at = f_->consumed();
      pending_ = ZSTD_decompressStream(z_, &o, &in);
      f_->consume(in.pos);
      // The decoder keeps input of its own, so the damage is somewhere in the bytes it was given.
      if (ZSTD_isError(pending_))
        throw DataError(fmt::format("{}: offset {}-{}: corrupt zstd data: {}", f_->path(), at,
                                    at + int64_t(in.size), ZSTD_getErrorName(pending_)));
      // No input left and nothing more from the decoder: the frame is cut short.
      if (!more && pending_ != 0 && o.pos == before)
        throw DataError(
            fmt::format("{}: offset {}: truncated zstd stream (the file ends inside a frame)",
                        f_->path(), f_->consumed()));
    }
    return o.pos;
  }
  int64_t file_bytes_read() const override { return f_->consumed(); }
  const char* encoding() const override { return "zstd"; }

 private:
  std::unique_ptr<RawFile> f_;
  ZSTD_DStream* z_;
  size_t pending_ = 1;  // nonzero: inside a frame
};

}  // namespace

std::unique_ptr<ByteStream> open_byte_stream(const std::string& path) {
  auto f = std::make_unique<RawFile>(path);
  f->fill();
  const auto* b = reinterpret_cast<const uint8_t*>(f->data());
  const size_t n = f->available();
  if (n >= 2 && b[0] == 0x1f && b[1] == 0x8b) return std::make_unique<GzipStream>(std::move(f));
  // A zstd frame, or one of zstd's skippable frames (0x184D2A5?, little-endian) before one.
  const bool zstd_frame = n >= 4 && b[0] == 0x28 && b[1] == 0xb5 && b[2] == 0x2f && b[3] == 0xfd;
  const bool skippable =
      n >= 4 && (b[0] & 0xf0) == 0x50 && b[1] == 0x2a && b[2] == 0x4d && b[3] == 0x18;
  if (zstd_frame || skippable) return std::make_unique<ZstdStream>(std::move(f));
  return std::make_unique<PlainStream>(std::move(f));
}

}  // namespace trainer
