#include "io/token_shard.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "io/atomic_file.h"

namespace trainer {
namespace {

constexpr char kMagic[8] = {'T', 'R', 'T', 'O', 'K', 'E', 'N', 'S'};
constexpr size_t kHeaderBytes = 64;
// llm.c's dev/data/data_common.py: GPT-2 shards {20240520, version 1} hold uint16 tokens,
// Llama-3 ones {20240801, version 7} uint32 tokens.
constexpr int32_t kLlmcMagic = 20240520, kLlmcLlama3Magic = 20240801;
constexpr size_t kLlmcHeaderBytes = 256 * sizeof(int32_t);

struct Header {
  char magic[8];
  uint32_t version;
  uint32_t token_bytes;
  uint64_t count;
  uint32_t vocab_size;
  uint32_t reserved0;
  uint64_t tokenizer_hash;  // version 2: Tokenizer::identity_hash() of the tokenizer used
  uint64_t documents;       // version 2: entries of the document index after the tokens (0: none)
  uint8_t reserved[16];
};
static_assert(sizeof(Header) == kHeaderBytes);

}  // namespace

const char* file_kind(unsigned mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return S_ISREG(mode) ? "a regular file" : "a special file";
}

TokenShard::TokenShard(const std::string& path, int vocab_size, bool headerless) : path_(path) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just below).
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK);
  if (fd < 0) throw DataError(fmt::format("{}: cannot open data file: {}", path, strerror(errno)));
  struct stat st {};
  fstat(fd, &st);
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw DataError(fmt::format("{}: not a regular file ({}): a data shard must be one", path,
                                file_kind(st.st_mode)));
  }
  map_bytes_ = size_t(st.st_size);
  if (map_bytes_ == 0) {
    ::close(fd);
    throw DataError(fmt::format("{}: data file is empty", path));
  }
  map_ = mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw DataError(fmt::format("{}: cannot map data file: {}", path, strerror(errno)));
  }
  const auto* bytes = static_cast<const uint8_t*>(map_);
  auto fail = [&](const std::string& what) {
    munmap(map_, map_bytes_);
    map_ = nullptr;
    throw DataError(fmt::format("{}: {}", path, what));
  };

  size_t header = 0;
  uint64_t declared = 0, documents = 0;
  int32_t llmc_magic = 0;
  if (map_bytes_ >= 4) std::memcpy(&llmc_magic, bytes, 4);
  if (headerless) {
    if (map_bytes_ % 2 != 0)
      fail(
          fmt::format("a headerless file of uint16 tokens (data.format = \"nanogpt\") has an "
                      "even size, found {} bytes",
                      map_bytes_));
    format_ = "nanoGPT uint16";
    declared = map_bytes_ / 2;
  } else if (map_bytes_ >= 8 && std::memcmp(bytes, kMagic, 8) == 0) {
    if (map_bytes_ < kHeaderBytes)
      fail(fmt::format("header truncated: expected {} bytes, file has {}", kHeaderBytes,
                       map_bytes_));
    Header h;
    std::memcpy(&h, bytes, sizeof h);
    if (h.version != 1 && h.version != 2)
      fail(fmt::format("offset 8: expected version 1 or 2, found {}", h.version));
    if (h.token_bytes != 2 && h.token_bytes != 4)
      fail(fmt::format("offset 12: expected 2 or 4 bytes per token, found {}", h.token_bytes));
    format_ = "trainer";
    header = kHeaderBytes;
    width_ = int(h.token_bytes);
    declared = h.count;
    tokenizer_hash_ = h.version >= 2 ? h.tokenizer_hash : 0;
    documents = h.version >= 2 ? h.documents : 0;
  } else if (llmc_magic == kLlmcMagic || llmc_magic == kLlmcLlama3Magic) {
    if (map_bytes_ < kLlmcHeaderBytes)
      fail(fmt::format("llm.c header truncated: expected {} bytes, file has {}", kLlmcHeaderBytes,
                       map_bytes_));
    const auto* h = reinterpret_cast<const int32_t*>(bytes);
    const bool llama3 = llmc_magic == kLlmcLlama3Magic;
    if (h[1] != (llama3 ? 7 : 1))
      fail(fmt::format("offset 4: expected llm.c version {} after magic {}, found {}",
                       llama3 ? 7 : 1, h[0], h[1]));
    format_ = llama3 ? "llm.c uint32 (v7)" : "llm.c";
    header = kLlmcHeaderBytes;
    width_ = llama3 ? 4 : 2;
    declared = uint64_t(uint32_t(h[2]));
  } else {
    std::string shown;
    for (size_t i = 0; i < std::min<size_t>(map_bytes_, 8); i++)
      shown += fmt::format("{}{:02x}", i ? " " : "", bytes[i]);
    fail(fmt::format(
        "offset 0: unrecognised data file: expected the magic \"TRTOKENS\" or llm.c's {} or {}, "
        "found {} bytes starting {} (a headerless nanoGPT file of uint16 tokens needs "
        "data.format = \"nanogpt\")",
        kLlmcMagic, kLlmcLlama3Magic, map_bytes_, shown));
  }
  if (declared > map_bytes_)  // keeps the sum below from overflowing
    fail(fmt::format("{} header declares {} tokens, more than a file of {} bytes can hold", format_,
                     declared, map_bytes_));
  if (documents > map_bytes_)
    fail(
        fmt::format("offset 40: header declares {} documents, more than a file of {} bytes can "
                    "hold",
                    documents, map_bytes_));
  const uint64_t expected = header + declared * width_ + documents * sizeof(uint64_t);
  if (map_bytes_ != expected)
    fail(fmt::format("{} file of {} tokens{} should be {} bytes, found {} ({})", format_, declared,
                     documents ? fmt::format(" and {} documents", documents) : "", expected,
                     map_bytes_, map_bytes_ < expected ? "truncated" : "trailing bytes"));
  if (declared < 2) fail(fmt::format("needs at least 2 tokens, found {}", declared));
  // The document index: where each document starts, strictly increasing, inside the tokens.
  const size_t index_at = header + declared * width_;
  // Read in place (it may be unaligned: after an odd number of 2-byte tokens).
  index_ = bytes + index_at;
  documents_ = int64_t(documents);
  for (int64_t d = 0, previous = -1; d < documents_; d++) {
    const int64_t start = document_start(d);
    if (start < 0 || uint64_t(start) >= declared || start <= previous)
      fail(fmt::format(
          "offset {}: document {} starts at token {}, expected a start above {} and below the "
          "token count {}",
          index_at + d * 8, d, start, previous, declared));
    previous = start;
  }
  tokens_ = bytes + header;
  count_ = int64_t(declared);

  // One pass over the tokens: training on ids outside the vocabulary would read past the
  // embedding table.
  for (int64_t i = 0; i < count_; i++) {
    uint32_t t = width_ == 2 ? reinterpret_cast<const uint16_t*>(tokens_)[i]
                             : reinterpret_cast<const uint32_t*>(tokens_)[i];
    if (t >= uint32_t(vocab_size))
      fail(
          fmt::format("offset {}: token {} at index {} is outside the vocabulary (vocab_size = {})",
                      header + i * width_, t, i, vocab_size));
  }
}

TokenShard::TokenShard(TokenShard&& o) noexcept
    : path_(std::move(o.path_)),
      format_(o.format_),
      map_(o.map_),
      map_bytes_(o.map_bytes_),
      tokens_(o.tokens_),
      width_(o.width_),
      count_(o.count_),
      tokenizer_hash_(o.tokenizer_hash_),
      index_(o.index_),
      documents_(o.documents_) {
  o.map_ = nullptr;
}

TokenShard::~TokenShard() {
  if (map_) munmap(map_, map_bytes_);
}

int64_t TokenShard::document_start(int64_t i) const {
  uint64_t start;
  std::memcpy(&start, index_ + 8 * i, 8);
  return int64_t(start);
}

void TokenShard::read(int64_t start, int64_t n, int32_t* out) const {
  if (width_ == 2) {
    const auto* t = reinterpret_cast<const uint16_t*>(tokens_) + start;
    for (int64_t i = 0; i < n; i++) out[i] = t[i];
  } else {
    const auto* t = reinterpret_cast<const uint32_t*>(tokens_) + start;
    for (int64_t i = 0; i < n; i++) out[i] = int32_t(t[i]);
  }
}

void write_token_shard(const std::string& path, const std::vector<int32_t>& tokens, int vocab_size,
                       uint64_t tokenizer_hash) {
  Header h{};
  std::memcpy(h.magic, kMagic, 8);
  h.version = 2;
  h.tokenizer_hash = tokenizer_hash;
  h.token_bytes = vocab_size <= 65536 ? 2 : 4;
  h.count = tokens.size();
  h.vocab_size = uint32_t(vocab_size);
  // The whole shard in memory, then one atomic write: prepare's inputs are text files.
  std::string bytes(sizeof h + tokens.size() * h.token_bytes, '\0');
  std::memcpy(bytes.data(), &h, sizeof h);
  char* out = bytes.data() + sizeof h;
  for (size_t i = 0; i < tokens.size(); i++) {
    if (h.token_bytes == 2) {
      const uint16_t t = uint16_t(tokens[i]);
      std::memcpy(out + 2 * i, &t, 2);
    } else {
      std::memcpy(out + 4 * i, &tokens[i], 4);
    }
  }
  write_file_atomic(path, bytes);
}

}  // namespace trainer
