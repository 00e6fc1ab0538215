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
#include <filesystem>

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

// Megatron-LM's megatron/core/datasets/indexed_dataset.py: the .idx starts with this magic, u64
// version 1, u8 dtype code, u64 sequence count and u64 document index count.
constexpr char kMegatronMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
constexpr size_t kMegatronHeaderBytes = 9 + 8 + 1 + 8 + 8;
// Its DType codes 1-7 (8 is uint16).
constexpr const char* kMegatronTypes[7] = {"uint8", "int8",    "int16",  "int32",
                                           "int64", "float64", "float32"};

}  // namespace

const char* file_kind(unsigned mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return S_ISREG(mode) ? "a regular file" : "a special file";
}

namespace {

// Maps the whole of `path`, a non-empty regular file, read-only; `note` follows the error for a
// file that cannot be opened.
void* map_file(const std::string& path, size_t& bytes, const std::string& note = "") {
  // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just below).
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK);
  if (fd < 0)
    throw DataError(fmt::format("{}: cannot open data file: {}{}", path, strerror(errno), note));
  struct stat st {};
  fstat(fd, &st);
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw DataError(fmt::format("{}: not a regular file ({}): a data shard must be one", path,
                                file_kind(st.st_mode)));
  }
  bytes = size_t(st.st_size);
  if (bytes == 0) {
    ::close(fd);
    throw DataError(fmt::format("{}: data file is empty", path));
  }
  void* map = mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED)
    throw DataError(fmt::format("{}: cannot map data file: {}", path, strerror(errno)));
  return map;
}

// "4d 4d 49": the first bytes of a file whose magic is not the expected one.
std::string hex_bytes(const uint8_t* bytes, size_t n) {
  std::string shown;
  for (size_t i = 0; i < n; i++) shown += fmt::format("{}{:02x}", i ? " " : "", bytes[i]);
  return shown;
}

// The Megatron index that a data path names, or "" where it names none: `prefix.idx` itself;
// `prefix.bin` with `prefix.idx` beside it (the .bin has no header to say what it is); or a bare
// `prefix` that is no file while `prefix.idx` is.
std::string megatron_index(const std::string& path) {
  auto has_suffix = [&](const char* suffix) {
    return path.size() > 4 && path.compare(path.size() - 4, 4, suffix) == 0;
  };
  std::error_code ec;
  if (has_suffix(".idx")) return path;
  if (has_suffix(".bin")) {
    const std::string idx = path.substr(0, path.size() - 4) + ".idx";
    return std::filesystem::exists(idx, ec) ? idx : "";
  }
  if (!std::filesystem::exists(path, ec) && std::filesystem::exists(path + ".idx", ec))
    return path + ".idx";
  return "";
}

// Unmaps a mapping it was given when it goes.
struct Unmap {
  const void* map;
  size_t bytes;
  ~Unmap() { munmap(const_cast<void*>(map), bytes); }
};

}  // namespace

TokenShard::TokenShard(const std::string& path, int vocab_size, bool headerless) : path_(path) {
  try {
    const std::string idx = megatron_index(path);
    if (idx.empty())
      open(vocab_size, headerless);
    else
      open_megatron(idx, idx.substr(0, idx.size() - 4) + ".bin", vocab_size);
  } catch (...) {
    release();
    throw;
  }
}

void TokenShard::open(int vocab_size, bool headerless) {
  map_ = map_file(path_, map_bytes_);
  const auto* bytes = static_cast<const uint8_t*>(map_);
  auto fail = [&](const std::string& what) { throw DataError(fmt::format("{}: {}", path_, what)); };

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
    const std::string shown = hex_bytes(bytes, std::min<size_t>(map_bytes_, 8));
    fail(fmt::format(
        "offset 0: unrecognised data file: expected the magic \"TRTOKENS\" or llm.c's {} or {}, "
        "found {} bytes starting {} (a headerless nanoGPT file of uint16 tokens needs "
        "data.format = \"nanogpt\"; a Megatron .bin needs its .idx beside it)",
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

  check_vocabulary(path_, header, vocab_size);
}

void TokenShard::open_megatron(const std::string& idx, const std::string& bin, int vocab_size) {
  size_t idx_bytes = 0;
  const auto* b = static_cast<const uint8_t*>(map_file(idx, idx_bytes));
  const Unmap unmap{b, idx_bytes};  // the .idx is needed only here: its document starts are kept
  auto fail = [&](const std::string& what) { throw DataError(fmt::format("{}: {}", idx, what)); };
  auto u64 = [&](size_t at) {
    uint64_t v;
    std::memcpy(&v, b + at, 8);
    return v;
  };

  if (idx_bytes < sizeof kMegatronMagic || std::memcmp(b, kMegatronMagic, 9) != 0)
    fail(fmt::format(
        "offset 0: not a Megatron index: expected the magic \"MMIDIDX\\0\\0\", found {} bytes "
        "starting {}",
        idx_bytes, hex_bytes(b, std::min<size_t>(idx_bytes, 9))));
  if (idx_bytes < kMegatronHeaderBytes)
    fail(fmt::format("Megatron index header truncated: expected {} bytes, file has {}",
                     kMegatronHeaderBytes, idx_bytes));
  if (u64(9) != 1)
    fail(fmt::format("offset 9: expected Megatron index version 1, found {}", u64(9)));
  const int code = b[17];
  if (code == 8) {
    format_ = "Megatron uint16";
    width_ = 2;
  } else if (code == 4) {
    format_ = "Megatron int32";
    width_ = 4;
    signed_ = true;
  } else {
    fail(fmt::format("offset 17: dtype code {} ({}): only uint16 (8) and int32 (4) tokens are read",
                     code,
                     code >= 1 && code <= 7 ? kMegatronTypes[code - 1] : "not one of Megatron's"));
  }
  const uint64_t sequences = u64(18), indices = u64(26);
  if (sequences > idx_bytes)  // keeps the sums below from overflowing
    fail(fmt::format(
        "offset 18: header declares {} sequences, more than a file of {} bytes can hold", sequences,
        idx_bytes));
  if (indices > idx_bytes)
    fail(fmt::format(
        "offset 26: header declares {} document indices, more than a file of {} bytes can hold",
        indices, idx_bytes));
  const uint64_t expected = kMegatronHeaderBytes + sequences * (4 + 8) + indices * 8;
  if (idx_bytes != expected)
    fail(
        fmt::format("Megatron index of {} sequences and {} document indices should be {} bytes, "
                    "found {} ({})",
                    sequences, indices, expected, idx_bytes,
                    idx_bytes < expected ? "truncated" : "trailing bytes"));
  const size_t lengths_at = kMegatronHeaderBytes, pointers_at = lengths_at + 4 * sequences,
               indices_at = pointers_at + 8 * sequences;

  map_ = map_file(bin, map_bytes_, fmt::format(" (the tokens of the Megatron index {})", idx));
  // The lengths first, so that a .bin of another dataset is named as such, not by the first
  // pointer that disagrees. Their sum cannot wrap: that takes 2^33 lengths (a 100 GB .idx) of
  // 2^31 tokens.
  uint64_t total = 0;
  for (uint64_t k = 0; k < sequences; k++) {
    int32_t length;
    std::memcpy(&length, b + lengths_at + 4 * k, 4);
    if (length < 0)
      fail(fmt::format("offset {}: sequence {} has length {}, expected 0 or more",
                       lengths_at + 4 * k, k, length));
    total += uint64_t(length);
  }
  if (total != map_bytes_ / width_ || map_bytes_ % width_ != 0)
    fail(fmt::format("sequence lengths sum to {} tokens ({} bytes of {}), but {} has {} bytes",
                     total, total * width_, width_ == 2 ? "uint16" : "int32", bin, map_bytes_));
  // Megatron writes the sequences back to back from byte 0 (its _IndexWriter derives the pointers
  // from the lengths); a pointer elsewhere would read another sequence's tokens, or past the file.
  uint64_t at = 0;
  for (uint64_t k = 0; k < sequences; k++) {
    const uint64_t pointer = u64(pointers_at + 8 * k);
    if (pointer != at)
      fail(fmt::format(
          "offset {}: sequence {} points at byte {}{}, expected {} (sequences lie back to back "
          "from byte 0 of the .bin)",
          pointers_at + 8 * k, k, int64_t(pointer),
          pointer >= map_bytes_ ? fmt::format(", outside {}'s {} bytes", bin, map_bytes_) : "",
          at));
    int32_t length;
    std::memcpy(&length, b + lengths_at + 4 * k, 4);
    at += uint64_t(length) * width_;
  }
  // Document d is sequences [indices[d], indices[d + 1]): the first index 0, the last the
  // sequence count, none decreasing (equal ones are empty documents, which Megatron's
  // preprocess_data.py writes for an empty text).
  if (indices == 0)
    fail("offset 26: header declares no document indices, expected at least one (the first is 0)");
  for (uint64_t d = 0, previous = 0; d < indices; d++) {
    const uint64_t i = u64(indices_at + 8 * d);
    const bool last = d + 1 == indices;
    if ((d == 0 && i != 0) || (last && i != sequences) || i < previous || i > sequences)
      fail(fmt::format("offset {}: document index {} of {} is {}, expected {}", indices_at + 8 * d,
                       d, indices, int64_t(i),
                       last     ? fmt::format("the sequence count {}", sequences)
                       : d == 0 ? std::string("0")
                                : fmt::format("{} to {}", previous, sequences)));
    previous = i;
    // Our index holds where non-empty documents start: strictly increasing, below the count.
    const int64_t start = i < sequences ? int64_t(u64(pointers_at + 8 * i) / width_) : total;
    if (!last && start < int64_t(total) && (starts_.empty() || start > starts_.back()))
      starts_.push_back(start);
  }
  documents_ = int64_t(starts_.size());
  if (total < 2) throw DataError(fmt::format("{}: needs at least 2 tokens, found {}", bin, total));
  tokens_ = static_cast<const uint8_t*>(map_);
  count_ = int64_t(total);
  check_vocabulary(bin, 0, vocab_size);
}

// One pass over the tokens: training on ids outside the vocabulary would read past the embedding
// table. `file` holds them from byte `header` on.
void TokenShard::check_vocabulary(const std::string& file, size_t header, int vocab_size) const {
  for (int64_t i = 0; i < count_; i++) {
    const uint32_t t = width_ == 2 ? reinterpret_cast<const uint16_t*>(tokens_)[i]
                                   : reinterpret_cast<const uint32_t*>(tokens_)[i];
    if (t >= uint32_t(vocab_size))
      throw DataError(fmt::format(
          "{}: offset {}: token {} at index {} is outside the vocabulary (vocab_size = {})", file,
          header + i * width_, signed_ ? int64_t(int32_t(t)) : int64_t(t), i, vocab_size));
  }
}

void TokenShard::release() {
  if (map_) munmap(map_, map_bytes_);
  map_ = nullptr;
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
      signed_(o.signed_),
      index_(o.index_),
      starts_(std::move(o.starts_)),
      documents_(o.documents_) {
  o.map_ = nullptr;
}

TokenShard::~TokenShard() {
  release();
}

int64_t TokenShard::document_start(int64_t i) const {
  if (!index_) return starts_[size_t(i)];
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
