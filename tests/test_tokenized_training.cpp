// A run with a BPE tokenizer, end to end through the binary: `prepare` tokenizes a real text
// with a tiktoken rank file and records the tokenizer in the shards, training samples decode to
// text, every checkpoint carries the tokenizer so that `generate` needs nothing else (the rank
// file is deleted first), and shards of another tokenizer or a vocabulary too small for the
// tokenizer are refused with one line and exit code 2. The rank file is made here: the 256 bytes
// and a few merges of common English pairs, with GPT-2's pattern (and so its <|endoftext|>,
// id 50256).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/token_shard.h"
#include "io/tokenizer.h"
#include "test_util.h"

namespace trainer {
namespace {

class TokenizedRun : public test::TempDirTest {
 protected:
  test::CommandResult run(const std::string& args) {
    return test::run_command("OMP_NUM_THREADS=1 " + test::trainer_bin() + " " + args);
  }
  void write_ranks() { test::write_rank_file(path("ranks.tiktoken"), test::kEnglishMerges); }
  std::string tokenizer_flags() {
    return "--tokenizer tiktoken --tokenizer-path " + path("ranks.tiktoken") + " --pattern gpt2";
  }
  std::string train_args(const std::string& out, const std::string& extra) {
    return "train " + path("run.toml") + " --set run.out_dir=\\\"" + path(out) + "\\\" " + extra;
  }
  void SetUp() override {
    TempDirTest::SetUp();
    write_ranks();
    std::ofstream(path("run.toml"))
        << "[run]\nseed = 5\nthreads = 1\n"
        << "[model]\nvocab_size = 50257\nseq_len = 32\nn_layer = 2\nn_head = 2\nd_model = 32\n"
        << "[tokenizer]\nkind = \"tiktoken\"\npath = \"" << path("ranks.tiktoken")
        << "\"\npattern = \"gpt2\"\n"
        << "[data]\ntrain = \"" << path("data/train.bin") << "\"\nval = \"" << path("data/val.bin")
        << "\"\n"
        << "[train]\nmicro_batch = 2\nsteps = 2\nval_every = 0\nsample_every = 1\n"
        << "sample_tokens = 12\nsample_prompt = \"Elizabeth\"\n";
  }
};

TEST_F(TokenizedRun, PrepareTrainSampleAndGenerateWithTheCheckpointsTokenizer) {
  ASSERT_EQ(test::base64("the"), "dGhl");
  ASSERT_EQ(test::base64(" t"), "IHQ=");
  ASSERT_EQ(test::base64("a"), "YQ==");
  const std::string text = test::source_dir() + "/tests/data/pride_and_prejudice_opening.txt";
  auto r = run("prepare --input " + text + " --out-dir " + path("data") + " " + tokenizer_flags());
  ASSERT_EQ(r.code, 0) << r.output;
  const auto tokenizer = load_tokenizer("tiktoken", path("ranks.tiktoken"), {"gpt2"});
  EXPECT_NE(r.output.find(fmt::format("identity hash {:016x}", tokenizer->identity_hash())),
            std::string::npos)
      << r.output;
  // The shards hold the text's tokens, the document's end after it, and the tokenizer's hash.
  const TokenShard train(path("data/train.bin"), 50257), val(path("data/val.bin"), 50257);
  EXPECT_EQ(train.tokenizer_hash(), tokenizer->identity_hash());
  std::vector<int32_t> all(train.size() + val.size());
  train.read(0, train.size(), all.data());
  val.read(0, val.size(), all.data() + train.size());
  std::ifstream in(text, std::ios::binary);
  const std::string want((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // The document's train part and val part (the last 10%), each ended by <|endoftext|>.
  std::vector<int32_t> expected = tokenizer->encode_ordinary(want);
  const size_t split = expected.size() - size_t(double(expected.size()) * 0.1);
  expected.insert(expected.begin() + split, 50256);
  expected.push_back(50256);
  EXPECT_EQ(all, expected);
  EXPECT_LT(all.size(), want.size() * 9 / 10);  // the merges took effect

  r = run(train_args("out", ""));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("step      0 | sample:\nElizabeth"), std::string::npos) << r.output;
  std::ifstream metrics(path("out/metrics.jsonl"));
  int samples = 0;
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("sample")) continue;
    samples++;
    const std::string s = j["sample"];
    EXPECT_EQ(tokenizer->decode(tokenizer->encode_ordinary(s)), s);
  }
  EXPECT_EQ(samples, 3);

  // generate needs only the checkpoint.
  std::filesystem::remove(path("ranks.tiktoken"));
  r = run("generate --checkpoint " + path("out") + " --prompt 'It is a truth' --tokens 8");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output.rfind("It is a truth", 0), 0u) << r.output;
  write_ranks();

  // Shards of another tokenizer, and a vocabulary smaller than the tokenizer's.
  r = run(
      train_args("bytes", "--set tokenizer.kind=\\\"bytes\\\" --set tokenizer.pattern=\\\"\\\""));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find(path("data/train.bin") + ": prepared with another tokenizer"),
            std::string::npos)
      << r.output;
  r = run(train_args("small", "--set model.vocab_size=300"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("[model] vocab_size: 300 is smaller than the 50257 tokens of [tokenizer] "
                          "tiktoken gpt2"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(std::filesystem::exists(path("bytes")));

  // A resume with another tokenizer is refused, even on shards that record none (llm.c's, say):
  // the checkpoint knows what it was trained with.
  std::filesystem::create_directories(path("plain"));
  write_token_shard(path("plain/train.bin"), std::vector<int32_t>(all.begin(), all.end()), 50257);
  write_token_shard(path("plain/val.bin"), expected, 50257);
  const std::string plain = "--set data.train=\\\"" + path("plain/train.bin") +
                            "\\\" --set data.val=\\\"" + path("plain/val.bin") + "\\\"";
  r = run(train_args("resumed", plain));
  ASSERT_EQ(r.code, 0) << r.output;
  test::write_rank_file(path("other.tiktoken"), {});  // the 256 bytes, no merges
  r = run(train_args("resumed", plain +
                                    " --set train.steps=4 --set checkpoint.resume=\\\"auto\\\" "
                                    "--set tokenizer.path=\\\"" +
                                    path("other.tiktoken") + "\\\""));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("trained with tokenizer tiktoken"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("resume with the tokenizer the run was trained with"), std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace trainer
