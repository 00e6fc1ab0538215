#include "trainer/prepare.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>
#include <tuple>

#include "io/atomic_file.h"
#include "io/errors.h"
#include "io/input_files.h"
#include "io/shard_writer.h"
#include "io/tokenizer.h"
#include "trainer/tokenize_pipeline.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;

// Whether document `d` goes to validation: a hash of its number below the fraction, so that
// the choice depends on nothing else (not on threads, shards or the other documents).
bool to_validation(int64_t d, double fraction) {
  uint64_t z = uint64_t(d) + 0x9e3779b97f4a7c15ull;  // splitmix64
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return double(z >> 11) * 0x1.0p-53 < fraction;
}

// Sends each document's tokens to train or val as they come. Until kMinSplitDocuments documents
// have been seen, they are held in an anonymous file beside the output (not in memory: the first
// documents may be whole books), to be split by whole documents once there are enough, or each
// by its last part if the corpus ends first.
class Splitter {
 public:
  Splitter(const PrepareOptions& opts, const std::vector<InputFile>& files,
           std::optional<int32_t> end_of_text, ShardSetWriter& train, ShardSetWriter& val)
      : opts_(opts), files_(files), eot_(end_of_text), train_(train), val_(val) {}
  ~Splitter() {
    if (held_file_) std::fclose(held_file_);
  }
  Splitter(const Splitter&) = delete;
  Splitter& operator=(const Splitter&) = delete;

  void add(const DocumentPiece& p, const int32_t* t, size_t n) {
    if (p.first) documents_++;
    if (holding_) {
      if (p.first) held_.push_back({p.file, p.line, held_tokens_, 0});
      hold(t, n);
      if (p.last && eot_) hold(&*eot_, 1);
      if (p.last && documents_ >= kMinSplitDocuments) release_whole(p.document);
      return;
    }
    ShardSetWriter& out = to_validation(p.document, opts_.val_fraction) ? val_ : train_;
    if (p.first) out.begin_document();
    out.append(t, n);
    if (p.last && eot_) out.append(&*eot_, 1);
  }

  // At the end: documents still held are too few for a split by whole documents.
  void finish() {
    if (!holding_) return;
    if (!held_.empty())
      fmt::print("{} documents, fewer than {}: the last {:g}% of each goes to validation\n",
                 held_.size(), kMinSplitDocuments, opts_.val_fraction * 100);
    for (const Held& h : held_) {
      // The document's own tokens (its end-of-text token aside), split; both parts end with
      // the end-of-text token, so that no two documents run together in either set.
      const int64_t n = h.count - (eot_ ? 1 : 0);
      const int64_t split = n - int64_t(double(n) * opts_.val_fraction);
      for (auto [begin, count, out] :
           {std::tuple(h.begin, split, &train_), std::tuple(h.begin + split, n - split, &val_)}) {
        if (count <= 0) continue;
        out->begin_document();
        copy_held(begin, count, *out);
        if (eot_) out->append(&*eot_, 1);
      }
      const std::string name =
          h.line ? fmt::format("{}:{}", files_[h.file].path, h.line) : files_[h.file].path;
      fmt::print("{}: {} tokens ({} train, {} val)\n", name, n, split, n - split);
    }
    held_.clear();
  }

  int64_t documents() const { return documents_; }

 private:
  struct Held {
    int32_t file;
    int64_t line;
    int64_t begin, count;  // tokens in held_file_
  };

  void hold(const int32_t* t, size_t n) {
    if (!held_file_) held_file_ = open_anonymous_file(opts_.out_dir);
    if (std::fwrite(t, sizeof *t, n, held_file_) != n)
      throw DataError(fmt::format("{}: cannot write a temporary file", opts_.out_dir));
    held_.back().count += int64_t(n);
    held_tokens_ += int64_t(n);
  }

  void copy_held(int64_t begin, int64_t n, ShardSetWriter& out) {
    std::vector<int32_t> buf(std::min<int64_t>(n, 1 << 20));
    if (std::fflush(held_file_) != 0 ||
        std::fseek(held_file_, long(begin * int64_t(sizeof(int32_t))), SEEK_SET) != 0)
      throw DataError(fmt::format("{}: cannot read a temporary file", opts_.out_dir));
    while (n > 0) {
      const size_t k = size_t(std::min<int64_t>(n, int64_t(buf.size())));
      if (std::fread(buf.data(), sizeof(int32_t), k, held_file_) != k)
        throw DataError(fmt::format("{}: cannot read a temporary file", opts_.out_dir));
      out.append(buf.data(), k);
      n -= int64_t(k);
    }
  }

  // Enough documents seen: the held ones (numbered up to `last`) go whole to train or val, and
  // so does every document from now on.
  void release_whole(int64_t last) {
    holding_ = false;
    for (size_t i = 0; i < held_.size(); i++) {
      const int64_t d = last - int64_t(held_.size() - 1 - i);
      ShardSetWriter& out = to_validation(d, opts_.val_fraction) ? val_ : train_;
      out.begin_document();
      copy_held(held_[i].begin, held_[i].count, out);
    }
    held_.clear();
    std::fclose(held_file_);
    held_file_ = nullptr;
  }

  const PrepareOptions& opts_;
  const std::vector<InputFile>& files_;
  std::optional<int32_t> eot_;
  ShardSetWriter &train_, &val_;
  bool holding_ = true;
  std::vector<Held> held_;
  FILE* held_file_ = nullptr;
  int64_t held_tokens_ = 0, documents_ = 0;
};

// About once a second on stderr: what has been read and made, and when it will be done.
class Progress {
 public:
  explicit Progress(int64_t total_bytes) : total_(total_bytes) {}
  void update(int64_t bytes, int64_t documents, int64_t tokens) {
    const auto now = std::chrono::steady_clock::now();
    if (now - last_ < std::chrono::seconds(1)) return;
    last_ = now;
    const double s = seconds();
    const double rate = double(bytes) / s;
    std::string eta;
    if (total_ > 0 && rate > 0)
      eta = fmt::format(", ETA {:.0f} s", double(std::max<int64_t>(total_ - bytes, 0)) / rate);
    fmt::print(stderr,
               "prepare: {:.1f} of {:.1f} MB read, {:.1f} MB/s, {} documents, {} tokens{}\n",
               double(bytes) / 1e6, double(total_) / 1e6, rate / 1e6, documents, tokens, eta);
    std::fflush(stderr);
  }
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  int64_t total_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_ = start_;
};

// This process's peak resident memory (VmHWM) in MB; 0 where /proc does not say.
double peak_memory_mb() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::strtod(line.c_str() + 6, nullptr) / 1024;
  return 0;
}

}  // namespace

int prepare(const PrepareOptions& opts) {
  // Every input is found before anything is written.
  const std::vector<InputFile> files = expand_input_files(opts.inputs);
  int64_t total_bytes = 0;
  for (const InputFile& f : files) total_bytes += f.bytes;
  const auto tokenizer =
      load_tokenizer(opts.tokenizer.kind, opts.tokenizer.path, {opts.tokenizer.pattern});
  const int threads =
      opts.threads > 0 ? opts.threads : std::max(1, int(std::thread::hardware_concurrency()));

  const bool made_dir = !fs::exists(opts.out_dir);
  fs::create_directories(opts.out_dir);
  ShardSetWriter::remove_stale_temporaries(opts.out_dir);
  std::vector<std::pair<std::string, int64_t>> train_shards, val_shards;
  int64_t documents = 0, text_bytes = 0;
  Progress progress(total_bytes);
  try {
    ShardSetWriter train(opts.out_dir, "train", opts.shard_tokens, tokenizer->vocab_size(),
                         tokenizer->identity_hash(), opts.compress);
    ShardSetWriter val(opts.out_dir, "val", opts.shard_tokens, tokenizer->vocab_size(),
                       tokenizer->identity_hash(), opts.compress);
    Splitter splitter(opts, files, end_of_text_token(*tokenizer), train, val);
    DocumentReader reader(files, {opts.format, opts.field, size_t(kChunkBytes)});
    run_tokenize_pipeline(reader, *tokenizer, threads, [&](const TokenizedChunk& c) {
      for (size_t i = 0; i < c.pieces.size(); i++) {
        splitter.add(c.pieces[i], c.tokens.data() + c.token_begin[i],
                     c.token_begin[i + 1] - c.token_begin[i]);
        text_bytes += int64_t(c.pieces[i].size);
      }
      progress.update(reader.file_bytes_read(), splitter.documents(),
                      train.tokens() + val.tokens());
    });
    splitter.finish();
    documents = splitter.documents();
    if (documents == 0)
      throw DataError(fmt::format(
          "{}{}: no documents in the input", files.front().path,
          files.size() > 1 ? fmt::format(" (and {} more files)", files.size() - 1) : ""));
    if (train.tokens() == 0)
      throw DataError(fmt::format("{}: no tokens left for training (--val-fraction {:g})",
                                  opts.out_dir, opts.val_fraction));
    train_shards = train.commit();
    val_shards = val.commit();
  } catch (...) {
    // Nothing written: the temporaries are gone (~ShardSetWriter); so is a directory made here.
    std::error_code ec;
    if (made_dir) fs::remove(opts.out_dir, ec);
    throw;
  }

  fmt::print("tokenizer: {}, {} tokens, identity hash {:016x}\n", tokenizer_name(opts.tokenizer),
             tokenizer->vocab_size(), tokenizer->identity_hash());
  int64_t train_tokens = 0, val_tokens = 0;
  for (const auto& [path, n] : train_shards) {
    fmt::print("wrote {} ({} tokens)\n", path, n);
    train_tokens += n;
  }
  for (const auto& [path, n] : val_shards) {
    fmt::print("wrote {} ({} tokens)\n", path, n);
    val_tokens += n;
  }
  const double s = progress.seconds();
  fmt::print(
      "prepared {} documents from {} files ({:.1f} MB of text) into {} tokens ({} train, {} val) "
      "in {:.1f} s: {:.1f} MB/s with {} threads, peak memory {:.0f} MB\n",
      documents, files.size(), double(text_bytes) / 1e6, train_tokens + val_tokens, train_tokens,
      val_tokens, s, double(text_bytes) / 1e6 / s, threads, peak_memory_mb());
  return 0;
}

}  // namespace trainer
