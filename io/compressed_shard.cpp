#include "io/compressed_shard.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>
#include <zstd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <thread>
#include <vector>

#include "io/atomic_file.h"
#include "io/byte_stream.h"
#include "io/errors.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;

constexpr uint32_t kZstdMagic = 0xFD2FB528;
constexpr uint32_t kSkippableMagic = 0x184D2A5D;  // one of zstd's 16 skippable-frame magics
constexpr char kTag[8] = {'T', 'R', 'S', 'H', 'A', 'R', 'D', '1'};

// The skippable frame that opens our compressed shards.
struct HashFrame {
  uint32_t magic = kSkippableMagic;
  uint32_t size = 24;  // of what follows
  char tag[8] = {'T', 'R', 'S', 'H', 'A', 'R', 'D', '1'};
  uint64_t hash = 0;   // XXH3-64 of the decompressed shard
  uint64_t bytes = 0;  // its size
};
static_assert(sizeof(HashFrame) == 32);

struct FileCloser {
  void operator()(FILE* f) const {
    if (f) std::fclose(f);
  }
};
using File = std::unique_ptr<FILE, FileCloser>;

struct HashState {
  XXH3_state_t* s = XXH3_createState();
  HashState() { XXH3_64bits_reset(s); }
  ~HashState() { XXH3_freeState(s); }
  void update(const void* p, size_t n) { XXH3_64bits_update(s, p, n); }
  uint64_t digest() const { return XXH3_64bits_digest(s); }
};

// open_temporary_beside (io/atomic_file.h), owned.
std::pair<std::string, File> temporary_beside(const std::string& path) {
  std::string tmp;
  File f(open_temporary_beside(path, tmp));
  return {tmp, std::move(f)};
}

void write_all(FILE* f, const void* p, size_t n, const std::string& path) {
  if (n && std::fwrite(p, 1, n, f) != n)
    throw DataError(fmt::format("{}: write failed: {}", path, strerror(errno)));
}

// Flushes and fsyncs `f` and renames `tmp` to `path`.
void publish(File f, const std::string& tmp, const std::string& path) {
  if (std::fflush(f.get()) != 0 || ::fsync(::fileno(f.get())) != 0) {
    ::unlink(tmp.c_str());
    throw DataError(fmt::format("{}: write failed: {}", tmp, strerror(errno)));
  }
  f.reset();
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    throw DataError(fmt::format("{}: cannot rename into place: {}", path, strerror(errno)));
  }
}

// The recorded hash frame of a compressed shard, if it has one.
bool read_hash_frame(const std::string& zst, HashFrame& out) {
  File f(std::fopen(zst.c_str(), "rb"));
  if (!f) throw DataError(fmt::format("{}: cannot open data file: {}", zst, strerror(errno)));
  HashFrame h;
  if (std::fread(&h, sizeof h, 1, f.get()) != 1) return false;
  if (h.magic != kSkippableMagic || h.size != 24 || std::memcmp(h.tag, kTag, 8) != 0) return false;
  out = h;
  return true;
}

// XXH3-64 and size of a whole file; false if it cannot be read.
bool hash_file(const std::string& path, uint64_t& hash, uint64_t& bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return false;
  struct stat st {};
  ::fstat(fd, &st);
  bytes = uint64_t(st.st_size);
  if (bytes == 0) {
    ::close(fd);
    hash = XXH3_64bits(nullptr, 0);
    return true;
  }
  void* map = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return false;
  ::madvise(map, bytes, MADV_SEQUENTIAL);
  hash = XXH3_64bits(map, bytes);
  ::munmap(map, bytes);
  return true;
}

// Decompresses `zst` into a temporary beside `path`; checks the result against the hash frame
// when there is one. Returns the temporary's name and its open file.
std::pair<std::string, File> decompress_beside(const std::string& zst, const std::string& path,
                                               const HashFrame* recorded) {
  auto [tmp, out] = temporary_beside(path);
  try {
    const std::unique_ptr<ByteStream> in = open_byte_stream(zst);
    HashState hash;
    uint64_t bytes = 0;
    std::vector<char> buf(1 << 20);
    for (size_t n; (n = in->read(buf.data(), buf.size())) > 0; bytes += n) {
      hash.update(buf.data(), n);
      write_all(out.get(), buf.data(), n, tmp);
    }
    if (recorded && (hash.digest() != recorded->hash || bytes != recorded->bytes))
      throw DataError(fmt::format(
          "{}: decompresses to {} bytes with hash {:016x}, but its header records {} bytes with "
          "hash {:016x}: the file is damaged",
          zst, bytes, hash.digest(), recorded->bytes, recorded->hash));
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  return {tmp, std::move(out)};
}

// Temporaries beside `path` (<path>.XXXXXX.tmp) not written for ten minutes: left by a process
// that was killed while decompressing (a live one writes a megabyte at a time).
void remove_stale_temporaries(const std::string& path) {
  const fs::path p(path);
  const std::string prefix = p.filename().string() + ".";
  std::error_code ec;
  const auto now = fs::file_time_type::clock::now();
  for (const auto& e : fs::directory_iterator(p.parent_path(), ec)) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with(prefix) || !name.ends_with(".tmp")) continue;
    const auto written = fs::last_write_time(e.path(), ec);
    if (!ec && now - written > std::chrono::minutes(10)) fs::remove(e.path(), ec);
  }
}

}  // namespace

void ShardDecompressor::mapped(const DecompressedShard& d) {
  if (d.temporary) ::unlink(d.path.c_str());
}

bool is_zstd_file(const std::string& path) {
  File f(std::fopen(path.c_str(), "rb"));
  uint32_t magic = 0;
  if (!f || std::fread(&magic, 4, 1, f.get()) != 1) return false;
  return magic == kZstdMagic || (magic & 0xFFFFFFF0u) == 0x184D2A50u;
}

void compress_shard(const std::string& src, const std::string& dst, int level) {
  File in(std::fopen(src.c_str(), "rb"));
  if (!in) throw DataError(fmt::format("{}: cannot read: {}", src, strerror(errno)));
  auto [tmp, out] = temporary_beside(dst);
  std::unique_ptr<ZSTD_CCtx, size_t (*)(ZSTD_CCtx*)> z(ZSTD_createCCtx(), ZSTD_freeCCtx);
  try {
    if (!z) throw DataError(fmt::format("{}: cannot start a zstd encoder", dst));
    ZSTD_CCtx_setParameter(z.get(), ZSTD_c_compressionLevel, level);
    ZSTD_CCtx_setParameter(z.get(), ZSTD_c_checksumFlag, 1);
    // Every core where libzstd was built with threads (Debian's is); an error here is harmless.
    ZSTD_CCtx_setParameter(z.get(), ZSTD_c_nbWorkers, int(std::thread::hardware_concurrency()));
    HashFrame frame;  // its hash and size are filled in at the end
    write_all(out.get(), &frame, sizeof frame, tmp);
    HashState hash;
    std::vector<char> ibuf(ZSTD_CStreamInSize()), obuf(ZSTD_CStreamOutSize());
    for (bool last = false; !last;) {
      const size_t n = std::fread(ibuf.data(), 1, ibuf.size(), in.get());
      if (std::ferror(in.get()))
        throw DataError(fmt::format("{}: read failed: {}", src, strerror(errno)));
      last = n < ibuf.size();
      hash.update(ibuf.data(), n);
      frame.bytes += n;
      ZSTD_inBuffer zi{ibuf.data(), n, 0};
      for (bool done = false; !done;) {
        ZSTD_outBuffer zo{obuf.data(), obuf.size(), 0};
        const size_t left =
            ZSTD_compressStream2(z.get(), &zo, &zi, last ? ZSTD_e_end : ZSTD_e_continue);
        if (ZSTD_isError(left))
          throw DataError(fmt::format("{}: zstd: {}", dst, ZSTD_getErrorName(left)));
        write_all(out.get(), obuf.data(), zo.pos, tmp);
        done = last ? left == 0 : zi.pos == zi.size;
      }
    }
    frame.hash = hash.digest();
    if (std::fseek(out.get(), 0, SEEK_SET) != 0)
      throw DataError(fmt::format("{}: seek failed: {}", tmp, strerror(errno)));
    write_all(out.get(), &frame, sizeof frame, tmp);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  publish(std::move(out), tmp, dst);
}

DecompressedShard decompress_shard(const std::string& zst, const std::string& cache_dir) {
  HashFrame recorded;
  const bool has_hash = read_hash_frame(zst, recorded);
  if (cache_dir.empty() || !has_hash) {
    const std::string where = (fs::temp_directory_path() / fs::path(zst).filename()).string();
    auto [tmp, out] = decompress_beside(zst, where, has_hash ? &recorded : nullptr);
    if (std::fflush(out.get()) != 0)
      throw DataError(fmt::format("{}: write failed: {}", tmp, strerror(errno)));
    return {tmp, true, has_hash ? "decompressed" : "decompressed (no hash recorded: not cached)"};
  }
  std::error_code ec;
  fs::create_directories(cache_dir, ec);
  if (ec)
    throw DataError(
        fmt::format("{}: cannot make the data cache directory: {}", cache_dir, ec.message()));
  std::string stem = fs::path(zst).filename().string();
  for (const char* ext : {".zst", ".bin"})
    if (stem.ends_with(ext)) stem.resize(stem.size() - std::strlen(ext));
  const std::string cached = fmt::format("{}/{}-{:016x}.bin", cache_dir, stem, recorded.hash);
  remove_stale_temporaries(cached);
  uint64_t hash = 0, bytes = 0;
  const bool present = fs::exists(cached);
  if (present && hash_file(cached, hash, bytes) && hash == recorded.hash && bytes == recorded.bytes)
    return {cached, false, "from the cache"};
  auto [tmp, out] = decompress_beside(zst, cached, &recorded);
  publish(std::move(out), tmp, cached);
  return {cached, false,
          present ? "decompressed again into the cache (the cached copy was damaged)"
                  : "decompressed into the cache"};
}

}  // namespace trainer
