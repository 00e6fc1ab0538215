// Tokenizers on handmade files: round trips on any bytes, a BPE merge worked out by hand, special
// tokens only when allowed, identity hashes, serialisation, and one-line errors for bad files.
// Parity with the reference implementations on the real files: test_tokenizer_parity.cpp.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "io/bpe.h"
#include "io/errors.h"
#include "io/tokenizer.h"
#include "io/tokenizer_spec.h"
#include "test_util.h"
#include "trainer/hf_format.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;

std::string base64(std::string_view in) {
  static const char* t = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < in.size(); i += 3) {
    uint32_t w = static_cast<uint8_t>(in[i]) << 16;
    if (i + 1 < in.size()) w |= static_cast<uint8_t>(in[i + 1]) << 8;
    if (i + 2 < in.size()) w |= static_cast<uint8_t>(in[i + 2]);
    out += t[w >> 18];
    out += t[(w >> 12) & 63];
    out += i + 1 < in.size() ? t[(w >> 6) & 63] : '=';
    out += i + 2 < in.size() ? t[w & 63] : '=';
  }
  return out;
}

// GPT-2's bytes_to_unicode (encoder.py): printable Latin-1 bytes as themselves, the others as
// U+0100 onwards; returned UTF-8 encoded.
std::string gpt2_spelling(std::string_view bytes) {
  std::string out;
  for (unsigned char b : bytes) {
    int n = 0, cp = -1;
    for (int x = 0; x < 256 && cp < 0; x++) {
      const bool printable = (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE;
      if (x == b) cp = printable ? x : 256 + n;
      if (!printable) n++;
    }
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  return out;
}

// A handmade vocabulary: the 256 bytes (rank = byte value), then merges in rank order.
const std::vector<std::string> kMerges = {"aa", "ab", "aab", "th", "the", " the", "in", "ing"};

std::string tiktoken_file(const std::vector<std::string>& merges = kMerges) {
  std::string out;
  for (int b = 0; b < 256; b++)
    out += base64(std::string(1, static_cast<char>(b))) + " " + std::to_string(b) + "\n";
  for (size_t i = 0; i < merges.size(); i++) {
    out += base64(merges[i]) + " " + std::to_string(256 + i) + "\n";
  }
  return out;
}

class TokenizerTest : public test::TempDirTest {
 protected:
  std::string write(const std::string& name, const std::string& bytes) {
    const std::string p = path(name);
    fs::create_directories(fs::path(p).parent_path());
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  }
  std::unique_ptr<Tokenizer> handmade(const std::string& pattern = "gpt2") {
    return load_tokenizer("tiktoken", write("hand.tiktoken", tiktoken_file()), {pattern});
  }
  // The same vocabulary as GPT-2's two files: merge k is the pair whose joining makes merge k.
  std::string gpt2_dir() {
    std::string enc = "{";
    for (int b = 0; b < 256; b++) {
      std::string key = gpt2_spelling(std::string(1, static_cast<char>(b)));
      if (key == "\"" || key == "\\") key = "\\" + key;  // JSON escapes
      enc += fmt::format("\"{}\": {}, ", key, b);
    }
    const std::vector<std::string> pairs = {"a a",  "a b",   "aa b", "t h",
                                            "th e", "Ġ the", "i n",  "in g"};
    std::string bpe = "#version: 0.2\n";
    for (size_t i = 0; i < kMerges.size(); i++) {
      // JSON: the spelling of these merges needs no escaping.
      enc += fmt::format("\"{}\": {}, ", gpt2_spelling(kMerges[i]), 256 + i);
      bpe += pairs[i] + "\n";
    }
    enc += "\"<|endoftext|>\": " + std::to_string(256 + kMerges.size()) + "}";
    write("gpt2/encoder.json", enc);
    write("gpt2/vocab.bpe", bpe);
    return path("gpt2");
  }
  // The one-line message of the ConfigError `f` throws.
  template <class F>
  std::string error_of(F&& f) {
    try {
      f();
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
      return what;
    }
    ADD_FAILURE() << "no ConfigError";
    return "";
  }
};

std::string random_bytes(std::mt19937& rng, size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng() & 0xFF);
  return s;
}

// transformers' tokenizer files: GPT-2's BPE as vocab.json and merges.txt, byte for byte our
// encoder.json and vocab.bpe, with a GPT2Tokenizer config; a kind without such files gets none.
TEST_F(TokenizerTest, TransformersFilesOfAGpt2Tokenizer) {
  const std::string dir = gpt2_dir();
  const auto files = hf_tokenizer_files(*load_tokenizer("gpt2", dir), 1024);
  std::map<std::string, std::string> by_name(files.begin(), files.end());
  ASSERT_EQ(by_name.size(), 4u);
  auto bytes_of = [](const std::string& file) {
    std::ifstream in(file, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  EXPECT_EQ(by_name["vocab.json"], bytes_of(dir + "/encoder.json"));
  EXPECT_EQ(by_name["merges.txt"], bytes_of(dir + "/vocab.bpe"));
  const auto config = nlohmann::json::parse(by_name["tokenizer_config.json"]);
  EXPECT_EQ(config["tokenizer_class"], "GPT2Tokenizer");
  EXPECT_EQ(config["model_max_length"], 1024);
  EXPECT_EQ(config["eos_token"], "<|endoftext|>");
  EXPECT_EQ(nlohmann::json::parse(by_name["special_tokens_map.json"])["bos_token"],
            "<|endoftext|>");
  EXPECT_TRUE(hf_tokenizer_files(*load_tokenizer("bytes", ""), 1024).empty());

  // The same vocabulary as a tiktoken rank file: transformers' tokenizer.json holds exactly
  // GPT-2's vocabulary and merges (vocab.bpe, written independently above), tiktoken's pattern,
  // and the special token; an independent Python conversion of the rank file (transformers'
  // algorithm: each token split by BPE over lower ranks) finds the same merges.
  const auto tik = hf_tokenizer_files(*handmade(), 512);
  ASSERT_EQ(tik.size(), 3u);
  ASSERT_EQ(tik[0].first, "tokenizer.json");
  const auto tj = nlohmann::json::parse(tik[0].second);
  std::vector<std::string> merges;
  std::istringstream bpe(by_name["merges.txt"]);
  for (std::string line; std::getline(bpe, line);)
    if (!line.starts_with("#")) merges.push_back(line);
  EXPECT_EQ(tj["model"]["merges"].get<std::vector<std::string>>(), merges);
  auto encoder = nlohmann::json::parse(by_name["vocab.json"]);
  encoder.erase("<|endoftext|>");  // a special token: added_tokens, not the BPE vocabulary
  EXPECT_EQ(tj["model"]["vocab"], encoder);
  EXPECT_EQ(tj["model"]["ignore_merges"], true);
  EXPECT_EQ(tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"],
            parse_spec(handmade()->serialize(), "test").pattern);
  EXPECT_EQ(tj["added_tokens"][0]["content"], "<|endoftext|>");
  std::ofstream(path("convert.py"))
      << "import base64, json, sys\n"
         "ranks = {base64.b64decode(t): int(r) for t, r in (l.split() for l in "
         "open(sys.argv[1]) if l.strip())}\n"
         "def bpe(token, max_rank):\n"
         "    parts = [bytes([b]) for b in token]\n"
         "    while True:\n"
         "        pairs = [(ranks.get(a + b), i) for i, (a, b) in enumerate(zip(parts, "
         "parts[1:]))]\n"
         "        pairs = [(r, i) for r, i in pairs if r is not None and r < max_rank]\n"
         "        if not pairs: return parts\n"
         "        r, i = min(pairs)\n"
         "        parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]\n"
         "bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))\n"
         "cs = bs[:] + [256 + n for n in range(256 - len(bs))]\n"
         "spell = dict(zip(bs + [b for b in range(256) if b not in bs], cs))\n"
         "s = lambda t: ''.join(chr(spell[b]) for b in t)\n"
         "print(json.dumps([' '.join(s(p) for p in bpe(t, r)) for t, r in sorted(ranks.items(), "
         "key=lambda x: x[1]) if len(t) > 1]))\n";
  const auto py =
      test::run_command("/usr/bin/python3 " + path("convert.py") + " " + path("hand.tiktoken"));
  ASSERT_EQ(py.code, 0) << py.output;
  EXPECT_EQ(nlohmann::json::parse(py.output).get<std::vector<std::string>>(), merges);
}

TEST_F(TokenizerTest, BytesRoundTripAndFreeFunctions) {
  auto tok = load_tokenizer("bytes", "");
  std::string all;
  for (int b = 0; b < 256; b++) all += static_cast<char>(b);
  const std::vector<int32_t> ids = tok->encode(all);
  ASSERT_EQ(ids.size(), 256u);
  for (int b = 0; b < 256; b++) EXPECT_EQ(ids[b], b);
  EXPECT_EQ(ids, byte_encode(all));
  EXPECT_EQ(tok->decode(ids), all);
  EXPECT_EQ(byte_decode(ids), all);
  EXPECT_EQ(tok->vocab_size(), 256);
  EXPECT_TRUE(tok->special_tokens().empty());
  EXPECT_EQ(tok->kind(), "bytes");
  EXPECT_THROW(tok->decode({256}), std::out_of_range);
}

// "aaab" with ranks aa < ab < aab: the two "aa" pairs tie and the leftmost merges first, giving
// [aa][a][b], then [aa][ab]; merging right to left would give [a][aab].
TEST_F(TokenizerTest, BpeMergeByHand) {
  auto tok = handmade();
  EXPECT_EQ(tok->encode("aaab"), (std::vector<int32_t>{256, 257}));
  // " the" is one piece and one token; "thing" is th + ing, not t + h + in + g.
  EXPECT_EQ(tok->encode(" the"), (std::vector<int32_t>{261}));
  EXPECT_EQ(tok->encode("thing"), (std::vector<int32_t>{259, 263}));
  // The gpt2 pattern splits "aab aab" into "aab" and " aab".
  EXPECT_EQ(tok->encode("aab aab"), (std::vector<int32_t>{258, ' ', 258}));
  EXPECT_EQ(tok->vocab_size(), 50257);  // gpt2's <|endoftext|> at 50256
}

// Pieces over BpeRanks::kLinearMax take the heap; both must make the same merges everywhere.
TEST_F(TokenizerTest, HeapMergesAsTheLinearScan) {
  std::mt19937 rng(7);
  std::vector<RankedToken> ranks;
  for (int b = 0; b < 256; b++) ranks.push_back({std::string(1, static_cast<char>(b)), b});
  std::set<std::string> seen;
  for (int i = 0; i < 300; i++) {  // random merges over "abc", lengths 2..6
    std::string s;
    for (size_t n = 2 + rng() % 5; s.size() < n;) s += "abc"[rng() % 3];
    if (seen.insert(s).second) ranks.push_back({s, static_cast<int32_t>(256 + ranks.size())});
  }
  const BpeRanks r(ranks);
  for (int trial = 0; trial < 300; trial++) {
    std::string piece;
    for (size_t n = 1 + rng() % 600; piece.size() < n;) piece += "abc"[rng() % 3];
    std::vector<int32_t> linear, heap;
    r.encode_piece_linear(piece, linear);
    r.encode_piece_heap(piece, heap);
    ASSERT_EQ(linear, heap) << piece;
  }
}

// Any bytes, invalid UTF-8 included, come back unchanged, under every pattern.
TEST_F(TokenizerTest, BpeRoundTripsArbitraryBytes) {
  std::mt19937 rng(3);
  const std::vector<std::string> fragments = {
      "the ", "ing", "\xff", "\x80", "\xc3", "\xe2\x82", "\xf0\x9f\x98\x80", "\xed\xa0\x80",
      "  ",   "\n",  "'s",   "123",  "é",    "日本",     "\xc0\xaf",         "<|endoftext|>"};
  for (const std::string pattern : {"gpt2", "cl100k", "llama3"}) {
    auto tok = handmade(pattern);
    for (int trial = 0; trial < 400; trial++) {
      std::string s = random_bytes(rng, rng() % 64);
      for (int k = rng() % 12; k > 0; k--) s += fragments[rng() % fragments.size()];
      s += random_bytes(rng, rng() % 8);
      ASSERT_EQ(tok->decode(tok->encode(s)), s) << pattern << " " << trial;
    }
    const std::string spaces(5000, ' ');
    ASSERT_EQ(tok->decode(tok->encode(spaces + "\xff" + spaces)), spaces + "\xff" + spaces);
  }
}

TEST_F(TokenizerTest, SpecialTokensOnlyWhenAllowed) {
  auto tok = handmade("cl100k");
  const std::string text = "aa<|endoftext|>ab<|fim_prefix|>";
  const std::vector<int32_t> plain = tok->encode(text);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 100257), 0);
  EXPECT_EQ(plain, tok->encode_ordinary(text));
  EXPECT_EQ(tok->decode(plain), text);
  const std::vector<int32_t> eot = tok->encode(text, {"<|endoftext|>"});
  EXPECT_EQ(eot.front(), 256);
  EXPECT_EQ(eot[1], 100257);
  EXPECT_EQ(std::count(eot.begin(), eot.end(), 100258), 0);  // <|fim_prefix|> not allowed
  const std::vector<int32_t> all = tok->encode(text, tok->all_special());
  EXPECT_EQ(all.back(), 100258);
  EXPECT_EQ(tok->decode(all), text);
  EXPECT_EQ(tok->vocab_size(), 100277);
  EXPECT_EQ(tok->special_tokens().size(), 5u);

  auto llama = handmade("llama3");
  ASSERT_EQ(llama->special_tokens().size(), 256u);
  EXPECT_EQ(llama->special_tokens().at("<|begin_of_text|>"), 264);  // 264 ranks, then specials
  EXPECT_EQ(llama->special_tokens().at("<|eot_id|>"), 273);
  EXPECT_EQ(llama->special_tokens().at("<|reserved_special_token_250|>"), 264 + 255);
  EXPECT_EQ(llama->vocab_size(), 264 + 256);
  const auto ids = llama->encode("<|begin_of_text|>hi<|eot_id|>", {"<|eot_id|>"});
  EXPECT_EQ(ids.back(), 273);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 264), 0);
}

TEST_F(TokenizerTest, Gpt2FilesEqualTheRankFile) {
  auto files = load_tokenizer("gpt2", gpt2_dir());
  auto via_json = load_tokenizer("gpt2", path("gpt2/encoder.json"));
  auto ranks = handmade("gpt2");
  std::mt19937 rng(5);
  for (int trial = 0; trial < 100; trial++) {
    const std::string s = "the thing aaab " + random_bytes(rng, 40) + " ing the";
    ASSERT_EQ(files->encode(s), ranks->encode(s));
    ASSERT_EQ(via_json->encode(s), ranks->encode(s));
  }
  EXPECT_EQ(files->special_tokens(), (SpecialTokens{{"<|endoftext|>", 264}}));
  EXPECT_EQ(files->vocab_size(), 265);
  EXPECT_EQ(files->encode("<|endoftext|>", {"<|endoftext|>"}), (std::vector<int32_t>{264}));
}

TEST_F(TokenizerTest, IdentityHashIsStableAndTellsFilesApart) {
  // Hard-coded: a change here changes every stored tokenizer's identity, which must be deliberate.
  EXPECT_EQ(load_tokenizer("bytes", "")->identity_hash(), 0x287f1ec1570ad13cull);
  const uint64_t h = handmade()->identity_hash();
  EXPECT_EQ(h, handmade()->identity_hash());
  EXPECT_EQ(h, 0x2806bcb1c6d6aa17ull) << std::hex << h;
  EXPECT_NE(h, handmade("cl100k")->identity_hash());
  std::vector<std::string> other = kMerges;
  std::swap(other[0], other[1]);  // the same tokens, two ranks swapped
  EXPECT_NE(h, load_tokenizer("tiktoken", write("other.tiktoken", tiktoken_file(other)), {"gpt2"})
                   ->identity_hash());
  EXPECT_NE(load_tokenizer("gpt2", gpt2_dir())->identity_hash(), h);
}

TEST_F(TokenizerTest, SerializeRoundTrip) {
  std::vector<std::unique_ptr<Tokenizer>> toks;
  toks.push_back(load_tokenizer("bytes", ""));
  toks.push_back(handmade("llama3"));
  toks.push_back(load_tokenizer("gpt2", gpt2_dir()));
  for (const auto& tok : toks) {
    auto back = tokenizer_from_bytes(tok->serialize(), "ckpt.h5");
    EXPECT_EQ(back->identity_hash(), tok->identity_hash());
    EXPECT_EQ(back->serialize(), tok->serialize());
    EXPECT_EQ(back->kind(), tok->kind());
    EXPECT_EQ(back->special_tokens(), tok->special_tokens());
    EXPECT_EQ(back->vocab_size(), tok->vocab_size());
    const std::string s = "the thing aaab <|eot_id|> \xff\xfe 日本";
    EXPECT_EQ(back->encode(s, back->all_special()), tok->encode(s, tok->all_special()));
  }
  // Damaged bytes: a CheckpointError naming the source and the offset, one line.
  const std::string bytes = toks[1]->serialize();
  for (size_t cut : {size_t{0}, size_t{10}, bytes.size() / 2, bytes.size() - 1}) {
    try {
      tokenizer_from_bytes(std::string_view(bytes).substr(0, cut), "ckpt.h5");
      ADD_FAILURE() << "no error at cut " << cut;
    } catch (const CheckpointError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("ckpt.h5"), std::string::npos) << what;
      EXPECT_NE(what.find("offset"), std::string::npos) << what;
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    }
  }
}

TEST_F(TokenizerTest, BadInputsAreOneLineErrors) {
  const std::string good = tiktoken_file();
  auto tik = [&](const std::string& name, const std::string& bytes,
                 const std::string& pattern = "gpt2") {
    return error_of([&] { load_tokenizer("tiktoken", write(name, bytes), {pattern}); });
  };
  auto has = [](const std::string& what, std::initializer_list<const char*> parts) {
    for (const char* p : parts) EXPECT_NE(what.find(p), std::string::npos) << p << " in: " << what;
  };
  // Truncated mid-line.
  has(tik("cut.tiktoken", good.substr(0, good.size() - 3)),
      {"cut.tiktoken", "line 264", "truncated"});
  // Not base64.
  has(tik("b64.tiktoken", "IQ== 0\nI*== 1\n"), {"b64.tiktoken", "line 2", "not base64"});
  // A byte without a rank.
  has(tik("short.tiktoken", "IQ== 0\n"), {"short.tiktoken", "byte 0x00"});
  // encoder.json given as a rank file.
  gpt2_dir();
  std::ifstream enc(path("gpt2/encoder.json"));
  const std::string json((std::istreambuf_iterator<char>(enc)), std::istreambuf_iterator<char>());
  has(tik("encoder.tiktoken", json), {"encoder.tiktoken", "line 1", "BASE64-TOKEN RANK", "{"});
  // An unknown pattern.
  has(tik("p.tiktoken", good, "o300k"), {"p.tiktoken", "gpt2, cl100k, llama3", "o300k"});
  // A missing file, a missing vocab.bpe, a rank file given as encoder.json.
  has(error_of([&] { load_tokenizer("tiktoken", path("none.tiktoken"), {"gpt2"}); }),
      {"none.tiktoken", "no such file"});
  write("lone/encoder.json", json);
  has(error_of([&] { load_tokenizer("gpt2", path("lone")); }),
      {"lone/vocab.bpe", "no such file", "side by side"});
  write("swap/encoder.json", good);
  write("swap/vocab.bpe", "#version: 0.2\n");
  has(error_of([&] { load_tokenizer("gpt2", path("swap")); }),
      {"swap/encoder.json", "byte 0", "expected JSON", "AA== 0"});
  // Truncated encoder.json; a merge out of order; truncated vocab.bpe.
  write("trunc/encoder.json", json.substr(0, json.size() / 2));
  write("trunc/vocab.bpe", "#version: 0.2\n");
  has(error_of([&] { load_tokenizer("gpt2", path("trunc")); }),
      {"trunc/encoder.json", "byte ", "expected JSON"});
  write("order/encoder.json", json);
  write("order/vocab.bpe", "#version: 0.2\na b\na a\n");
  has(error_of([&] { load_tokenizer("gpt2", path("order")); }),
      {"order/vocab.bpe", "line 2", "make id 256", "\"a b\"", "makes id 257"});
  write("few/encoder.json", json);
  write("few/vocab.bpe", "#version: 0.2\na a\na b\n");
  has(error_of([&] { load_tokenizer("gpt2", path("few")); }),
      {"few/vocab.bpe", "256 byte tokens + 2 merges", "found 264 tokens", "truncated"});
  write("junk/encoder.json", json);
  write("junk/vocab.bpe", "#version: 0.2\na  a\n");
  has(error_of([&] { load_tokenizer("gpt2", path("junk")); }),
      {"junk/vocab.bpe", "line 2", "a merge 'LEFT RIGHT'"});
  // Not a SentencePiece model; an unknown kind.
  has(error_of([&] { load_tokenizer("sentencepiece", write("bad.model", "IQ== 0\n")); }),
      {"bad.model", "expected a SentencePiece model", "IQ=="});
  has(error_of([&] { load_tokenizer("wordpiece", ""); }), {"wordpiece", "expected bytes, gpt2"});
}

}  // namespace
}  // namespace trainer
