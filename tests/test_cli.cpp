// The binary as a user runs it: subcommands, exit codes and one-line errors, end-to-end
// training on real text, determinism across runs, and generation from the checkpoint.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>

#include "comm/parallel_dims.h"
#include "io/config.h"
#include "kernels/kernels.h"
#include "model/param_table.h"
#include "test_util.h"
#include "trainer/gpu_health.h"
#include "trainer/memory_budget.h"
#include "trainer/planner.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;

using Result = test::CommandResult;
Result run(const std::string& args) {
  return test::run_command(test::trainer_bin() + " " + args);
}

class Cli : public test::TempDirTest {
 protected:
  // Byte-level shards from a real excerpt of Pride and Prejudice.
  void prepare_data() {
    const Result r = run("prepare --input " + test::source_dir() +
                         "/tests/data/pride_and_prejudice_opening.txt --out-dir " + path("data"));
    ASSERT_EQ(r.code, 0) << r.output;
  }
  std::string write_config(const std::string& name, const std::string& out_dir, int steps) {
    std::ofstream(path(name)) << "[run]\nout_dir = \"" << path(out_dir) << "\"\nseed = 5\n"
                              << "[model]\nseq_len = 32\nn_layer = 2\nn_head = 2\nd_model = 32\n"
                              << "[data]\ntrain = \"" << path("data/train.bin") << "\"\nval = \""
                              << path("data/val.bin") << "\"\n"
                              << "[train]\nmicro_batch = 4\ngrad_accum = 2\nsteps = " << steps
                              << "\nval_every = 10\nval_batches = 2\nsample_every = 15\n"
                              << "sample_tokens = 20\nlog_every = 10\n"
                              << "[optim]\nlr = 1e-2\nwarmup_steps = 5\n";
    return path(name);
  }
  static std::vector<std::string> losses(const std::string& metrics) {
    std::vector<std::string> out;
    std::ifstream in(metrics);
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line);
      if (j.contains("loss")) out.push_back(j["loss"].dump());  // full precision text
    }
    return out;
  }
};

TEST_F(Cli, HelpAndVersion) {
  Result r = run("--help");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.output.find("train"), std::string::npos);
  EXPECT_NE(r.output.find("generate"), std::string::npos);
  EXPECT_NE(r.output.find("prepare"), std::string::npos);
  r = run("--version");
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(r.output.rfind("trainer 0.1.0", 0), 0u) << r.output;
  r = run("train --help");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.output.find("--set"), std::string::npos);
}

TEST_F(Cli, BadCommandLinesExitTwoWithOneLine) {
  for (const char* args : {"", "fly", "train", "train a.toml --bogus", "generate --tokens 5"}) {
    const Result r = run(args);
    EXPECT_EQ(r.code, 2) << args << ": " << r.output;
    EXPECT_EQ(r.output.rfind("trainer: error: ", 0), 0u) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  }
}

// trainer plan on 8 x 80 GB GPUs: GPT-2 1.5B and Llama-3-8B fit (exit 0, the best as config);
// Llama-3-70B does not unless the optimizer is offloaded (exit 2, saying so and what would fit
// with it); --explain names the layouts the model rules out; a GPU it does not know is refused.
TEST_F(Cli, PlanFitsKnownModelsAndSaysWhatWouldFit) {
  const std::string configs = test::source_dir() + "/configs/";
  for (const char* model : {"gpt2-1.5b", "llama3-8b"}) {
    const Result r = run("plan " + configs + model + ".toml --gpus 8 --explain");
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("choices fit; the fastest:"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("the best, as config:\n\n[parallel]\ndp = "), std::string::npos)
        << r.output;
  }
  EXPECT_NE(run("plan " + configs + "gpt2-1.5b.toml --gpus 8 --explain")
                .output.find("[parallel] tp = 2 must divide n_head = 25"),
            std::string::npos);
  Result r = run("plan " + configs + "llama3-70b.toml --gpus 8");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("trainer: plan: nothing fits: every choice needs more than the 72.0 GB"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("with [memory] offload_optimizer = true, "), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("[memory]\nrecompute = \"full\"\noffload_optimizer = true\n"),
            std::string::npos)
      << r.output;
  r = run("plan " + configs + "llama3-8b.toml --gpus 8 --gpu x100");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(
      r.output,
      "trainer: config error: --gpu: \"x100\" is neither a known GPU (h100, h200, a100, b200, "
      "l40s) nor TFLOP/s\n");
}

TEST_F(Cli, ConfigErrorsExitTwo) {
  Result r = run("train " + path("missing.toml"));
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.output,
            "trainer: config error: " + path("missing.toml") + ": cannot open config file\n");
  std::ofstream(path("bad.toml")) << "[train]\nsteps = 10\nstepz = 3\n";
  r = run("train " + path("bad.toml"));
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.output,
            "trainer: config error: " + path("bad.toml") + ":3:1: [train] stepz: unknown key\n");
  r = run("train " + path("bad.toml") + " --set train.stepz=1");
  EXPECT_EQ(r.code, 2);
  r = run("train " + path("bad.toml") + " --set model.n_head=x");
  EXPECT_EQ(r.output,
            "trainer: config error: --set model.n_head=x: [model] n_head: expected an integer, "
            "found a string\n");
}

// device = "cuda" where CUDA cannot run (a build without nvcc, or no GPU): a config error
// naming the key, not a crash; and the GPU settings are validated like every other key.
TEST_F(Cli, CudaWithoutAGpuIsAConfigError) {
  if (cuda_device_count() > 0)
    GTEST_SKIP() << "a GPU is visible: tests/test_cuda_cli.cpp trains on it";
  prepare_data();
  const std::string config = write_config("run.toml", "out", 2);
  Result r = run("train " + config + " --set run.device=\"cuda\"");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("trainer: config error: " + config + ": [run] device = \"cuda\", but "),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(std::filesystem::exists(path("out/metrics.jsonl")));
  r = run("train " + config + " --set run.device=\"tpu\"");
  EXPECT_EQ(r.code, 2) << r.output;
  r = run("train " + config + " --set run.gpu_memory_fraction=1.5");
  EXPECT_EQ(r.code, 2) << r.output;
  r = run("train " + config + " --set run.gpu_collectives=\"gloo\"");
  EXPECT_EQ(r.code, 2) << r.output;
}

TEST_F(Cli, DataErrorsExitTwoAndWriteNothing) {
  prepare_data();
  const std::string cfg = write_config("run.toml", "out", 5);
  std::ofstream(path("junk.bin")) << "garbage!!";  // odd size: not even headerless uint16
  Result r = run("train " + cfg + " --set data.train=" + path("junk.bin"));
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(
      r.output.rfind("trainer: data error: " + path("junk.bin") + ": offset 0: unrecognised", 0),
      0u)
      << r.output;
  fs::copy_file(path("data/train.bin"), path("cut.bin"));
  fs::resize_file(path("cut.bin"), fs::file_size(path("cut.bin")) - 3);
  r = run("train " + cfg + " --set data.train=" + path("cut.bin"));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("(truncated)"), std::string::npos) << r.output;
  r = run("train " + cfg + " --set data.val=" + path("nope.bin"));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("nope.bin: cannot open data file"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(path("out"))) << "a failed start must not leave a run directory";
  r = run("prepare --input " + path("absent.txt") + " --out-dir " + path("d2"));
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.output,
            "trainer: data error: " + path("absent.txt") + ": cannot open input text file\n");
}

// A Megatron .idx that does not match its .bin (issue 20): exit 2, one line naming the .idx.
TEST_F(Cli, MegatronIndexNotMatchingItsBinExitsTwo) {
  const Result w =
      test::write_megatron("[(\"" + path("m") + "\", \"uint16\", [[list(range(100))] * 3])]");
  ASSERT_EQ(w.code, 0) << w.output;
  fs::resize_file(path("m.bin"), 598);  // one token short
  const std::string cfg = write_config("run.toml", "out", 5);
  const Result r = run("train " + cfg + " --set data.train=" + path("m.idx") +
                       " --set data.val=" + path("m.idx"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(r.output, "trainer: data error: " + path("m.idx") +
                          ": sequence lengths sum to 300 tokens (600 bytes of uint16), but " +
                          path("m.bin") + " has 598 bytes\n");
  EXPECT_FALSE(fs::exists(path("out")));
}

// Inputs that are not regular files: a FIFO as a shard would block forever in open(), a device
// as an input text would be read without end. Each is one line naming it, exit 2.
TEST_F(Cli, SpecialFilesAreRefused) {
  prepare_data();
  const std::string cfg = write_config("run.toml", "out", 5);
  ASSERT_EQ(mkfifo(path("fifo.bin").c_str(), 0600), 0);
  Result r = test::run_command("timeout 20 " + test::trainer_bin() + " train " + cfg +
                               " --set data.train=" + path("fifo.bin"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(r.output, "trainer: data error: " + path("fifo.bin") +
                          ": not a regular file (a FIFO): a data shard must be one\n");
  r = run("train " + cfg + " --set data.val=" + path("data"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find(path("data") + ": not a regular file (a directory)"), std::string::npos)
      << r.output;
  r = test::run_command("timeout 20 " + test::trainer_bin() +
                        " prepare --input /dev/zero --out-dir " + path("d"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(r.output,
            "trainer: data error: /dev/zero: not a regular file (a character device): "
            "an input text file must be one\n");
  EXPECT_FALSE(fs::exists(path("out")));
}

// Numeric options are range-checked with NaN and the infinities refused (CLI::Range alone lets
// NaN through): exit 2 with one line.
TEST_F(Cli, NonFiniteNumbersAreRefused) {
  for (const std::string args :
       {"generate --checkpoint x --temperature nan", "generate --checkpoint x --temperature inf",
        "generate --checkpoint x --temperature 1e999",
        "prepare --input x --out-dir y --val-fraction nan",
        "prepare --input x --out-dir y --val-fraction -inf"}) {
    const Result r = run(args);
    EXPECT_EQ(r.code, 2) << args << ": " << r.output;
    EXPECT_NE(r.output.find("expected a finite number in ["), std::string::npos) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  }
  // Bounds are printed readably (CLI::NonNegativeNumber printed 309 digits of DBL_MAX).
  const Result r = run("generate --checkpoint x --top-k -3");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(r.output,
            "trainer: error: --top-k: Value -3 not in range 0 to 16777216 (see trainer --help)\n");
}

// A model that cannot fit is refused before anything is allocated (it grew for 30 s before),
// with what it needs and what is available, per rank.
TEST_F(Cli, AModelThatCannotFitIsRefusedUpFront) {
  prepare_data();
  const std::string cfg = write_config("run.toml", "out", 5);
  const auto t0 = std::chrono::steady_clock::now();
  const Result r = test::run_command("timeout 60 " + test::trainer_bin() + " train " + cfg +
                                     " --set model.d_model=65536");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_LT(seconds, 10);
  EXPECT_EQ(r.output.rfind("trainer: config error: " + cfg + ": the run needs ", 0), 0u)
      << r.output;
  EXPECT_NE(r.output.find(" GB on rank 0 (weights "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("GB is available to it (MemAvailable shared by 1 rank(s) on this node)"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  EXPECT_FALSE(fs::exists(path("out")));
}

TEST_F(Cli, TrainsDeterministicallyAndGenerates) {
  prepare_data();
  ASSERT_EQ(run("train " + write_config("a.toml", "a", 30)).code, 0);
  const Result r = run("train " + write_config("b.toml", "b", 30));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("val loss"), std::string::npos);
  EXPECT_NE(r.output.find("sample:"), std::string::npos);

  const auto a = losses(path("a/metrics.jsonl")), b = losses(path("b/metrics.jsonl"));
  ASSERT_EQ(a.size(), 30u);
  EXPECT_EQ(a, b) << "two runs of the same config must give bitwise identical losses";
  EXPECT_LT(std::stod(a.back()), std::stod(a.front()) - 1.5) << "loss must fall";
  EXPECT_TRUE(fs::exists(path("a/config.toml")));
  EXPECT_TRUE(fs::exists(path("a/checkpoints/step_00000030/state.h5")));

  Result g = run("generate --checkpoint " + path("a") + " --prompt \"It is\" --tokens 40 --seed 3");
  ASSERT_EQ(g.code, 0) << g.output;
  EXPECT_EQ(g.output.rfind("It is", 0), 0u);
  EXPECT_EQ(g.output, run("generate --checkpoint " + path("a/checkpoints/step_00000030") +
                          " --prompt \"It is\" --tokens 40 --seed 3")
                          .output);
}

TEST_F(Cli, GenerateRejectsBadCheckpoints) {
  Result r = run("generate --checkpoint " + path("nothing"));
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.output, "trainer: checkpoint error: " + path("nothing") + ": no such checkpoint\n");
  fs::create_directories(path("ck/checkpoints/step_00000001"));
  std::ofstream(path("ck/checkpoints/step_00000001/state.h5")) << "truncated";
  r = run("generate --checkpoint " + path("ck/checkpoints/step_00000001"));
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.output,
            "trainer: checkpoint error: " + path("ck/checkpoints/step_00000001/state.h5") +
                ": cannot open as an HDF5 file\n");
}

// A log redirected to a file shows each step as it happens: step 5's line is in the file within
// a second of step 5's metrics record, while the run goes on (stdout is line-buffered), and
// says where the run stands (step/total, elapsed, ETA); the record carries the wall clock and
// the tokens so far.
TEST_F(Cli, RedirectedLogIsLiveAndSaysWhereTheRunStands) {
  prepare_data();
  const std::string config = write_config("live.toml", "live", 100000);
  const std::string log = path("live.log"), metrics = path("live/metrics.jsonl");
  const Result r = test::run_command(
      "(" + test::trainer_bin() + " train " + config + " --set train.log_every=1 >" + log +
      " 2>&1 & pid=$!; for i in $(seq 1 1000); do grep -q '\"step\":5,' " + metrics +
      " 2>/dev/null && break; sleep 0.01; done; sleep 1; cp " + log + " " + log +
      ".at5; kill $pid 2>/dev/null && echo still-running; wait $pid)");
  EXPECT_NE(r.output.find("still-running"), std::string::npos) << "the run ended too soon";
  std::ifstream in(log + ".at5");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("step      5/100000 | loss"), std::string::npos) << text << r.output;
  EXPECT_NE(text.find(" elapsed, ETA "), std::string::npos) << text;
  std::ifstream m(metrics);
  double last_time = 0;
  for (std::string line; std::getline(m, line);) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("loss")) continue;
    EXPECT_EQ(j["tokens"], (int64_t(j["step"]) + 1) * 4 * 2 * 32) << line;  // B x accum x T
    EXPECT_GE(double(j["time"]), last_time);
    EXPECT_GT(double(j["time"]), 1.7e9);  // seconds since 1970: after 2023
    last_time = j["time"];
  }
}

// A model whose vocabulary is not the 256 bytes, with the bytes tokenizer: its samples and
// generate print token ids, never bytes of id & 0xFF, and a text prompt for it is an error.
TEST_F(Cli, NonByteVocabularyPrintsTokenIds) {
  prepare_data();
  const std::string config = write_config("v512.toml", "v512", 2);
  Result r = run("train " + config +
                 " --set model.vocab_size=512 --set train.sample_every=1 --set train.val_every=0");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("step      0 | sample (token ids after token 0: a vocabulary of 512 "
                          "tokens has no tokenizer): "),
            std::string::npos)
      << r.output;
  auto all_ids = [](const std::string& line, int vocab) {
    std::istringstream in(line);
    int n = 0;
    for (std::string word; in >> word; n++)
      if (word.find_first_not_of("0123456789") != std::string::npos || std::stoi(word) >= vocab)
        return -1;
    return n;
  };
  std::ifstream m(path("v512/metrics.jsonl"));
  int samples = 0;
  for (std::string line; std::getline(m, line);) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("sample")) continue;
    samples++;
    EXPECT_EQ(all_ids(j["sample"], 512), 20) << line;  // sample_tokens = 20
  }
  EXPECT_EQ(samples, 3);
  r = run("generate --checkpoint " + path("v512") + " --tokens 12 2>/dev/null");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(all_ids(r.output, 512), 12) << r.output;
  r = run("generate --checkpoint " + path("v512") + " --prompt Hello");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("has a vocabulary of 512 tokens, not the 256 bytes"), std::string::npos)
      << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
}

}  // namespace
}  // namespace trainer

namespace trainer {
namespace {

// The planner's step-time model follows each layout choice it ranks by (each of these fails when
// its term is disconnected): the 1F1B bubble grows as micro-batches fall, and is the other
// stages' time while the slowest (the head's) works; it hides in co-located ranks' compute when
// a node's cores are oversubscribed twice, unless one micro-batch has the stages take turns;
// full recomputation runs the blocks' forward again (a third of their compute, not the head's);
// a reduction that may not overlap backward is all exposed, as is one on oversubscribed cores
// (no core is spare, and the ranks share the bandwidth, unless the figure was measured with them
// sharing it); a pipeline runs at its slowest stage's pace.
TEST(Planner, StepEstimateFollowsTheLayout) {
  const Config base = load_config(test::source_dir() + "/configs/llama-125m.toml");
  PlanOptions o;
  o.cluster.devices = 4;
  o.cluster.per_node = 4;
  o.cluster.peak_flops = 1e12;
  auto estimate = [&](int dp, int tp, int pp, int micro_batch, int accum,
                      const std::function<void(Config&)>& change = {}) {
    Config c = base;
    c.parallel.dp = dp, c.parallel.tp = tp, c.parallel.pp = pp;
    c.train.micro_batch = micro_batch, c.train.grad_accum = accum;
    if (change) change(c);
    const ParallelDims dims =
        ParallelDims::make(dp * tp * pp, dp, tp, pp, c.parallel.order, c.model);
    return estimate_layout(c, dims, o);
  };
  // (M - 1) t_max + sum t: the bubble over compute is (S / imbalance - 1) / M ((S - 1) / M for
  // balanced stages).
  const double imbalance = pipeline_imbalance(base.model, 4);
  ASSERT_GT(imbalance, 1.05);  // 12 blocks in 4 stages, the head (32000 x 768) on the last
  const Candidate pp1 = estimate(1, 1, 4, 8, 1), pp8 = estimate(1, 1, 4, 1, 8);
  EXPECT_NEAR(pp1.bubble_s / pp1.compute_s, (4 / imbalance - 1) / 1, 1e-9);
  EXPECT_NEAR(pp8.bubble_s / pp8.compute_s, (4 / imbalance - 1) / 8, 1e-9);
  const Candidate dp4 = estimate(4, 1, 1, 2, 1);
  o.cluster.oversubscription = 2;
  EXPECT_EQ(estimate(1, 1, 4, 1, 8).bubble_s, 0);
  EXPECT_NEAR(estimate(1, 1, 4, 8, 1).bubble_s, pp1.bubble_s + pp1.compute_s - 2 * dp4.compute_s,
              1e-9 * pp1.bubble_s);  // the stages in turn: each at a whole core's pace
  EXPECT_NEAR(estimate(4, 1, 1, 2, 1).compute_s, 2 * dp4.compute_s, 1e-12);
  o.cluster.oversubscription = 1;
  const Candidate full = estimate(4, 1, 1, 2, 1, [](Config& c) { c.memory.recompute = "full"; });
  const double head = pipeline_stage_shares(base.model, 1, 0)[0];  // the blocks' cost left out
  ASSERT_GT(head, 0.1);
  EXPECT_NEAR(full.compute_s, dp4.compute_s * (1 + (1 - head) / 3), 1e-12);
  o.cluster.intra_bytes_per_s = 1e9;  // slow enough that the reduction outlasts backward
  const Candidate overlapped = estimate(4, 1, 1, 2, 1),
                  exposed = estimate(4, 1, 1, 2, 1, [](Config&c) { c.parallel.overlap = false; });
  EXPECT_GT(exposed.dp_s, overlapped.dp_s);
  const double params = double(param_table(base.model).total);
  EXPECT_NEAR(exposed.dp_s, 2 * 0.75 * params * 4 / 1e9, 1e-9 * exposed.dp_s);
  o.cluster.oversubscription = 2;  // no core to spare: nothing overlaps, at half the bandwidth
  EXPECT_NEAR(estimate(4, 1, 1, 2, 1).dp_s, 2 * exposed.dp_s, 1e-9 * exposed.dp_s);
  o.cluster.intra_source = "measured";  // timed with the ranks sharing the cores: not halved
  EXPECT_NEAR(estimate(4, 1, 1, 2, 1).dp_s, exposed.dp_s, 1e-9 * exposed.dp_s);
  o.cluster.intra_source = "assumed";
  o.cluster.oversubscription = 1;
  EXPECT_GT(pipeline_imbalance(base.model, 5), 1.0);  // 12 blocks in 5 stages, the head last
  EXPECT_NEAR(estimate(1, 1, 4, 1, 8).compute_s / estimate(4, 1, 1, 1, 2).compute_s,
              pipeline_imbalance(base.model, 4), 1e-9);
}

// The bandwidth inside a node: the one given (--intra-node-gbps), else one measured among the
// node's ranks, else the default (shared memory on the CPU); Gbit/s in, bytes/s out.
TEST(Planner, BandwidthInsideANodeIsGivenMeasuredOrAssumed) {
  Cluster k;
  set_bandwidths(k, true, 8, 0, 16);
  EXPECT_EQ(k.intra_source, "given");
  EXPECT_EQ(k.intra_bytes_per_s, 1e9);
  set_bandwidths(k, true, 0, 0, 16);
  EXPECT_EQ(k.intra_source, "measured");
  EXPECT_EQ(k.intra_bytes_per_s, 2e9);
  set_bandwidths(k, true, 0, 0, 0);
  EXPECT_EQ(k.intra_source, "assumed");
  EXPECT_EQ(k.intra_bytes_per_s, 5e9);
  EXPECT_EQ(k.inter_bytes_per_s, 1.25e9);
}

// The hierarchical all-reduce's node parts of the gradients are in the memory plan: 1/node_ranks
// of the flat gradients (GradReducer's scratch), none with outer steps (which reduce inside the
// node alone) or under ZeRO-2 (its windows hold their own); in the planner's plans as in the
// trainer's.
TEST(MemoryPlan, CountsTheGradientsSummedInsideTheNode) {
  Config c = load_config(test::source_dir() + "/configs/llama-125m.toml");
  c.parallel.dp = 4, c.parallel.zero = 1, c.parallel.allreduce = "hierarchical";
  auto plan = [&](int node_ranks) {
    const ParallelDims dims = ParallelDims::make(4, 4, 1, 1, c.parallel.order, c.model);
    return memory_budget(c, dims, dims.coords(0), node_ranks);
  };
  const MemoryBudget flat = plan(0), hierarchical = plan(2);
  EXPECT_EQ(flat.node_grads, 0);
  EXPECT_NEAR(hierarchical.node_grads, double(flat.model.grads) / 2, 64);
  EXPECT_GE(hierarchical.total() - flat.total(), hierarchical.node_grads);
  c.parallel.zero = 2;
  EXPECT_EQ(plan(2).node_grads, 0);
  c.parallel.zero = 1, c.comm.outer.every_steps = 1;
  EXPECT_EQ(plan(2).node_grads, 0);
  // The planner counts them too, for consecutive ranks on nodes of the cluster's size.
  c.comm.outer.every_steps = 0;
  PlanOptions o;
  o.cluster.devices = 4, o.cluster.per_node = 2;
  const ParallelDims dims = ParallelDims::make(4, 4, 1, 1, c.parallel.order, c.model);
  EXPECT_EQ(estimate_layout(c, dims, o).memory.node_grads, hierarchical.node_grads);
  o.cluster.per_node = 4;
  EXPECT_NEAR(estimate_layout(c, dims, o).memory.node_grads, double(flat.model.grads) / 4, 64);
  c.parallel.allreduce = "flat";
  EXPECT_EQ(estimate_layout(c, dims, o).memory.node_grads, 0);
}

// NVML is optional: a library that is not there leaves the readings out with a note (the run
// goes on); a GPU's UUID is written as NVML looks it up; slowdown reasons are named, and the
// bits that are not slowdowns (idle, clock settings) are not.
TEST(GpuHealth, MissingNvmlIsANoteAndReadingsAreNamed) {
  std::array<std::byte, 16> uuid{};
  for (int i = 0; i < 16; i++) uuid[i] = std::byte(0x10 + i);
  const GpuHealth absent(uuid, "libnvidia-ml-not-here.so.1");
  EXPECT_FALSE(absent.available());
  EXPECT_NE(absent.note().find("libnvidia-ml-not-here.so.1 not found"), std::string::npos);
  EXPECT_TRUE(std::isnan(absent.read().temperature_c));
  EXPECT_EQ(GpuHealth::uuid_string(uuid), "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f");
  EXPECT_EQ(throttle_names(0x1 | 0x2 | 0x100), "");
  EXPECT_EQ(throttle_names(0x4 | 0x40), "power cap, thermal (hardware)");
}

}  // namespace
}  // namespace trainer
