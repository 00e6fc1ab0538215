#include "io/shard_writer.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "io/atomic_file.h"
#include "io/compressed_shard.h"
#include "io/errors.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;

constexpr size_t kIndexBuffer = 1 << 16;  // entries held before they spill to a temporary file

// The header of io/token_shard.cpp, version 2.
struct Header {
  char magic[8] = {'T', 'R', 'T', 'O', 'K', 'E', 'N', 'S'};
  uint32_t version = 2;
  uint32_t token_bytes = 0;
  uint64_t count = 0;
  uint32_t vocab_size = 0;
  uint32_t reserved0 = 0;
  uint64_t tokenizer_hash = 0;
  uint64_t documents = 0;
  uint8_t reserved[16] = {};
};
static_assert(sizeof(Header) == 64);

void check(bool ok, const std::string& path) {
  if (!ok) throw DataError(fmt::format("{}: write failed: {}", path, strerror(errno)));
}

}  // namespace

ShardSetWriter::ShardSetWriter(std::string out_dir, std::string name, int64_t shard_tokens,
                               int vocab_size, uint64_t tokenizer_hash, bool compress)
    : out_dir_(std::move(out_dir)),
      name_(std::move(name)),
      shard_tokens_(shard_tokens),
      vocab_size_(vocab_size),
      tokenizer_hash_(tokenizer_hash),
      compress_(compress),
      width_(vocab_size <= 65536 ? 2 : 4) {}

ShardSetWriter::~ShardSetWriter() {
  if (file_) std::fclose(file_);
  if (index_spill_) std::fclose(index_spill_);
  if (!committed_) {
    if (!tmp_path_.empty()) ::unlink(tmp_path_.c_str());
    for (const auto& [tmp, n] : closed_) ::unlink(tmp.c_str());
  }
}

void ShardSetWriter::open_shard() {
  const std::string final_path =
      shard_tokens_ > 0 ? fmt::format("{}/{}_{:06d}.bin", out_dir_, name_, closed_.size())
                        : fmt::format("{}/{}.bin", out_dir_, name_);
  file_ = open_temporary_beside(final_path, tmp_path_);
  const Header blank{};  // rewritten when the shard closes and its counts are known
  check(std::fwrite(&blank, sizeof blank, 1, file_) == 1, tmp_path_);
  count_ = documents_ = 0;
  index_.clear();
}

void ShardSetWriter::write_index_entries() {
  if (index_.empty()) return;
  if (!index_spill_) {
    index_spill_ = open_anonymous_file(out_dir_);
  }
  check(std::fwrite(index_.data(), 8, index_.size(), index_spill_) == index_.size(), tmp_path_);
  index_.clear();
}

void ShardSetWriter::append(const int32_t* tokens, size_t n) {
  while (n > 0) {
    if (file_ && shard_tokens_ > 0 && count_ == shard_tokens_) close_shard();
    if (!file_) open_shard();
    if (document_pending_) {
      index_.push_back(uint64_t(count_));
      documents_++;
      document_pending_ = false;
      if (index_.size() >= kIndexBuffer) write_index_entries();
    }
    size_t k = n;
    if (shard_tokens_ > 0) k = std::min<size_t>(k, size_t(shard_tokens_ - count_));
    convert_.resize(k * width_);
    for (size_t i = 0; i < k; i++) {
      if (width_ == 2) {
        const uint16_t t = uint16_t(tokens[i]);
        std::memcpy(convert_.data() + 2 * i, &t, 2);
      } else {
        std::memcpy(convert_.data() + 4 * i, &tokens[i], 4);
      }
    }
    check(std::fwrite(convert_.data(), 1, convert_.size(), file_) == convert_.size(), tmp_path_);
    count_ += int64_t(k);
    total_tokens_ += int64_t(k);
    tokens += k;
    n -= k;
  }
}

void ShardSetWriter::close_shard() {
  // The index: what spilled, then what memory holds.
  if (index_spill_) {
    write_index_entries();
    std::rewind(index_spill_);
    std::vector<char> buf(1 << 20);
    while (size_t k = std::fread(buf.data(), 1, buf.size(), index_spill_))
      check(std::fwrite(buf.data(), 1, k, file_) == k, tmp_path_);
    std::fclose(index_spill_);
    index_spill_ = nullptr;
  } else {
    check(std::fwrite(index_.data(), 8, index_.size(), file_) == index_.size(), tmp_path_);
    index_.clear();
  }
  Header h;
  h.token_bytes = uint32_t(width_);
  h.count = uint64_t(count_);
  h.vocab_size = uint32_t(vocab_size_);
  h.tokenizer_hash = tokenizer_hash_;
  h.documents = uint64_t(documents_);
  bool ok = std::fseek(file_, 0, SEEK_SET) == 0 && std::fwrite(&h, sizeof h, 1, file_) == 1;
  ok = std::fflush(file_) == 0 && ok;
  ok = ::fsync(fileno(file_)) == 0 && ok;
  ok = std::fclose(file_) == 0 && ok;
  file_ = nullptr;
  check(ok, tmp_path_);
  closed_.emplace_back(tmp_path_, count_);
  tmp_path_.clear();
}

std::vector<std::pair<std::string, int64_t>> ShardSetWriter::commit() {
  if (file_) close_shard();
  std::vector<std::string> finals;
  for (const auto& [tmp, n] : closed_) {
    finals.push_back(tmp.substr(0, tmp.size() - std::strlen(".XXXXXX.tmp")));
    if (compress_) finals.back() += ".zst";
  }
  // Compressed: every shard into a temporary first (the slow part, where a full disk shows), so
  // that a failure publishes none of the new set beside an older one.
  if (compress_)
    for (auto& [tmp, n] : closed_) {
      const std::string packed = tmp.substr(0, tmp.size() - std::strlen(".tmp")) + ".zst.tmp";
      compress_shard(tmp, packed);
      ::unlink(tmp.c_str());
      tmp = packed;  // what the destructor removes if a later one fails
    }
  std::vector<std::pair<std::string, int64_t>> out;
  for (size_t i = 0; i < closed_.size(); i++) {
    const auto& [tmp, n] = closed_[i];
    const std::string& final_path = finals[i];
    if (std::rename(tmp.c_str(), final_path.c_str()) != 0)
      throw DataError(fmt::format("{}: cannot rename into place: {}", final_path, strerror(errno)));
    // The shard in the other form, from an earlier run, would be read beside this one by a glob.
    const std::string twin =
        compress_ ? final_path.substr(0, final_path.size() - 4) : final_path + ".zst";
    ::unlink(twin.c_str());
    out.emplace_back(final_path, n);
  }
  committed_ = true;
  fsync_path(out_dir_);
  // Numbered shards beyond this run's, from an earlier run: a glob over the set would take them.
  if (shard_tokens_ > 0)
    for (size_t i = closed_.size();; i++) {
      const std::string stale = fmt::format("{}/{}_{:06d}.bin", out_dir_, name_, i);
      const bool plain = ::unlink(stale.c_str()) == 0;
      if (!(::unlink((stale + ".zst").c_str()) == 0 || plain)) break;
    }
  return out;
}

void ShardSetWriter::remove_stale_temporaries(const std::string& out_dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(out_dir, ec)) {
    const std::string n = e.path().filename().string();
    const bool ours = (n.rfind("train", 0) == 0 || n.rfind("val", 0) == 0) &&
                      n.find(".bin.") != std::string::npos && n.size() > 4 &&
                      n.compare(n.size() - 4, 4, ".tmp") == 0;
    if (ours) fs::remove(e.path(), ec);
  }
}

}  // namespace trainer
