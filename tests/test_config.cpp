// Config parsing: typed sections with defaults, and one clear error per kind of bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>

#include "comm/parallel_dims.h"
#include "io/config.h"
#include "test_util.h"

namespace trainer {
namespace {

// The message of the ConfigError that parsing `text` throws.
std::string error_of(const std::string& text, const std::vector<std::string>& overrides = {}) {
  try {
    parse_config(text, "run.toml", overrides);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Config, DefaultsWithoutAFile) {
  const Config c = parse_config("", "empty.toml");
  EXPECT_EQ(c.optim.name, "adamw");
  EXPECT_EQ(c.model.vocab_size, 256);
  EXPECT_EQ(c.train.grad_accum, 1);
}

TEST(Config, SeedUseCaseOptimizerBlockAsIs) {
  const Config c = parse_config(R"(
[optim]
name = "adamw"
lr = 5e-5
betas = [0.9, 0.98]
eps = 1e-6
weight_decay = 0.01
max_grad_norm = 1.0
)",
                                "seed.toml");
  EXPECT_DOUBLE_EQ(c.optim.lr, 5e-5);
  EXPECT_DOUBLE_EQ(c.optim.betas[0], 0.9);
  EXPECT_DOUBLE_EQ(c.optim.betas[1], 0.98);
  EXPECT_DOUBLE_EQ(c.optim.eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.optim.weight_decay, 0.01);
  EXPECT_DOUBLE_EQ(c.optim.max_grad_norm, 1.0);
}

TEST(Config, UnknownKeyNamesFileLineColumnAndKey) {
  EXPECT_EQ(error_of("[model]\nn_layer = 2\nn_layers = 3\n"),
            "run.toml:3:1: [model] n_layers: unknown key");
}

TEST(Config, UnknownSection) {
  EXPECT_EQ(
      error_of("[modle]\nn_layer = 2\n"),
      "run.toml:1:2: unknown section [modle] (expected run, init, model, data, tokenizer, train, "
      "optim, parallel, memory, precision, comm.compression, comm.outer, checkpoint or faults)");
}

TEST(Config, WrongType) {
  EXPECT_EQ(error_of("[train]\nsteps = \"ten\"\n"),
            "run.toml:2:9: [train] steps: expected an integer, found a string");
  EXPECT_EQ(error_of("[optim]\nbetas = [0.9]\n"),
            "run.toml:2:9: [optim] betas: expected an array of two numbers, found an array");
  EXPECT_EQ(error_of("[optim]\nlr = true\n"),
            "run.toml:2:6: [optim] lr: expected a number, found a boolean");
}

TEST(Config, OutOfRange) {
  EXPECT_EQ(error_of("[model]\nn_layer = 0\n"),
            "run.toml:2:11: [model] n_layer: must be in [1, 1024], found 0");
  EXPECT_EQ(error_of("[optim]\nbetas = [0.9, 1.5]\n"),
            "run.toml:2:9: [optim] betas: each beta must be in [0, 1), found [0.9, 1.5]");
  EXPECT_EQ(error_of("[optim]\nschedule = \"exp\"\n"),
            "run.toml:2:12: [optim] schedule: must be one of \"cosine\", \"linear\", \"constant\", "
            "found \"exp\"");
  EXPECT_EQ(error_of("[model]\nseq_len = 4294967296\n"),
            "run.toml:2:11: [model] seq_len: 4294967296 does not fit in 32 bits");
  EXPECT_EQ(error_of("[tokenizer]\nkind = \"gpt2\"\n"),
            "run.toml:2:8: [tokenizer] path: kind = \"gpt2\" needs its files, found none");
  EXPECT_EQ(error_of("[tokenizer]\nkind = \"tiktoken\"\npath = \"r.tiktoken\"\n"),
            "run.toml:2:8: [tokenizer] pattern: a tiktoken rank file needs its pre-tokenisation "
            "pattern (gpt2, cl100k or llama3), found none");
  EXPECT_EQ(error_of("[tokenizer]\nkind = \"gpt2\"\npath = \"g\"\npattern = \"cl100k\"\n"),
            "run.toml:4:11: [tokenizer] pattern: applies to kind = \"tiktoken\" only, found kind = "
            "\"gpt2\"");
  EXPECT_EQ(error_of("[model]\nseq_len = 20\n[parallel]\ncp = 4\n"),
            "run.toml:4:6: [parallel] cp = 4 cuts each sequence into 2 x cp = 8 chunks: "
            "model.seq_len = 20 is not a multiple of it");
  EXPECT_EQ(error_of("[run]\ndevice = \"cuda\"\n[parallel]\ncp = 2\n"),
            "run.toml:4:6: [parallel] cp = 2: context parallelism (ring attention) runs on the CPU "
            "backend only; the CUDA backend has no ring-attention kernels yet");
  EXPECT_EQ(error_of("[memory]\nrecompute = \"some\"\n"),
            "run.toml:2:13: [memory] recompute: must be one of \"none\", \"selective\", "
            "\"full\", found \"some\"");
}

TEST(Config, CrossFieldChecksNameTheKeys) {
  EXPECT_EQ(error_of("[model]\nd_model = 100\nn_head = 3\n"),
            "run.toml:3:10: [model] n_head: n_head = 3 must divide d_model = 100");
  EXPECT_EQ(error_of("[optim]\nlr = 1e-4\nmin_lr = 1e-3\n"),
            "run.toml:3:10: [optim] min_lr: min_lr = 0.001 must not exceed lr = 0.0001");
}

TEST(Config, SamplePromptMustFitTheVocabulary) {
  EXPECT_EQ(error_of("[model]\nvocab_size = 65\n[train]\nsample_prompt = \"\u00e9\"\n"),
            "run.toml:4:17: [train] sample_prompt: byte 195 is outside the vocabulary "
            "(vocab_size = 65)");
}

TEST(Config, InvalidToml) {
  EXPECT_TRUE(error_of("[model\nn_layer = 2\n").starts_with("run.toml:1:7: invalid TOML: "))
      << error_of("[model\nn_layer = 2\n");
}

TEST(Config, OverridesUseTheSameRules) {
  const Config c =
      parse_config("[model]\nn_layer = 2\n", "run.toml",
                   {"model.n_layer=6", "run.out_dir=runs/x", "optim.betas=[0.8, 0.9]"});
  EXPECT_EQ(c.model.n_layer, 6);
  EXPECT_EQ(c.run.out_dir, "runs/x");  // a bare word is a string
  EXPECT_DOUBLE_EQ(c.optim.betas[0], 0.8);
  EXPECT_EQ(error_of("", {"model.n_layer=abc"}),
            "--set model.n_layer=abc: [model] n_layer: expected an integer, found a string");
  EXPECT_EQ(error_of("", {"model.n_layers=2"}),
            "--set model.n_layers=2: [model] n_layers: unknown key");
  EXPECT_EQ(error_of("", {"nolayers"}), "--set nolayers: expected section.key=value");
  EXPECT_EQ(
      error_of("", {"modle.n_layer=2"}),
      "--set modle.n_layer=2: unknown section [modle] (expected run, init, model, data, tokenizer, "
      "train, optim, parallel, memory, precision, comm.compression, comm.outer, checkpoint or "
      "faults)");
  EXPECT_EQ(error_of("[model]\nd_model = 64\n", {"model.n_head=5"}),
            "--set model.n_head=5: [model] n_head: n_head = 5 must divide d_model = 64");
}

TEST(Config, LlamaModel) {
  const Config c = parse_config(R"(
[model]
arch = "llama"
d_model = 64
n_head = 8
n_kv_head = 2
ffn_dim_multiplier = 1.3
multiple_of = 32
rope_theta = 500000.0
rope_scaling_factor = 8.0
)",
                                "llama.toml");
  EXPECT_EQ(c.model.arch, Arch::llama);
  EXPECT_FALSE(c.model.tie_embeddings);  // Llama's default
  EXPECT_EQ(c.model.kv_heads(), 2);
  EXPECT_EQ(c.model.ffn(), 224);  // 2/3 of 256 = 170, x 1.3 = 221, up to a multiple of 32
  EXPECT_EQ(c.model.rope_theta, 500000.0);
  EXPECT_EQ(c.model.rope_scaling.factor, 8.0);
  EXPECT_TRUE(parse_config("", "gpt2.toml").model.tie_embeddings);  // GPT-2's
  // The resolved config carries every Llama key and reads back to the same model.
  const Config back = parse_config(config_to_toml(c), "resolved.toml");
  EXPECT_EQ(back.model.kv_heads(), 2);
  EXPECT_EQ(back.model.ffn(), 224);
  EXPECT_EQ(back.model.rope_scaling, c.model.rope_scaling);
  EXPECT_EQ(config_to_toml(back), config_to_toml(c));
}

TEST(Config, LlamaErrorsNameTheKey) {
  EXPECT_EQ(error_of("[model]\nn_kv_head = 2\n"),
            "run.toml:2:13: [model] n_kv_head: applies to arch = \"llama\" only (this model is "
            "arch = \"gpt2\")");
  EXPECT_EQ(error_of("[model]\narch = \"llama\"\nn_head = 4\nn_kv_head = 3\n"),
            "run.toml:4:13: [model] n_kv_head: n_kv_head = 3 must divide n_head = 4 (each "
            "key/value head serves a group of query heads)");
  EXPECT_EQ(error_of("[model]\narch = \"llama\"\nd_model = 36\nn_head = 4\n"),
            "run.toml:4:10: [model] n_head: the head size d_model / n_head = 9 must be even "
            "(rotary embeddings rotate pairs)");
  EXPECT_NE(error_of("[model]\narch = \"mamba\"\n").find("arch"), std::string::npos);
  EXPECT_EQ(error_of("[model]\narch = \"llama\"\nbias = true\n"),
            "run.toml:3:8: [model] bias: applies to arch = \"gpt2\" only (this model is arch = "
            "\"llama\")");
  EXPECT_FALSE(parse_config("[model]\nbias = false\n", "gpt2.toml").model.bias);
}

TEST(Config, ResolvedConfigRoundTrips) {
  Config c = parse_config("[model]\nn_layer = 3\n[data]\ntrain = [\"a.bin\", \"b.bin\"]\n",
                          "a.toml", {"optim.lr=0.01", "train.sample_prompt=Once upon"});
  const Config back = parse_config(config_to_toml(c), "resolved.toml");
  EXPECT_EQ(back.model.n_layer, 3);
  EXPECT_EQ(back.data.train, (std::vector<std::string>{"a.bin", "b.bin"}));
  EXPECT_DOUBLE_EQ(back.optim.lr, 0.01);
  EXPECT_EQ(back.train.sample_prompt, "Once upon");
  EXPECT_EQ(config_to_toml(back), config_to_toml(c));
}

// [[data.sources]]: a blend of training sources with weights, read back from the resolved config;
// each mistake is one line naming the key.
TEST(Config, DataSourcesBlend) {
  const Config c = parse_config(R"([data]
[[data.sources]]
path = "web_*.bin"
weight = 0.5
[[data.sources]]
path = ["code_0.bin", "code_1.bin"]
weight = 3
)",
                                "blend.toml");
  ASSERT_EQ(c.data.sources.size(), 2u);
  EXPECT_EQ(c.data.sources[1].path, (std::vector<std::string>{"code_0.bin", "code_1.bin"}));
  EXPECT_EQ(c.data.sources[1].weight, 3.0);
  EXPECT_EQ(training_sources(c.data), c.data.sources);
  const Config back = parse_config(config_to_toml(c), "resolved.toml");
  EXPECT_EQ(back.data.sources, c.data.sources);
  EXPECT_EQ(config_to_toml(back), config_to_toml(c));
  // Without a blend, `train` is the one source.
  EXPECT_EQ(training_sources(parse_config("", "d.toml").data),
            (std::vector<DataSource>{{{"data/austen/train.bin"}, 1.0}}));

  EXPECT_EQ(error_of("[data]\ntrain = \"a.bin\"\n[[data.sources]]\npath = \"b.bin\"\n"),
            "run.toml:2:9: [data] train: set either train or [[data.sources]] (a blend), not both");
  EXPECT_EQ(error_of("[[data.sources]]\npath = \"b.bin\"\nweight = 0\n"),
            "run.toml:3:10: [data] sources: source 0: weight must be a finite number > 0, found 0");
  EXPECT_EQ(error_of("[[data.sources]]\npath = \"b.bin\"\nweigth = 1\n"),
            "run.toml:3:1: [data] sources: source 0: unknown key \"weigth\" (expected path and "
            "weight)");
  EXPECT_EQ(
      error_of("[[data.sources]]\nweight = 1\n"),
      "run.toml:1:1: [data] sources: source 0: expected a path (shards or globs), found none");
}

// train.batch_ramp: rows [at, sequences] from 0, increasing, multiples of micro_batch; it sets
// the accumulation, so grad_accum and parallel.micro_batches are refused beside it.
TEST(Config, BatchRamp) {
  const Config c = parse_config(
      "[train]\nmicro_batch = 2\nbatch_ramp = [[0, 4], [100, 8]]\nbatch_ramp_unit = \"tokens\"\n",
      "ramp.toml");
  EXPECT_EQ(c.train.batch_ramp, (std::vector<std::array<int64_t, 2>>{{0, 4}, {100, 8}}));
  const Config back = parse_config(config_to_toml(c), "resolved.toml");
  EXPECT_EQ(back.train.batch_ramp, c.train.batch_ramp);
  EXPECT_EQ(back.train.batch_ramp_unit, "tokens");
  EXPECT_EQ(error_of("[train]\nbatch_ramp = [[5, 8]]\n"),
            "run.toml:2:14: [train] batch_ramp: the first row starts at 0, found [5, 8]");
  EXPECT_EQ(error_of("[train]\nbatch_ramp = [[0, 8], [0, 16]]\n"),
            "run.toml:2:14: [train] batch_ramp: row 1 starts at 0, expected after 0");
  EXPECT_EQ(error_of("[train]\nmicro_batch = 4\nbatch_ramp = [[0, 8], [10, 6]]\n"),
            "run.toml:3:14: [train] batch_ramp: row 1: 6 sequences, expected a positive multiple "
            "of micro_batch = 4");
  EXPECT_EQ(error_of("[train]\nbatch_ramp = [8, 16]\n"),
            "run.toml:2:15: [train] batch_ramp: expected a pair [at, value] of integers, found an "
            "integer");
  EXPECT_EQ(error_of("[train]\ngrad_accum = 2\nbatch_ramp = [[0, 8]]\n"),
            "run.toml:2:14: [train] grad_accum: the batch ramp sets the micro-batches of each "
            "step (found grad_accum = 2 and batch_ramp)");
  EXPECT_EQ(error_of("[train]\nbatch_ramp = [[0, 8]]\n[parallel]\nmicro_batches = 2\n"),
            "run.toml:4:17: [parallel] micro_batches: the batch ramp (train.batch_ramp) sets the "
            "micro-batches of each step");
}

// Every config shipped in configs/ parses, validates, and lays out on the world its comment
// asks for (dp x tp x pp ranks); where the comment states the global batch ("= N tokens per
// step"), the batch keys give exactly that.
TEST(Config, EveryShippedConfigValidates) {
  int checked = 0;
  for (const auto& e : std::filesystem::directory_iterator(test::source_dir() + "/configs")) {
    if (e.path().extension() != ".toml") continue;
    SCOPED_TRACE(e.path().string());
    const Config c = load_config(e.path().string());
    const int dp = std::max(c.parallel.dp, 1);
    EXPECT_NO_THROW(ParallelDims::make(dp * c.parallel.tp * c.parallel.pp, c.parallel.dp,
                                       c.parallel.tp, c.parallel.pp, c.parallel.order, c.model));
    std::ifstream in(e.path());
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::smatch m;
    if (std::regex_search(text, m, std::regex(R"(= ([0-9,]+) tokens per step)"))) {
      const std::string digits = std::regex_replace(m[1].str(), std::regex(","), "");
      EXPECT_EQ(int64_t(c.train.micro_batch) * c.model.seq_len * dp * c.train.grad_accum,
                std::stoll(digits));
    }
    checked++;
  }
  EXPECT_GE(checked, 9);  // tiny, llama-tiny, GPT-2 124M/350M/1.5B, Llama 125M/135M, 3 8B, 3 70B
}

TEST(Config, MissingFile) {
  try {
    load_config("/nonexistent/run.toml");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "/nonexistent/run.toml: cannot open config file");
  }
}

}  // namespace
}  // namespace trainer
