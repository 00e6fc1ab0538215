// Our tokenizers against the reference implementations, token for token, on a corpus made to
// trip them up (tests/make_tokenizer_corpus.py): the npm tiktoken package (OpenAI's tiktoken
// built to WASM, run with node) for GPT-2, cl100k and a Llama-3-style tokenizer, and Debian's
// python3-sentencepiece for SentencePiece models trained here with spm_train. The reference files
// come from scripts/fetch_tokenizers.sh, run here (quiet when the cache is full): a missing cache
// or tool fails these tests, it does not skip them.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>

#include "io/tokenizer.h"
#include "test_util.h"
#include "trainer/hf_format.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;

std::string read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::istringstream s(text);
  for (int64_t v; s >> v;) ids.push_back(static_cast<int32_t>(v));
  return ids;
}

std::string cache_dir() {
  const char* c = std::getenv("TRAINER_CACHE");
  const char* home = std::getenv("HOME");
  return (c && *c ? std::string(c) : std::string(home ? home : "") + "/.cache/trainer") +
         "/tokenizers";
}

// Compares ids, reporting the first difference with its neighbourhood; prints the count.
void expect_same(const std::string& what, const std::vector<int32_t>& ours,
                 const std::vector<int32_t>& ref) {
  size_t first = 0;
  while (first < ours.size() && first < ref.size() && ours[first] == ref[first]) first++;
  if (first == ours.size() && first == ref.size()) {
    std::printf("[ parity   ] %s: %zu tokens compared, all equal\n", what.c_str(), ref.size());
    return;
  }
  auto around = [&](const std::vector<int32_t>& v) {
    const size_t lo = first > 3 ? first - 3 : 0;
    return ids_text(std::vector<int32_t>(v.begin() + std::min(lo, v.size()),
                                         v.begin() + std::min(first + 5, v.size())));
  };
  ADD_FAILURE() << what << ": " << ours.size() << " tokens (ours) vs " << ref.size()
                << " (reference); first difference at token " << first << ": ours ..."
                << around(ours) << "... reference ..." << around(ref) << "...";
}

class TokenizerParity : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cache_ = cache_dir();
    const auto fetch =
        test::run_command("bash " + test::source_dir() + "/scripts/fetch_tokenizers.sh " + cache_);
    fetch_ok_ = fetch.code == 0;
    fetch_output_ = fetch.output;
    work_ = (fs::temp_directory_path() / ("tokenizer_parity_" + std::to_string(getpid()))).string();
    const auto corpus =
        test::run_command("/usr/bin/python3 " + test::source_dir() +
                          "/tests/make_tokenizer_corpus.py " + test::source_dir() + " " + work_);
    corpus_output_ = corpus.code == 0 ? "" : corpus.output;
  }
  static void TearDownTestSuite() { fs::remove_all(work_); }
  void SetUp() override {
    ASSERT_TRUE(fetch_ok_) << "scripts/fetch_tokenizers.sh failed (the reference files are needed "
                              "and cannot be fetched):\n"
                           << fetch_output_;
    ASSERT_EQ(corpus_output_, "") << "tests/make_tokenizer_corpus.py failed";
    raw_ = read(work_ + "/corpus.bin");
    text_ = read(work_ + "/corpus.txt");
    ASSERT_GT(text_.size(), 100000u);
  }
  // The reference's ids for the corpus: tests/tiktoken_reference.js with `args`.
  std::vector<int32_t> reference(const std::string& args) {
    const auto r = test::run_command("node " + test::source_dir() +
                                     "/tests/tiktoken_reference.js " + cache_ + " " + args);
    EXPECT_EQ(r.code, 0) << r.output.substr(0, 2000);
    return parse_ids(r.output);
  }
  // Ours against the reference, without and with every special token allowed, and our round trip
  // on the raw corpus (invalid UTF-8 included), which no string-taking reference can be given.
  void compare(const std::string& what, const Tokenizer& tok, const std::string& ref_args) {
    const std::string corpus = work_ + "/corpus.txt";
    expect_same(what, tok.encode(text_), reference(ref_args + " " + corpus));
    expect_same(what + " (all specials allowed)", tok.encode(text_, tok.all_special()),
                reference(ref_args + " " + corpus + " all"));
    EXPECT_EQ(tok.decode(tok.encode(raw_)), raw_) << what << ": raw bytes round trip";
    EXPECT_EQ(tok.decode(tok.encode(text_, tok.all_special())), text_) << what;
  }

  static std::string cache_, work_, fetch_output_, corpus_output_;
  static bool fetch_ok_;
  std::string raw_, text_;
};
std::string TokenizerParity::cache_, TokenizerParity::work_, TokenizerParity::fetch_output_,
    TokenizerParity::corpus_output_;
bool TokenizerParity::fetch_ok_ = false;

TEST_F(TokenizerParity, Gpt2BothFileFormatsAgainstTiktoken) {
  auto files = load_tokenizer("gpt2", cache_ + "/gpt2");
  auto ranks = load_tokenizer("tiktoken", cache_ + "/gpt2.tiktoken", {"gpt2"});
  compare("gpt2 (encoder.json + vocab.bpe)", *files, "gpt2");
  compare("gpt2 (gpt2.tiktoken)", *ranks, "gpt2");
  EXPECT_EQ(files->vocab_size(), 50257);
  EXPECT_EQ(ranks->vocab_size(), 50257);
  EXPECT_NE(files->identity_hash(), ranks->identity_hash());  // different files, same tokens
  // The rank file converted for transformers (tokenizer.json: each token's merge found by BPE
  // over the lower ranks) gives OpenAI's own 50,000 merges of vocab.bpe, in order.
  const auto hf = hf_tokenizer_files(*ranks, 1024);
  ASSERT_EQ(hf[0].first, "tokenizer.json");
  const auto merges = nlohmann::json::parse(hf[0].second)["model"]["merges"];
  std::ifstream bpe(cache_ + "/gpt2/vocab.bpe");
  std::vector<std::string> lines;
  for (std::string line; std::getline(bpe, line);)
    if (!line.empty() && !line.starts_with("#version")) lines.push_back(line);
  ASSERT_EQ(lines.size(), 50000u);
  EXPECT_EQ(merges.get<std::vector<std::string>>(), lines);
}

TEST_F(TokenizerParity, Cl100kAgainstTiktoken) {
  auto tok = load_tokenizer("tiktoken", cache_ + "/cl100k_base.tiktoken", {"cl100k"});
  compare("cl100k", *tok, "cl100k_base");
  EXPECT_EQ(tok->vocab_size(), 100277);
}

// Llama 3's pattern and special tokens over the cl100k ranks (Llama 3's own 128k ranks are not
// on npm), against `new Tiktoken(ranks, specials, pattern)` given the same three.
TEST_F(TokenizerParity, Llama3StyleAgainstTiktoken) {
  auto tok = load_tokenizer("tiktoken", cache_ + "/cl100k_base.tiktoken", {"llama3"});
  std::string specials = "{";
  for (const auto& [name, id] : tok->special_tokens()) {
    specials += (specials.size() > 1 ? ",\"" : "\"") + name + "\":" + std::to_string(id);
  }
  specials += "}";
  const std::string pattern =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  std::ofstream(work_ + "/llama3_specials.json") << specials;
  std::ofstream(work_ + "/llama3_pattern.txt") << pattern;
  compare("llama3-style", *tok,
          cache_ + "/cl100k_base.tiktoken --pattern \"$(cat " + work_ +
              "/llama3_pattern.txt)\" --specials \"$(cat " + work_ + "/llama3_specials.json)\"");
  EXPECT_EQ(tok->vocab_size(), 100256 + 256);
  EXPECT_EQ(tok->special_tokens().at("<|begin_of_text|>"), 100256);
}

// Models trained here on the first part of the corpus; the whole corpus encoded by ours and by
// python3-sentencepiece.
TEST_F(TokenizerParity, SentencePieceAgainstPython) {
  std::ofstream(work_ + "/train.txt") << text_.substr(0, text_.size() / 2);
  for (const std::string type : {"bpe", "unigram"}) {
    const std::string prefix = work_ + "/spm_" + type;
    const auto train =
        test::run_command("spm_train --input=" + work_ + "/train.txt --model_prefix=" + prefix +
                          " --vocab_size=800 --model_type=" + type +
                          " --byte_fallback=true --character_coverage=1.0 --minloglevel=2");
    ASSERT_EQ(train.code, 0) << "spm_train (Debian package sentencepiece):\n" << train.output;
    auto tok = load_tokenizer("sentencepiece", prefix + ".model");
    std::ofstream(work_ + "/spm_encode.py")
        << "import sys, sentencepiece\n"
           "p = sentencepiece.SentencePieceProcessor(model_file=sys.argv[1])\n"
           "print(' '.join(map(str, p.encode(open(sys.argv[2], encoding='utf-8').read()))))\n";
    const auto py = test::run_command("/usr/bin/python3 " + work_ + "/spm_encode.py " + prefix +
                                      ".model " + work_ + "/corpus.txt");
    ASSERT_EQ(py.code, 0) << "python3-sentencepiece:\n" << py.output.substr(0, 2000);
    expect_same("sentencepiece " + type, tok->encode(text_), parse_ids(py.output));
    EXPECT_EQ(tok->vocab_size(), 800);
    // transformers' LlamaTokenizer files: the model itself, byte for byte.
    const auto hf = hf_tokenizer_files(*tok, 256);
    ASSERT_EQ(hf.size(), 3u);
    EXPECT_EQ(hf[0].first, "tokenizer.model");
    std::ifstream model_file(prefix + ".model", std::ios::binary);
    EXPECT_EQ(hf[0].second, std::string((std::istreambuf_iterator<char>(model_file)), {}));
    EXPECT_EQ(tok->special_tokens().at("<unk>"), 0);
    EXPECT_EQ(tok->special_tokens().at("<s>"), 1);
    EXPECT_EQ(tok->special_tokens().at("</s>"), 2);
    auto back = tokenizer_from_bytes(tok->serialize(), "ckpt");
    EXPECT_EQ(back->identity_hash(), tok->identity_hash());
    EXPECT_EQ(back->encode(text_), tok->encode(text_));
    EXPECT_NO_THROW(tok->encode(raw_));  // invalid UTF-8: no crash
  }
}

}  // namespace
}  // namespace trainer
