// `trainer prepare` through the binary: inputs as files, directories, globs, JSON Lines, gzip and
// zstd give the same tokens; --threads does not change the output; shards split the single
// output exactly and carry a document index that matches the end-of-text tokens; whole documents
// go to validation; bad input is one line, exit code 2 and nothing written; a run killed with
// SIGKILL leaves no shard that looks valid; and a 200 MB corpus is prepared in bounded memory.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "io/token_shard.h"
#include "io/tokenizer.h"
#include "test_util.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;

constexpr int32_t kEndOfText = 50256;  // GPT-2's <|endoftext|>, from the gpt2 pattern

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<int32_t> tokens_of(const TokenShard& s) {
  std::vector<int32_t> t(size_t(s.size()));
  s.read(0, s.size(), t.data());
  return t;
}

// The peak memory prepare reports in its summary: its own VmHWM, which a parent cannot read
// after the exit, and which wait4's ru_maxrss would mix with the forking test process's.
double peak_memory_mb(const std::string& output) {
  const size_t at = output.find("peak memory ");
  return at == std::string::npos ? -1 : std::stod(output.substr(at + 12));
}

class Prepare : public test::TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    // A BPE tokenizer with an end-of-text token: the 256 bytes, a few merges, GPT-2's pattern.
    test::write_rank_file(path("ranks.tiktoken"), test::kEnglishMerges);
    text_ = read_file(test::source_dir() + "/tests/data/pride_and_prejudice_opening.txt");
  }
  std::string bpe() {
    return " --tokenizer tiktoken --tokenizer-path " + path("ranks.tiktoken") + " --pattern gpt2";
  }
  test::CommandResult prepare(const std::string& args) {
    return test::run_command(test::trainer_bin() + " prepare " + args);
  }
  // Document i: a slice of the text, of varied length, numbered so that no two are alike.
  std::string document(int i) const {
    const size_t len = 200 + size_t(i * 7919) % 3000;
    return fmt::format("Document {}. ", i) + text_.substr(size_t(i * 104729) % 50000, len);
  }
  // n documents as files doc_000.txt, ... in dir.
  void write_text_dir(const std::string& dir, int n) {
    fs::create_directories(path(dir));
    for (int i = 0; i < n; i++)
      std::ofstream(path(fmt::format("{}/doc_{:03d}.txt", dir, i)), std::ios::binary)
          << document(i);
  }
  void write_jsonl(const std::string& name, int n, const std::string& field) {
    std::ofstream out(path(name), std::ios::binary);
    for (int i = 0; i < n; i++)
      out << nlohmann::json{{"id", i}, {field, document(i)}}.dump() << "\n";
  }
  std::string text_;
};

TEST_F(Prepare, SameTokensWhateverTheThreadsAndTheInputForm) {
  write_text_dir("docs", 150);
  write_jsonl("docs.jsonl", 150, "content");
  ASSERT_EQ(std::system(("gzip -k " + path("docs.jsonl") + " && zstd -q -k " + path("docs.jsonl") +
                         " && mkdir " + path("z") + " && mv " + path("docs.jsonl.gz") + " " +
                         path("docs.jsonl.zst") + " " + path("z"))
                            .c_str()),
            0);
  struct Form {
    std::string name, args;
  };
  const std::vector<Form> forms = {
      {"dir_t1", path("docs") + " --threads 1"},
      {"dir_t2", path("docs") + " --threads 2"},
      {"glob_t3", path("docs") + "/doc_*.txt --threads 3"},
      {"jsonl", path("docs.jsonl") + " --field content --threads 2"},
      {"gz", path("z/docs.jsonl.gz") + " --field content"},
      {"zst", path("z/docs.jsonl.zst") + " --field content --threads 1"},
  };
  for (const Form& f : forms) {
    const auto r = prepare("--input " + f.args + " --out-dir " + path(f.name) + bpe());
    ASSERT_EQ(r.code, 0) << f.name << ": " << r.output;
    EXPECT_NE(r.output.find("prepared 150 documents"), std::string::npos) << r.output;
  }
  for (const char* set : {"train.bin", "val.bin"}) {
    const std::string want = read_file(path(std::string("dir_t1/") + set));
    ASSERT_GT(want.size(), 64u);
    for (const Form& f : forms)
      EXPECT_TRUE(read_file(path(f.name + "/" + set)) == want)
          << f.name << "/" << set << " differs";
  }
}

// A directory is every regular file below it in sorted path order (special files skipped).
TEST_F(Prepare, DirectoriesAreReadRecursivelyInSortedOrder) {
  fs::create_directories(path("tree/a/y"));
  std::ofstream(path("tree/b.txt")) << document(1);
  std::ofstream(path("tree/a/z.txt")) << document(2);
  std::ofstream(path("tree/a/y/x.txt")) << document(3);
  ASSERT_EQ(mkfifo(path("tree/a/fifo").c_str(), 0600), 0);
  auto r = prepare("--input " + path("tree") + " --out-dir " + path("dir"));
  ASSERT_EQ(r.code, 0) << r.output;
  r = prepare("--input " + path("tree/a/y/x.txt") + " " + path("tree/a/z.txt") + " " +
              path("tree/b.txt") + " --out-dir " + path("files"));
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* set : {"/train.bin", "/val.bin"})
    EXPECT_TRUE(read_file(path("dir") + set) == read_file(path("files") + set)) << set;
}

// Whole documents go to train or val; each document's tokens are its text's tokens and the
// end-of-text token, and the index says where each starts. A document larger than a chunk
// (1 MB) is tokenized in pieces that give the tokens of the whole.
TEST_F(Prepare, DocumentIndexAndWholeDocumentSplit) {
  const int n = 200;
  std::ofstream out(path("docs.jsonl"), std::ios::binary);
  std::vector<std::string> docs;
  for (int i = 0; i < n; i++) {
    std::string d = document(i);
    if (i == 7) {
      while (d.size() < 3'500'000) d += text_;  // spans four chunks
    }
    out << nlohmann::json{{"text", d}}.dump() << "\n";
    docs.push_back(d);
  }
  out.close();
  const auto r = prepare("--input " + path("docs.jsonl") + " --out-dir " + path("d") + bpe());
  ASSERT_EQ(r.code, 0) << r.output;
  const auto tok = load_tokenizer("tiktoken", path("ranks.tiktoken"), {"gpt2"});
  TokenShard train(path("d/train.bin"), 50257), val(path("d/val.bin"), 50257);
  EXPECT_EQ(train.documents() + val.documents(), n);
  EXPECT_GE(val.documents(), 8);  // about 10% of 200, by a hash of the document number
  EXPECT_LE(val.documents(), 40);
  // Walk the documents in order: each lands whole in one set.
  const std::vector<int32_t> t = tokens_of(train), v = tokens_of(val);
  int64_t ti = 0, vi = 0;
  for (int i = 0; i < n; i++) {
    std::vector<int32_t> want = tok->encode_ordinary(docs[i]);
    want.push_back(kEndOfText);
    const bool in_train =
        ti < train.documents() && train.document_start(ti) + int64_t(want.size()) <= train.size() &&
        std::equal(want.begin(), want.end(), t.begin() + train.document_start(ti));
    const TokenShard& s = in_train ? train : val;
    const std::vector<int32_t>& all = in_train ? t : v;
    int64_t& di = in_train ? ti : vi;
    ASSERT_LT(di, s.documents()) << "document " << i;
    const int64_t start = s.document_start(di);
    const int64_t end = di + 1 < s.documents() ? s.document_start(di + 1) : s.size();
    ASSERT_EQ(end - start, int64_t(want.size())) << "document " << i;
    EXPECT_TRUE(std::equal(want.begin(), want.end(), all.begin() + start)) << "document " << i;
    di++;
  }
  EXPECT_EQ(ti, train.documents());
  EXPECT_EQ(vi, val.documents());
}

// --shard-tokens: shards of at most N tokens whose concatenation is the single shard, their
// indexes together the single index.
TEST_F(Prepare, ShardsConcatenateToTheSingleOutput) {
  write_jsonl("docs.jsonl", 120, "text");
  auto r = prepare("--input " + path("docs.jsonl") + " --out-dir " + path("one") + bpe());
  ASSERT_EQ(r.code, 0) << r.output;
  r = prepare("--input " + path("docs.jsonl") + " --out-dir " + path("many") + bpe() +
              " --shard-tokens 5000");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_FALSE(fs::exists(path("many/train.bin")));
  for (const std::string set : {"train", "val"}) {
    TokenShard whole(path("one/" + set + ".bin"), 50257);
    std::vector<int32_t> tokens;
    std::vector<int64_t> starts;
    int shards = 0;
    for (;; shards++) {
      const std::string p = path(fmt::format("many/{}_{:06d}.bin", set, shards));
      if (!fs::exists(p)) break;
      EXPECT_NE(r.output.find("wrote " + p + " ("), std::string::npos) << r.output;
      TokenShard s(p, 50257);
      EXPECT_LE(s.size(), 5000);
      for (int64_t d = 0; d < s.documents(); d++)
        starts.push_back(int64_t(tokens.size()) + s.document_start(d));
      const auto t = tokens_of(s);
      tokens.insert(tokens.end(), t.begin(), t.end());
    }
    EXPECT_GE(shards, set == "train" ? 20 : 2);
    EXPECT_TRUE(tokens == tokens_of(whole)) << set;
    std::vector<int64_t> whole_starts;
    for (int64_t d = 0; d < whole.documents(); d++) whole_starts.push_back(whole.document_start(d));
    EXPECT_EQ(starts, whole_starts) << set;
    // Every document but the first follows an end-of-text token, and there are no others.
    ASSERT_FALSE(starts.empty());
    EXPECT_EQ(starts[0], 0);
    for (size_t d = 1; d < starts.size(); d++) EXPECT_EQ(tokens[size_t(starts[d] - 1)], kEndOfText);
    EXPECT_EQ(std::count(tokens.begin(), tokens.end(), kEndOfText), int64_t(starts.size()));
  }
}

// Fewer than 100 documents: the last part of each goes to validation, as prepare always did.
TEST_F(Prepare, SmallCorporaSplitEachDocument) {
  write_text_dir("docs", 3);
  const auto r =
      prepare("--input " + path("docs") + " --out-dir " + path("d") + " --val-fraction 0.2");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("3 documents, fewer than 100: the last 20% of each goes to validation"),
            std::string::npos)
      << r.output;
  TokenShard train(path("d/train.bin"), 256), val(path("d/val.bin"), 256);
  EXPECT_EQ(train.documents(), 3);
  EXPECT_EQ(val.documents(), 3);
  const std::string d0 = document(0);
  const size_t split = d0.size() - size_t(double(d0.size()) * 0.2);
  EXPECT_EQ(train.document_start(1), int64_t(split));
  EXPECT_EQ(val.document_start(1), int64_t(d0.size() - split));
}

// More documents than the writer holds in memory (65536): the index spills to a temporary file
// and comes back whole and in order.
TEST_F(Prepare, LargeDocumentIndexSpillsAndReturns) {
  {
    std::ofstream out(path("many.jsonl"), std::ios::binary);
    for (int i = 0; i < 80000; i++) out << "{\"text\": \"document " << i << "\"}\n";
  }
  const auto r =
      prepare("--input " + path("many.jsonl") + " --out-dir " + path("d") + " --val-fraction 0.01");
  ASSERT_EQ(r.code, 0) << r.output;
  TokenShard train(path("d/train.bin"), 256), val(path("d/val.bin"), 256);
  ASSERT_GT(train.documents(), 70000);
  EXPECT_EQ(train.documents() + val.documents(), 80000);
  // Each document is "document N" (no end-of-text token with bytes): its start is where its
  // text starts.
  const auto t = tokens_of(train);
  for (int64_t d = 0; d < train.documents(); d += 997) {
    const int64_t start = train.document_start(d);
    ASSERT_EQ(std::string(t.begin() + start, t.begin() + start + 9), "document ") << d;
  }
}

// A plain-text document of several chunks, plain and gzip-compressed: its pieces tokenize as the
// whole text does (fewer than 100 documents: its last 10% goes to validation, and both parts
// end with the end-of-text token).
TEST_F(Prepare, LargePlainTextDocumentTokenizesAsAWhole) {
  std::string text;
  for (int i = 0; text.size() < 3'000'000; i++) text += fmt::format("Part {}.\n", i) + text_;
  std::ofstream(path("book.txt"), std::ios::binary) << text;
  ASSERT_EQ(std::system(("gzip -k " + path("book.txt")).c_str()), 0);
  std::vector<int32_t> want =
      load_tokenizer("tiktoken", path("ranks.tiktoken"), {"gpt2"})->encode_ordinary(text);
  const size_t split = want.size() - size_t(double(want.size()) * 0.1);
  const int64_t val_tokens = int64_t(want.size() - split) + 1;
  want.insert(want.begin() + split, kEndOfText);
  want.push_back(kEndOfText);
  for (const char* in : {"book.txt", "book.txt.gz"}) {
    const auto r = prepare("--input " + path(in) + " --out-dir " + path("d") + bpe());
    ASSERT_EQ(r.code, 0) << r.output;
    TokenShard train(path("d/train.bin"), 50257), val(path("d/val.bin"), 50257);
    std::vector<int32_t> got = tokens_of(train);
    const auto v = tokens_of(val);
    got.insert(got.end(), v.begin(), v.end());
    EXPECT_EQ(got.size(), want.size()) << in;
    EXPECT_TRUE(got == want) << in;
    EXPECT_EQ(val.size(), val_tokens) << in;
  }
}

// Version-1 shards and version-2 shards without an index read as before, with no documents.
TEST_F(Prepare, ShardsWithoutAnIndexStillRead) {
  std::vector<int32_t> tokens(100);
  for (int i = 0; i < 100; i++) tokens[size_t(i)] = i;
  write_token_shard(path("v2.bin"), tokens, 256, 0x1234);
  {
    TokenShard s(path("v2.bin"), 256);
    EXPECT_EQ(s.size(), 100);
    EXPECT_EQ(s.documents(), 0);
    EXPECT_EQ(s.tokenizer_hash(), 0x1234u);
  }
  // Version 1: offsets 32 and 40 were padding, whatever they hold.
  std::fstream f(path("v2.bin"), std::ios::in | std::ios::out | std::ios::binary);
  const uint32_t one = 1;
  const uint64_t junk = 77;
  f.seekp(8);
  f.write(reinterpret_cast<const char*>(&one), 4);
  f.seekp(40);
  f.write(reinterpret_cast<const char*>(&junk), 8);
  f.close();
  TokenShard s(path("v2.bin"), 256);
  EXPECT_EQ(s.size(), 100);
  EXPECT_EQ(s.documents(), 0);
  EXPECT_EQ(s.tokenizer_hash(), 0u);
}

// The index is validated when a shard is opened.
TEST_F(Prepare, DamagedIndexIsRefused) {
  write_jsonl("docs.jsonl", 120, "text");
  ASSERT_EQ(prepare("--input " + path("docs.jsonl") + " --out-dir " + path("d")).code, 0);
  const std::string p = path("d/train.bin");
  const int64_t n = TokenShard(p, 256).documents();
  ASSERT_GT(n, 2);
  {
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-8, std::ios::end);  // the last start, set to the first's
    const uint64_t zero = 0;
    f.write(reinterpret_cast<const char*>(&zero), 8);
  }
  try {
    TokenShard s(p, 256);
    FAIL() << "a decreasing document index was accepted";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find(fmt::format("document {} starts at token 0", n - 1)),
              std::string::npos)
        << e.what();
  }
  fs::resize_file(p, fs::file_size(p) - 4);
  try {
    TokenShard s(p, 256);
    FAIL() << "a truncated index was accepted";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("documents should be"), std::string::npos) << e.what();
  }
}

// Bad input: one line naming the file (and line or offset), exit code 2, nothing written.
TEST_F(Prepare, BadInputIsOneLineAndNothingWritten) {
  write_jsonl("good.jsonl", 5, "text");
  std::ofstream(path("bad.jsonl")) << "{\"text\": \"one\"}\n{\"text\": \"two\"}\n{\"text\": tw\n";
  std::ofstream(path("nofield.jsonl")) << "{\"text\": \"one\"}\n\n{\"body\": \"two\"}\n";
  std::ofstream(path("blank.jsonl")) << "\n\n  \n";
  write_jsonl("big.jsonl", 400, "text");
  ASSERT_EQ(
      std::system(("gzip -k " + path("big.jsonl") + " && zstd -q -k " + path("big.jsonl")).c_str()),
      0);
  for (const char* z : {"big.jsonl.gz", "big.jsonl.zst"}) {
    std::string bytes = read_file(path(z));
    bytes.resize(bytes.size() * 2 / 3);
    std::ofstream(path(std::string("cut_") + z), std::ios::binary) << bytes;
    bytes = read_file(path(z));
    for (size_t i = bytes.size() / 3; i < bytes.size() / 3 + 64; i++) bytes[i] = char(~bytes[i]);
    std::ofstream(path(std::string("bad_") + z), std::ios::binary) << bytes;
  }
  struct Case {
    std::string input, message;
  };
  const std::vector<Case> cases = {
      {path("nothing_*.txt"), path("nothing_*.txt") + ": no input file matches this pattern"},
      {path("absent.txt"), path("absent.txt") + ": cannot open input text file"},
      {path("bad.jsonl"), path("bad.jsonl") + ":3: not valid JSON (at byte 11 of the line)"},
      {path("nofield.jsonl"),
       path("nofield.jsonl") + ":3: expected an object with a string field \"text\""},
      {path("blank.jsonl"), path("blank.jsonl") + ": no documents in the input"},
      {path("cut_big.jsonl.gz"), path("cut_big.jsonl.gz") + ": offset "},
      {path("cut_big.jsonl.zst"), path("cut_big.jsonl.zst") + ": offset "},
      // Damaged in the middle: the decoder's check, or what it decoded, is refused.
      {path("bad_big.jsonl.gz"), path("bad_big.jsonl.gz") + ":"},
      {path("bad_big.jsonl.zst"), path("bad_big.jsonl.zst") + ":"},
  };
  for (const Case& c : cases) {
    // After a good file (so that something was on its way to be written), but the empty corpus
    // alone.
    const std::string good = c.input == path("blank.jsonl") ? "" : path("good.jsonl") + " ";
    const auto r = prepare("--input " + good + c.input + " --out-dir " + path("out"));
    EXPECT_EQ(r.code, 2) << c.input << ": " << r.output;
    EXPECT_EQ(r.output.rfind("trainer: data error: " + c.message, 0), 0u) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
    EXPECT_FALSE(fs::exists(path("out"))) << c.input << ": something was written";
  }
  // A truncated stream says so.
  for (const char* z : {"gz", "zst"}) {
    const auto r =
        prepare("--input " + path(std::string("cut_big.jsonl.") + z) + " --out-dir " + path("out"));
    EXPECT_NE(r.output.find("truncated"), std::string::npos) << r.output;
  }
}

// SIGKILL in the middle of a run: no file under a shard's name, the shard being written is not
// readable as one, and the next run removes the leftovers and writes what a clean run writes.
TEST_F(Prepare, KilledRunLeavesNoShardThatLooksValid) {
  {
    std::ofstream out(path("big.jsonl"), std::ios::binary);
    for (int i = 0; i < 2000; i++)  // 40 MB
      out << nlohmann::json{{"text", fmt::format("Copy {}. ", i) + text_.substr(i % 1000, 20000)}}
                 .dump()
          << "\n";
  }
  const std::string args = "--input " + path("big.jsonl") + " --out-dir " + path("d") + bpe() +
                           " --threads 1 --shard-tokens 1000000";
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const std::string cmd = "exec " + test::trainer_bin() + " prepare " + args + " >/dev/null 2>&1";
    execl("/bin/sh", "sh", "-c", cmd.c_str(), nullptr);
    _exit(127);
  }
  // Wait until the first shard is done and the second is being written.
  bool started = false;
  for (int i = 0; i < 3000 && !started; i++) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    int tmps = 0;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(path("d"), ec))
      tmps += e.path().extension() == ".tmp";
    started = tmps >= 2;
  }
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(started) << "the run made no shards to interrupt";
  ASSERT_TRUE(WIFSIGNALED(status)) << "the run ended before it was killed";
  int leftovers = 0, refused = 0;
  for (const auto& e : fs::directory_iterator(path("d"))) {
    EXPECT_EQ(e.path().extension(), ".tmp") << e.path() << " looks like a finished shard";
    leftovers++;
    try {
      TokenShard(e.path().string(), 50257);
    } catch (const DataError&) {
      refused++;  // a shard being written: its header is written last
    }
  }
  EXPECT_GE(leftovers, 2);
  EXPECT_GE(refused, 1);
  auto r = prepare(args);
  ASSERT_EQ(r.code, 0) << r.output;
  r = prepare("--input " + path("big.jsonl") + " --out-dir " + path("clean") + bpe() +
              " --shard-tokens 1000000");
  ASSERT_EQ(r.code, 0) << r.output;
  std::vector<std::string> again, clean;
  for (const auto& e : fs::directory_iterator(path("d"))) again.push_back(e.path().filename());
  for (const auto& e : fs::directory_iterator(path("clean"))) clean.push_back(e.path().filename());
  std::sort(again.begin(), again.end());
  std::sort(clean.begin(), clean.end());
  EXPECT_EQ(again, clean);  // no leftovers
  for (const auto& name : clean)
    EXPECT_TRUE(read_file(path("d/" + name)) == read_file(path("clean/" + name))) << name;
}

// A 200 MB corpus (JSON Lines, gzip-compressed) prepared with peak memory under 300 MB.
TEST_F(Prepare, LargeCorpusInBoundedMemory) {
  const int64_t target = int64_t(200) << 20;
  int64_t bytes = 0;
  {
    std::ofstream out(path("corpus.jsonl"), std::ios::binary);
    for (int i = 0; bytes < target; i++) {
      // Varied bytes: each copy of a slice has its own number and a shifted start.
      const std::string doc =
          fmt::format("Copy {}: ", i) + text_.substr(size_t(i * 131) % 20000, 40000);
      const std::string line = nlohmann::json{{"text", doc}}.dump() + "\n";
      out << line;
      bytes += int64_t(line.size());
    }
  }
  ASSERT_EQ(std::system(("gzip -1 " + path("corpus.jsonl")).c_str()), 0);
  // The peak of a run on a tiny input: what the binary costs whatever the corpus (its linked
  // libraries: a CUDA build maps cuBLASLt).
  std::ofstream(path("tiny.txt")) << "a tiny corpus";
  const auto tiny = prepare("--input " + path("tiny.txt") + " --out-dir " + path("tiny"));
  ASSERT_EQ(tiny.code, 0) << tiny.output;
  const double baseline_mb = peak_memory_mb(tiny.output);
  const auto start = std::chrono::steady_clock::now();
  const auto r = prepare("--input " + path("corpus.jsonl.gz") + " --out-dir " + path("d"));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(r.code, 0) << r.output;
  const double peak_mb = peak_memory_mb(r.output);
  ASSERT_GT(peak_mb, 0) << r.output;
  std::cout << fmt::format(
      "prepared {:.0f} MB of JSON Lines (gzip) in {:.1f} s ({:.0f} MB/s), peak memory {:.0f} MB "
      "({:.0f} MB for a tiny input)\n",
      double(bytes) / 1e6, seconds, double(bytes) / 1e6 / seconds, peak_mb, baseline_mb);
  EXPECT_LT(peak_mb, 300) << r.output;
  EXPECT_LT(peak_mb - baseline_mb, 100) << r.output;
  EXPECT_NE(r.output.find(" MB read, "), std::string::npos) << "no progress line: " << r.output;
  TokenShard train(path("d/train.bin"), 256), val(path("d/val.bin"), 256);
  EXPECT_GT(train.size() + val.size(), target * 9 / 10);
  EXPECT_GT(val.documents(), 0);
}

}  // namespace
}  // namespace trainer
