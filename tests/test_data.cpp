// Token shards in all four layouts, every kind of damaged file, and the batch order.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "io/compressed_shard.h"
#include "io/data_loader.h"
#include "io/dataset.h"
#include "io/token_shard.h"
#include "test_util.h"
#include "trainer/batch_schedule.h"
#include "trainer/metrics.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;

class DataTest : public test::TempDirTest {
 protected:
  void write_bytes(const std::string& name, const void* data, size_t n) {
    std::ofstream(path(name), std::ios::binary).write(static_cast<const char*>(data), n);
  }
  std::string error_of(const std::string& name, int vocab = 256) {
    try {
      TokenShard s(path(name), vocab);
    } catch (const DataError& e) {
      return e.what();
    }
    return "(no error)";
  }
};

std::vector<int32_t> ramp(int n, int mod) {
  std::vector<int32_t> v(n);
  for (int i = 0; i < n; i++) v[i] = (i * 7) % mod;
  return v;
}

TEST_F(DataTest, OurLayoutRoundTripsInBothWidths) {
  for (int vocab : {256, 70000}) {
    auto tokens = ramp(1000, vocab == 256 ? 256 : 69999);
    write_token_shard(path("a.bin"), tokens, vocab);
    TokenShard s(path("a.bin"), vocab);
    EXPECT_STREQ(s.format(), "trainer");
    std::vector<int32_t> back(tokens.size());
    s.read(0, int64_t(tokens.size()), back.data());
    EXPECT_EQ(back, tokens);
    EXPECT_EQ(fs::file_size(path("a.bin")), 64 + tokens.size() * (vocab == 256 ? 2 : 4));
  }
  EXPECT_FALSE(fs::exists(path("a.bin.tmp")));
}

TEST_F(DataTest, LlmcLayout) {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = 1;
  header[2] = 5;
  std::vector<uint16_t> tokens = {1, 2, 50000, 4, 5};
  std::ofstream f(path("llmc.bin"), std::ios::binary);
  f.write(reinterpret_cast<char*>(header.data()), 1024);
  f.write(reinterpret_cast<char*>(tokens.data()), 10);
  f.close();
  TokenShard s(path("llmc.bin"), 50257);
  EXPECT_STREQ(s.format(), "llm.c");
  std::vector<int32_t> back(5);
  s.read(0, 5, back.data());
  EXPECT_EQ(back, (std::vector<int32_t>{1, 2, 50000, 4, 5}));
  // Truncated: the header promises 5 tokens, the file holds 4.
  std::ofstream g(path("short.bin"), std::ios::binary);
  g.write(reinterpret_cast<char*>(header.data()), 1024);
  g.write(reinterpret_cast<char*>(tokens.data()), 8);
  g.close();
  EXPECT_EQ(
      error_of("short.bin", 50257),
      path("short.bin") + ": llm.c file of 5 tokens should be 1034 bytes, found 1032 (truncated)");
}

// llm.c's Llama-3 shards (dev/data/data_common.py): magic 20240801, version 7, uint32 tokens.
TEST_F(DataTest, LlmcLlama3Layout) {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240801;
  header[1] = 7;
  header[2] = 4;
  const std::vector<uint32_t> tokens = {128000, 9906, 1917, 128001};  // above uint16's range
  auto write = [&](const std::string& name, size_t token_bytes) {
    std::ofstream f(path(name), std::ios::binary);
    f.write(reinterpret_cast<const char*>(header.data()), 1024);
    f.write(reinterpret_cast<const char*>(tokens.data()), std::streamsize(token_bytes));
  };
  write("llama3.bin", 16);
  TokenShard s(path("llama3.bin"), 128256);
  EXPECT_STREQ(s.format(), "llm.c uint32 (v7)");
  std::vector<int32_t> back(4);
  s.read(0, 4, back.data());
  EXPECT_EQ(back, (std::vector<int32_t>{128000, 9906, 1917, 128001}));
  EXPECT_EQ(Dataset({path("llama3.bin"), path("llama3.bin")}, 128256, 3).describe(),
            "2 shards, llm.c uint32 (v7) format");
  // Sized as uint32: the 8 bytes that would hold 4 uint16 tokens are a truncated file.
  write("short.bin", 8);
  EXPECT_EQ(
      error_of("short.bin", 128256),
      path("short.bin") +
          ": llm.c uint32 (v7) file of 4 tokens should be 1040 bytes, found 1032 (truncated)");
  // Each magic has its own version.
  header[1] = 1;
  write("v1.bin", 16);
  EXPECT_EQ(error_of("v1.bin", 128256),
            path("v1.bin") + ": offset 4: expected llm.c version 7 after magic 20240801, found 1");
}

// nanoGPT's headerless uint16 files are read when data.format says so, and only then: a file
// whose magic is none of the known ones (a damaged header) is not silently re-read as tokens.
TEST_F(DataTest, NanoGptHeaderlessUint16) {
  std::vector<uint16_t> tokens = {3, 1, 4, 1, 5, 9};
  write_bytes("nano.bin", tokens.data(), 12);
  TokenShard s(path("nano.bin"), 10, true);
  EXPECT_STREQ(s.format(), "nanoGPT uint16");
  EXPECT_EQ(s.size(), 6);
  EXPECT_EQ(error_of("nano.bin", 10),
            path("nano.bin") +
                ": offset 0: unrecognised data file: expected the magic "
                "\"TRTOKENS\" or llm.c's 20240520 or 20240801, found 12 bytes starting "
                "03 00 01 00 "
                "04 00 01 00 (a headerless nanoGPT file of uint16 tokens needs "
                "data.format = \"nanogpt\"; a Megatron .bin needs its .idx beside it)");
  // Our own file with one byte of its magic flipped.
  write_token_shard(path("ours.bin"), ramp(100, 256), 256);
  {
    std::fstream f(path("ours.bin"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(0);
    f.put('X');
  }
  EXPECT_NE(error_of("ours.bin")
                .find("unrecognised data file: expected the magic \"TRTOKENS\" "
                      "or llm.c's 20240520 or 20240801, found 264 bytes starting 58 52 54 4f"),
            std::string::npos)
      << error_of("ours.bin");
  EXPECT_EQ(Dataset({path("nano.bin"), path("nano.bin")}, 10, 2, true).describe(),
            "2 shards, nanoGPT uint16 format");
}

std::vector<int32_t> tokens_of(const TokenShard& s) {
  std::vector<int32_t> t(size_t(s.size()));
  s.read(0, s.size(), t.data());
  return t;
}

// Megatron-LM's .bin/.idx pair, written by numpy as Megatron writes it, in both token types it is
// read in, named by either file or the bare prefix; its documents (one empty, as Megatron writes
// for an empty text) become the document index.
TEST_F(DataTest, MegatronPairReadsBackTheExactTokens) {
  const auto r =
      test::write_megatron("[(\"" + path("u16") +
                           "\", \"uint16\", [[[1, 2, 3], [4, 65535]], [], [[6, 7, 8, 9]], [[0]]]), "
                           "(\"" +
                           path("i32") +
                           "\", \"int32\", [[[70000, 1]], [[2], [], [99999]]]), "
                           "(\"" +
                           path("neg") +
                           "\", \"int32\", [[[5, -3, 7]]]), "
                           "(\"" +
                           path("i64") + "\", \"int64\", [[[1, 2]]])]");
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* name : {"u16.bin", "u16.idx", "u16"}) {
    TokenShard s(path(name), 65536);
    EXPECT_STREQ(s.format(), "Megatron uint16") << name;
    EXPECT_EQ(tokens_of(s), (std::vector<int32_t>{1, 2, 3, 4, 65535, 6, 7, 8, 9, 0})) << name;
    ASSERT_EQ(s.documents(), 3) << name;
    EXPECT_EQ(s.document_start(0), 0);
    EXPECT_EQ(s.document_start(1), 5);
    EXPECT_EQ(s.document_start(2), 9);
  }
  TokenShard s(path("i32.idx"), 100000);
  EXPECT_STREQ(s.format(), "Megatron int32");
  EXPECT_EQ(tokens_of(s), (std::vector<int32_t>{70000, 1, 2, 99999}));
  EXPECT_EQ(s.documents(), 2);
  EXPECT_EQ(s.document_start(1), 2);
  EXPECT_EQ(error_of("neg.bin"),
            path("neg.bin") +
                ": offset 4: token -3 at index 1 is outside the vocabulary (vocab_size = 256)");
  EXPECT_EQ(error_of("i64.idx"),
            path("i64.idx") +
                ": offset 17: dtype code 5 (int64): only uint16 (8) and int32 (4) tokens are read");
  // A pattern that matches both files of a pair lists it once.
  EXPECT_EQ(expand_shard_paths({path("u16*")}), (std::vector<std::string>{path("u16.bin")}));
  EXPECT_EQ(Dataset({path("u16*"), path("i32")}, 100000, 2).describe(),
            "2 shards: 1 Megatron int32, 1 Megatron uint16");
}

// Every kind of .idx that does not match its .bin is one line naming the .idx, the offset or the
// field, what was expected and what was found.
TEST_F(DataTest, DamagedMegatronIndex) {
  // 3 sequences {3, 2, 3 tokens} in 2 documents: lengths at 34, pointers at 46, documents at 70.
  const auto r = test::write_megatron("[(\"" + path("m") +
                                      "\", \"uint16\", [[[1, 2, 3], [4, 5]], [[6, 7, 8]]])]");
  ASSERT_EQ(r.code, 0) << r.output;
  ASSERT_EQ(fs::file_size(path("m.idx")), 94u);
  int n = 0;
  // A copy of the pair with `edit` applied; returns the error of opening it by its .idx.
  auto damaged = [&](auto edit) {
    const std::string p = fmt::format("d{}", n++);
    fs::copy_file(path("m.idx"), path(p + ".idx"));
    fs::copy_file(path("m.bin"), path(p + ".bin"));
    edit(path(p));
    return error_of(p + ".idx");
  };
  auto put = [](const std::string& file, size_t at, auto value) {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(std::streamoff(at));
    f.write(reinterpret_cast<const char*>(&value), sizeof value);
  };
  // `what` with {} for the damaged copy's prefix.
  auto expect = [&](auto edit, const std::string& what) {
    const std::string name = path(fmt::format("d{}", n));
    EXPECT_EQ(damaged(edit),
              fmt::format("{}.idx: {}", name, fmt::format(fmt::runtime(what), name)));
  };
  expect([&](const std::string& p) { fs::resize_file(p + ".idx", 90); },
         "Megatron index of 3 sequences and 3 document indices should be 94 bytes, found 90 "
         "(truncated)");
  expect([&](const std::string& p) { fs::resize_file(p + ".idx", 20); },
         "Megatron index header truncated: expected 34 bytes, file has 20");
  expect([&](const std::string& p) { put(p + ".idx", 0, 'X'); },
         "offset 0: not a Megatron index: expected the magic \"MMIDIDX\\0\\0\", found 94 bytes "
         "starting 58 4d 49 44 49 44 58 00 00");
  expect([&](const std::string& p) { put(p + ".idx", 9, uint64_t(2)); },
         "offset 9: expected Megatron index version 1, found 2");
  expect([&](const std::string& p) { put(p + ".idx", 18, uint64_t(1) << 40); },
         "offset 18: header declares 1099511627776 sequences, more than a file of 94 bytes can "
         "hold");
  // Lengths that do not fill the .bin, or a .bin that is not this index's.
  expect([&](const std::string& p) { put(p + ".idx", 38, int32_t(3)); },
         "sequence lengths sum to 9 tokens (18 bytes of uint16), but {}.bin has 16 bytes");
  expect([&](const std::string& p) { fs::resize_file(p + ".bin", 14); },
         "sequence lengths sum to 8 tokens (16 bytes of uint16), but {}.bin has 14 bytes");
  expect([&](const std::string& p) { put(p + ".idx", 34, int32_t(-1)); },
         "offset 34: sequence 0 has length -1, expected 0 or more");
  expect([&](const std::string& p) { put(p + ".idx", 62, int64_t(1000)); },
         "offset 62: sequence 2 points at byte 1000, outside {}.bin's 16 bytes, expected 10 "
         "(sequences lie back to back from byte 0 of the .bin)");
  expect([&](const std::string& p) { put(p + ".idx", 54, int64_t(4)); },
         "offset 54: sequence 1 points at byte 4, expected 6 (sequences lie back to back from "
         "byte 0 of the .bin)");
  expect([&](const std::string& p) { put(p + ".idx", 70, int64_t(1)); },
         "offset 70: document index 0 of 3 is 1, expected 0");
  expect([&](const std::string& p) { put(p + ".idx", 78, int64_t(-1)); },
         "offset 78: document index 1 of 3 is -1, expected 0 to 3");
  expect([&](const std::string& p) { put(p + ".idx", 86, int64_t(2)); },
         "offset 86: document index 2 of 3 is 2, expected the sequence count 3");
  // The .bin missing, named by the .idx or by the prefix.
  fs::remove(path("m.bin"));
  for (const char* name : {"m.idx", "m"})
    EXPECT_EQ(error_of(name), path("m.bin") +
                                  ": cannot open data file: No such file or directory "
                                  "(the tokens of the Megatron index " +
                                  path("m.idx") + ")");
}

TEST_F(DataTest, TruncatedOurs) {
  write_token_shard(path("t.bin"), ramp(100, 256), 256);
  fs::resize_file(path("t.bin"), 64 + 150);
  EXPECT_EQ(
      error_of("t.bin"),
      path("t.bin") + ": trainer file of 100 tokens should be 264 bytes, found 214 (truncated)");
  fs::resize_file(path("t.bin"), 20);
  EXPECT_EQ(error_of("t.bin"),
            path("t.bin") + ": header truncated: expected 64 bytes, file has 20");
}

TEST_F(DataTest, WrongMagic) {
  const char junk[] = "this is not a token file!";
  write_bytes("x.dat", junk, sizeof junk - 1);
  EXPECT_EQ(error_of("x.dat"),
            path("x.dat") +
                ": offset 0: unrecognised data file: expected the magic \"TRTOKENS\" or llm.c's "
                "20240520 or 20240801, found 25 bytes starting 74 68 69 73 20 69 73 20 (a "
                "headerless nanoGPT "
                "file of uint16 tokens needs data.format = \"nanogpt\"; a Megatron .bin needs its "
                ".idx beside it)");
}

TEST_F(DataTest, BadVersionAndWidth) {
  write_token_shard(path("v.bin"), ramp(10, 256), 256);
  std::fstream f(path("v.bin"), std::ios::in | std::ios::out | std::ios::binary);
  const uint32_t bad = 7;
  f.seekp(8);
  f.write(reinterpret_cast<const char*>(&bad), 4);
  f.close();
  EXPECT_EQ(error_of("v.bin"), path("v.bin") + ": offset 8: expected version 1 or 2, found 7");
}

TEST_F(DataTest, AbsurdTokenCountIsAnErrorNotACrash) {
  write_token_shard(path("huge.bin"), ramp(10, 256), 65536 * 2);  // 4 bytes per token
  std::fstream f(path("huge.bin"), std::ios::in | std::ios::out | std::ios::binary);
  const uint64_t count = (uint64_t(1) << 62) + 10;  // 64 + 4 * count wraps to the real size
  f.seekp(16);
  f.write(reinterpret_cast<const char*>(&count), 8);
  f.close();
  EXPECT_EQ(error_of("huge.bin", 256),
            path("huge.bin") +
                ": trainer header declares 4611686018427387914 tokens, more than a file of 104 "
                "bytes can hold");
}

TEST_F(DataTest, TokenOutsideVocabulary) {
  auto tokens = ramp(50, 256);
  tokens[17] = 300;
  write_token_shard(path("big.bin"), tokens, 65536);
  EXPECT_EQ(error_of("big.bin"),
            path("big.bin") +
                ": offset 98: token 300 at index 17 is outside the vocabulary (vocab_size = 256)");
}

TEST_F(DataTest, MissingAndEmptyFiles) {
  EXPECT_EQ(error_of("none.bin"),
            path("none.bin") + ": cannot open data file: No such file or directory");
  write_bytes("empty.bin", "", 0);
  EXPECT_EQ(error_of("empty.bin"), path("empty.bin") + ": data file is empty");
}

TEST_F(DataTest, WindowsAndTheirTargets) {
  auto tokens = ramp(101, 256);
  write_token_shard(path("w.bin"), tokens, 256);
  Dataset data({path("w.bin")}, 256, 10);
  EXPECT_EQ(data.windows(), 10);  // (101 - 1) / 10
  std::vector<int32_t> in(10), tg(10);
  data.window(3, in.data(), tg.data());
  for (int i = 0; i < 10; i++) {
    EXPECT_EQ(in[i], tokens[30 + i]);
    EXPECT_EQ(tg[i], tokens[31 + i]);
  }
  EXPECT_THROW(Dataset({path("w.bin")}, 256, 200), DataError);
}

// data.train may name shards by glob pattern (llm.c writes 100 of them): expanded in sorted
// order, so shard_10 follows shard_09; a pattern that matches nothing is a data error.
TEST_F(DataTest, ShardPatternsExpandInSortedOrder) {
  for (const char* name : {"shard_10.bin", "shard_09.bin", "shard_00.bin", "other.bin"})
    write_token_shard(path(name), ramp(21, 256), 256);
  EXPECT_EQ(expand_shard_paths({path("shard_*.bin"), path("other.bin")}),
            (std::vector<std::string>{path("shard_00.bin"), path("shard_09.bin"),
                                      path("shard_10.bin"), path("other.bin")}));
  EXPECT_EQ(Dataset({path("shard_*.bin")}, 256, 10).windows(), 3 * 2);
  try {
    Dataset({path("val_*.bin")}, 256, 10);
    FAIL();
  } catch (const DataError& e) {
    EXPECT_EQ(std::string(e.what()), path("val_*.bin") + ": no token shard matches this pattern");
  }
}

TEST_F(DataTest, SampleOrderIsAPermutationPerEpochAndPureInSeed) {
  SampleOrder a(50, 1), b(50, 1), c(50, 2);
  std::set<int64_t> epoch0, epoch1;
  bool differs = false, epochs_differ = false;
  for (int i = 0; i < 100; i++) {
    const int64_t w = a.window(i);
    EXPECT_EQ(w, b.window(i));
    differs |= w != c.window(i);
    (i < 50 ? epoch0 : epoch1).insert(w);
    if (i >= 50) epochs_differ |= w != SampleOrder(50, 1).window(i - 50);
  }
  EXPECT_EQ(epoch0.size(), 50u);
  EXPECT_EQ(epoch1.size(), 50u);
  EXPECT_TRUE(differs);
  EXPECT_TRUE(epochs_differ);
  // Random access gives the same answer as sequential access.
  SampleOrder fresh(50, 1);
  EXPECT_EQ(fresh.window(77), SampleOrder(50, 1).window(77));
}

TEST_F(DataTest, LoaderYieldsTheGlobalSamplesInStepOrder) {
  write_token_shard(path("l.bin"), ramp(5001, 256), 256);
  Dataset data({path("l.bin")}, 256, 16);
  const int B = 3, T = 16, accum = 2;
  // After 5 steps, as on resume.
  DataLoader loader(std::span(&data, 1), BlendPlan::fresh({1}), B, T, DataLoader::constant(accum),
                    42, 1, 5 * accum * B);
  SampleOrder order(data.windows(), 42);
  std::vector<int32_t> in(T), tg(T);
  for (int64_t step = 5; step < 9; step++)
    for (int micro = 0; micro < accum; micro++) {
      const Batch& b = loader.next();
      ASSERT_EQ(b.step, step - 5);
      ASSERT_EQ(b.micro, micro);
      for (int r = 0; r < B; r++) {
        data.window(order.window((step * accum + micro) * B + r), in.data(), tg.data());
        EXPECT_TRUE(std::equal(in.begin(), in.end(), b.inputs.begin() + r * T));
        EXPECT_TRUE(std::equal(tg.begin(), tg.end(), b.targets.begin() + r * T));
      }
    }
}

// prefetch = N: N batches ready ahead, also while the consumer holds the one next() returned,
// and N x B rows read ahead of those.
TEST_F(DataTest, LoaderKeepsPrefetchBatchesAndRowsReadyAhead) {
  write_token_shard(path("p.bin"), ramp(5001, 256), 256);
  Dataset data({path("p.bin")}, 256, 16);
  const int B = 2;
  auto settle = [&](DataLoader& loader, int prefetch) {  // the stages fill their queues
    for (int i = 0;
         i < 500 && (loader.ready_batches() < prefetch || loader.ready_rows() < prefetch * B); i++)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // and stop there
    return std::pair(loader.ready_batches(), loader.ready_rows());
  };
  for (int prefetch : {1, 3}) {
    SCOPED_TRACE(prefetch);
    DataLoader loader(std::span(&data, 1), BlendPlan::fresh({1}), B, 16, DataLoader::constant(1),
                      42, prefetch, 0);
    EXPECT_EQ(settle(loader, prefetch), std::pair(prefetch, prefetch * B));
    for (int step = 0; step < 3; step++) {
      loader.next();
      EXPECT_EQ(settle(loader, prefetch), std::pair(prefetch, prefetch * B));
    }
  }
}

// An error inside the loader's thread reaches the consumer (not std::terminate in that thread):
// here a blend that starts after the first sample asked for.
TEST_F(DataTest, AnErrorInTheLoaderIsRethrownByNext) {
  write_token_shard(path("e.bin"), ramp(501, 256), 256);
  std::vector<Dataset> sources;
  sources.emplace_back(std::vector<std::string>{path("e.bin")}, 256, 16);
  sources.emplace_back(std::vector<std::string>{path("e.bin")}, 256, 16);
  BlendPlan plan = BlendPlan::fresh({1, 1});
  plan.start = 100;
  DataLoader loader(sources, plan, 2, 16, DataLoader::constant(1), 1, 2, 0);
  EXPECT_THROW(loader.next(), std::logic_error);
}

TEST_F(DataTest, ShardsDoNotShareWindows) {
  write_token_shard(path("s1.bin"), ramp(25, 256), 256);
  write_token_shard(path("s2.bin"), ramp(35, 200), 256);
  Dataset data({path("s1.bin"), path("s2.bin")}, 256, 8);
  EXPECT_EQ(data.windows(), 3 + 4);
  EXPECT_EQ(data.tokens(), 60);
}

// The blend hits its weights over any stretch of samples (to within one sample per source), is
// a pure function of the sample index, and does not depend on the weights' scale.
TEST_F(DataTest, BlendHitsItsWeightsAndIsPureInTheSampleIndex) {
  BlendOrder order(BlendPlan::fresh({5, 3, 2}));
  std::vector<int64_t> counts(3, 0);
  for (int64_t i = 0; i < 10000; i++) {
    const BlendOrder::Pick p = order.at(i);
    ASSERT_EQ(p.index, counts[p.source]) << "sample " << i;
    counts[p.source]++;
    const double share[] = {0.5, 0.3, 0.2};
    for (int s = 0; s < 3; s++) {
      ASSERT_LE(std::abs(double(counts[s]) - double(i + 1) * share[s]), 1)
          << "source " << s << " after " << i + 1 << " samples";
    }
  }
  EXPECT_EQ(counts, (std::vector<int64_t>{5000, 3000, 2000}));
  EXPECT_EQ(order.positions(10000), counts);
  BlendOrder normalised(BlendPlan::fresh({0.5, 0.3, 0.2}));
  for (int64_t i : {7777, 12, 9999, 0, 4242}) {  // random access, backwards too
    const BlendOrder::Pick a = normalised.at(i), b = order.at(i);
    EXPECT_EQ(a.source, b.source);
    EXPECT_EQ(a.index, b.index);
  }
}

// New weights from a resume sample on: each source continues from its position there, and the
// new mix follows the new weights from that point.
TEST_F(DataTest, BlendWithNewWeightsContinuesEachSourceWhereItStood) {
  BlendOrder before(BlendPlan::fresh({0.5, 0.5}));
  const std::vector<int64_t> at1000 = before.positions(1000);
  BlendPlan changed = BlendPlan::fresh({0.9, 0.1});
  changed.start = 1000;
  changed.base = at1000;
  BlendOrder after(changed);
  std::vector<int64_t> next = at1000;
  for (int64_t i = 1000; i < 2000; i++) {
    const BlendOrder::Pick p = after.at(i);
    ASSERT_EQ(p.index, next[p.source]++);  // no source repeats or skips a sample
  }
  EXPECT_EQ(next, (std::vector<int64_t>{at1000[0] + 900, at1000[1] + 100}));
  EXPECT_THROW(after.at(999), std::logic_error);
}

// A known point (a checkpoint's positions) is where the order continues from, not a replay: the
// same picks as the replay when the positions are the replay's, and visibly the known ones when
// they are not (which a replay would ignore).
TEST_F(DataTest, BlendContinuesFromAKnownPointWithoutReplaying) {
  const BlendPlan plan = BlendPlan::fresh({0.5, 0.3, 0.2});
  BlendOrder replay(plan);
  BlendOrder known(plan, 7000, replay.positions(7000));
  for (int64_t i = 7000; i < 7100; i++) {
    const BlendOrder::Pick a = replay.at(i), b = known.at(i);
    ASSERT_EQ(a.source, b.source) << i;
    ASSERT_EQ(a.index, b.index) << i;
  }
  const BlendPlan even = BlendPlan::fresh({0.5, 0.5});
  BlendOrder lopsided(even, 10, {10, 0});  // a replay would stand at {5, 5}
  const BlendOrder::Pick p = lopsided.at(10);
  EXPECT_EQ(p.source, 1);
  EXPECT_EQ(p.index, 0);
  EXPECT_THROW(BlendOrder(even, 10, {6, 5}), std::logic_error);  // 11 samples, not 10
}

// The loader reads sample i from the source the blend picks, through that source's own order;
// data-parallel ranks together read what one rank reads.
TEST_F(DataTest, LoaderReadsEachSourceThroughItsOwnOrder) {
  std::vector<Dataset> sources;
  for (int k = 0; k < 3; k++) {
    write_token_shard(path(fmt::format("src{}.bin", k)), ramp(801 + 160 * k, 50 + 60 * k), 256);
    sources.emplace_back(std::vector<std::string>{path(fmt::format("src{}.bin", k))}, 256, 16);
  }
  const BlendPlan plan = BlendPlan::fresh({0.5, 0.3, 0.2});
  const int B = 2, T = 16, steps = 6;
  BlendOrder blend(plan);
  std::vector<SampleOrder> orders;
  for (int k = 0; k < 3; k++) orders.emplace_back(sources[k].windows(), source_seed(9, k));
  const DataLoader::AccumOf one_micro = DataLoader::constant(1);
  DataLoader one(sources, plan, 2 * B, T, one_micro, 9, 2, 0);
  DataLoader rank0(sources, plan, B, T, one_micro, 9, 2, 0, 0, 2);
  DataLoader rank1(sources, plan, B, T, one_micro, 9, 2, 0, 1, 2);
  std::vector<int32_t> in(T), tg(T);
  std::set<int> used;
  for (int step = 0; step < steps; step++) {
    const Batch& all = one.next();
    const Batch& a = rank0.next();
    const Batch& b = rank1.next();
    for (int r = 0; r < 2 * B; r++) {
      const BlendOrder::Pick p = blend.at(step * 2 * B + r);
      used.insert(p.source);
      sources[p.source].window(orders[p.source].window(p.index), in.data(), tg.data());
      ASSERT_TRUE(std::equal(in.begin(), in.end(), all.inputs.begin() + r * T));
      const Batch& half = r < B ? a : b;
      ASSERT_TRUE(std::equal(in.begin(), in.end(), half.inputs.begin() + (r % B) * T));
    }
  }
  EXPECT_EQ(used.size(), 3u);
  EXPECT_EQ(source_seed(9, 0), 9u);  // one source reads what a run without a blend always has
}

// Validation reads count * B windows spread over the whole set, not its first ones.
TEST_F(DataTest, ValidationWindowsSpanTheWholeSet) {
  write_token_shard(path("v.bin"), ramp(1001, 256), 256);
  Dataset data({path("v.bin")}, 256, 10);  // 100 windows
  Batch batch;
  std::vector<int32_t> in(10), tg(10);
  auto reads = [&](int64_t window, int row) {
    data.window(window, in.data(), tg.data());
    return std::equal(in.begin(), in.end(), batch.inputs.begin() + row * 10) &&
           std::equal(tg.begin(), tg.end(), batch.targets.begin() + row * 10);
  };
  for (int i = 0; i < 4; i++) {  // 4 batches of 2: windows 0, 12, 25, ..., 87
    validation_batch(data, i, 4, 2, 10, batch);
    for (int r = 0; r < 2; r++) EXPECT_TRUE(reads((i * 2 + r) * 100 / 8, r)) << i << " " << r;
  }
  validation_batch(data, 60, 80, 2, 10, batch);  // 160 rows of 100 windows: j * 100 / 160
  EXPECT_TRUE(reads(75, 0));
  EXPECT_TRUE(reads(75, 1));  // 121 * 100 / 160
}

// A compressed shard: `zstd -d` gives back the shard (a standard zstd file), and a run reads the
// same windows from it, decompressed into a temporary file or into the cache; a damaged cached
// copy is noticed by its hash and made again; a damaged .zst is an error naming it.
TEST_F(DataTest, CompressedShardsThroughTheCache) {
  auto tokens = ramp(5001, 256);
  write_token_shard(path("c.bin"), tokens, 256);
  compress_shard(path("c.bin"), path("c.bin.zst"));
  EXPECT_TRUE(is_zstd_file(path("c.bin.zst")));
  EXPECT_FALSE(is_zstd_file(path("c.bin")));
  auto r = test::run_command("zstd -q -d -c " + path("c.bin.zst") + " | cmp - " + path("c.bin"));
  EXPECT_EQ(r.code, 0) << r.output;

  const Dataset plain({path("c.bin")}, 256, 16);
  auto same_windows = [&](const Dataset& d) {
    std::vector<int32_t> a(16), b(16), c(16), e(16);
    for (int64_t w = 0; w < plain.windows(); w++) {
      plain.window(w, a.data(), b.data());
      d.window(w, c.data(), e.data());
      if (a != c || b != e) return false;
    }
    return d.windows() == plain.windows();
  };
  const Dataset uncached({path("c.bin.zst")}, 256, 16);
  EXPECT_TRUE(same_windows(uncached));
  EXPECT_EQ(uncached.describe(), "1 shard, trainer format; 1 zstd-compressed, decompressed");

  const std::string cache = path("cache");
  EXPECT_EQ(decompress_shard(path("c.bin.zst"), cache).how, "decompressed into the cache");
  const DecompressedShard again = decompress_shard(path("c.bin.zst"), cache);
  EXPECT_EQ(again.how, "from the cache");
  EXPECT_FALSE(again.temporary);
  EXPECT_TRUE(again.path.starts_with(cache + "/c-")) << again.path;
  const Dataset cached({path("c.bin.zst")}, 256, 16, false, cache);
  EXPECT_TRUE(same_windows(cached));
  EXPECT_EQ(cached.describe(), "1 shard, trainer format; 1 zstd-compressed, from the cache");
  for (const char* damage : {"flip", "truncate"}) {
    if (std::string(damage) == "flip") {
      std::fstream f(again.path, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(1000);
      f.put('\x7f');
    } else {
      fs::resize_file(again.path, 4000);
    }
    EXPECT_EQ(decompress_shard(path("c.bin.zst"), cache).how,
              "decompressed again into the cache (the cached copy was damaged)")
        << damage;
    EXPECT_EQ(test::run_command("cmp " + again.path + " " + path("c.bin")).code, 0) << damage;
  }

  // A flipped byte inside the compressed data.
  std::ifstream in(path("c.bin.zst"), std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  bytes[bytes.size() / 2] ^= 0x55;
  write_bytes("bad.bin.zst", bytes.data(), bytes.size());
  try {
    Dataset({path("bad.bin.zst")}, 256, 16, false, path("cache2"));
    FAIL();
  } catch (const DataError& e) {
    EXPECT_TRUE(std::string(e.what()).starts_with(path("bad.bin.zst") + ": ")) << e.what();
  }
}

// A killed process leaves its temporary beside the cached shard: one not written for ten minutes
// is removed the next time the shard is opened; a fresh one (a live decompression's) stays.
TEST_F(DataTest, StaleDecompressionTemporariesLeaveTheCache) {
  write_token_shard(path("t.bin"), ramp(2001, 256), 256);
  compress_shard(path("t.bin"), path("t.bin.zst"));
  const std::string cached = decompress_shard(path("t.bin.zst"), path("cache")).path;
  const std::string stale = cached + ".a1b2c3.tmp", live = cached + ".d4e5f6.tmp";
  std::ofstream(stale) << "x";
  std::ofstream(live) << "x";
  fs::last_write_time(stale, fs::file_time_type::clock::now() - std::chrono::minutes(11));
  EXPECT_EQ(decompress_shard(path("t.bin.zst"), path("cache")).how, "from the cache");
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(cached));
}

// A set's last shard may be shorter than a window (prepare --shard-tokens): it adds none, and
// the start-up says so; a set with no window at all is an error.
TEST_F(DataTest, AShardShorterThanAWindowAddsNone) {
  write_token_shard(path("long.bin"), ramp(101, 256), 256);
  write_token_shard(path("short.bin"), ramp(7, 256), 256);
  const Dataset d({path("long.bin"), path("short.bin")}, 256, 10);
  EXPECT_EQ(d.windows(), 10);
  EXPECT_EQ(d.describe(), "2 shards, trainer format; 1 shorter than a window, unused");
  try {
    Dataset({path("short.bin")}, 256, 10);
    FAIL();
  } catch (const DataError& e) {
    EXPECT_EQ(std::string(e.what()),
              path("short.bin") + ": 7 tokens are fewer than one window of seq_len + 1 = 11");
  }
}

// The data-wait warning fires after `steps` consecutive starved steps, and again only after as
// many more; a step fed in time starts the count afresh.
TEST_F(DataTest, DataWaitWatchCountsConsecutiveStarvedSteps) {
  DataWaitWatch watch(0.05, 3);
  std::vector<bool> fired;
  for (double wait : {0.1, 0.1, 0.01, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.06})
    fired.push_back(watch.starved(wait, 1.0));
  EXPECT_EQ(fired, (std::vector<bool>{false, false, false, false, false, true, false, false, true,
                                      false}));
}

// A batch ramp by steps or by tokens: each step's accumulation follows the table, and the data
// position of any step is the same computed from the start or from any step before it (a resume).
TEST_F(DataTest, BatchRampByStepsAndByTokens) {
  TrainConfig t;
  t.micro_batch = 2;
  t.batch_ramp = {{0, 4}, {3, 8}, {6, 16}};
  const BatchSchedule steps(t, 16, 2, "run.toml");
  EXPECT_EQ(steps.max_accum(), 4);
  std::vector<int> accum;
  int64_t samples = 0;
  for (int64_t step = 0; step < 9; step++) {
    EXPECT_EQ(steps.samples_at(step, 0, 0), samples);
    for (int64_t from = 0; from < step; from++)
      EXPECT_EQ(steps.samples_at(step, from, steps.samples_at(from, 0, 0)), samples);
    accum.push_back(steps.accum(step, samples));
    samples += accum.back() * 4;
  }
  EXPECT_EQ(accum, (std::vector<int>{1, 1, 1, 2, 2, 2, 4, 4, 4}));
  EXPECT_EQ(steps.samples_at(1000, 0, 0), 3 * 4 + 3 * 8 + 994 * 16);

  // By tokens: 4-sequence steps until 12 x 16 tokens are seen, then 8 until 40 x 16, then 16.
  t.batch_ramp = {{0, 4}, {12 * 16, 8}, {40 * 16, 16}};
  t.batch_ramp_unit = "tokens";
  const BatchSchedule tokens(t, 16, 2, "run.toml");
  accum.clear();
  samples = 0;
  for (int64_t step = 0; step < 9; step++) {
    EXPECT_EQ(tokens.samples_at(step, 0, 0), samples);
    if (step > 2) {
      EXPECT_EQ(tokens.samples_at(step, 2, tokens.samples_at(2, 0, 0)), samples);
    }
    accum.push_back(tokens.accum(step, samples));
    samples += accum.back() * 4;
  }
  EXPECT_EQ(accum, (std::vector<int>{1, 1, 1, 2, 2, 2, 2, 4, 4}));  // 12, then 20..44 samples

  t.batch_ramp = {{0, 2}, {3, 8}};
  try {
    BatchSchedule(t, 16, 2, "run.toml");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "run.toml: [train] batch_ramp: 2 sequences at 0 tokens do not divide into "
              "micro-batches of 2 sequences on each of dp = 2 ranks (a multiple of 4 is needed)");
  }
}

}  // namespace
}  // namespace trainer
