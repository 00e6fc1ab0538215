// [comm.outer] (DiLoCo / local SGD across nodes) under real mpirun: 4 ranks as two simulated
// nodes of 2 (parallel.ranks_per_node = 2).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "mpi_cli.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;

constexpr const char* kTwoNodes = "--set parallel.ranks_per_node=2 ";

// With one inner step between outer steps, an outer learning rate of 1 and no outer momentum,
// the new weights are the mean of the nodes' updated weights. Momentum SGD is linear in the
// gradients, so that mean is the update of the mean gradient: plain data parallelism over all 4
// ranks, to rounding. Without the exchange across nodes the two nodes would drift apart on
// their own data and the weights would not be these.
TEST_F(MpiCli, OuterStepsEveryStepWithSgdAreDataParallel) {
  const std::string common =
      "--set train.steps=6 --set parallel.dp=4 --set optim.name=\\\"sgd\\\" "
      "--set optim.momentum=0.9 --set optim.lr=0.05 --set optim.max_grad_norm=0 ";
  auto r = mpirun(4, common + "--set run.out_dir=" + quoted(path("dp")));
  ASSERT_EQ(r.code, 0) << r.output;
  r = mpirun(4, common + kTwoNodes +
                    "--set comm.outer.every_steps=1 --set comm.outer.lr=1 "
                    "--set comm.outer.momentum=0 --set run.out_dir=" +
                    quoted(path("outer")));
  ASSERT_EQ(r.code, 0) << r.output;
  const auto dp = steps_of(path("dp/metrics.jsonl")), outer = steps_of(path("outer/metrics.jsonl"));
  ASSERT_EQ(dp.size(), 6u);
  ASSERT_EQ(outer.size(), 6u);
  for (size_t i = 0; i < dp.size(); i++) EXPECT_NEAR(outer[i].loss, dp[i].loss, 1e-5) << i;
  EXPECT_NE(outer[5].loss, outer[0].loss);  // it trained
  for (const Crossing& c : crossings(path("outer/metrics.jsonl"))) {
    EXPECT_TRUE(c.outer) << c.step;
    EXPECT_GT(c.inter_bytes, 0) << c.step;
  }
  double worst = 0;
  for (const ParamInfo& p : param_table(cli_model()).params) {
    const auto a = checkpoint_param(path("dp/checkpoints/step_00000006/state.h5"), p.name);
    const auto b = checkpoint_param(path("outer/checkpoints/step_00000006/state.h5"), p.name);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); i++) worst = std::max(worst, double(std::abs(a[i] - b[i])));
  }
  EXPECT_LT(worst, 1e-6);
}

// Only the outer steps cross nodes (every 3 steps and after the last); int8 sends a quarter of
// fp32's bytes (and a scale per 256 values). Inside a node the steps reduce as usual.
TEST_F(MpiCli, OnlyTheOuterStepsCrossNodes) {
  const std::string common = std::string("--set train.steps=7 --set parallel.dp=4 ") + kTwoNodes +
                             "--set comm.outer.every_steps=3 ";
  auto r = mpirun(4, common + "--set run.out_dir=" + quoted(path("fp32")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "(outer step)"), 3) << r.output;  // steps 2, 5 and 6 (the last)
  r = mpirun(4, common + "--set comm.outer.quantize=\\\"int8\\\" --set run.out_dir=" +
                    quoted(path("int8")));
  ASSERT_EQ(r.code, 0) << r.output;
  const auto fp32 = crossings(path("fp32/metrics.jsonl")),
             int8 = crossings(path("int8/metrics.jsonl"));
  ASSERT_EQ(fp32.size(), 7u);
  ASSERT_EQ(int8.size(), 7u);
  for (size_t i = 0; i < fp32.size(); i++) {
    const bool due = i == 2 || i == 5 || i == 6;
    EXPECT_EQ(fp32[i].outer, due) << i;
    EXPECT_EQ(fp32[i].inter_bytes > 0, due) << i;
    EXPECT_EQ(int8[i].inter_bytes > 0, due) << i;
    if (due) {
      const double ratio = double(int8[i].inter_bytes) / double(fp32[i].inter_bytes);
      EXPECT_GT(ratio, 0.25) << i;
      EXPECT_LT(ratio, 0.27) << i;
    }
  }
}

// A resume in the middle of an outer period (step 6 of periods of 4) continues bit for bit: each
// node's own weights and moments, the outer weights, momentum and int8 residuals come back. In
// each layout: dp 4 without and with ZeRO-1, and dp 2 x tp 2 (a node holds one replica, split
// over its 2 ranks by tensor parallelism), and dp 2 x pp 2 with ZeRO-1.
TEST_F(MpiCli, OuterStepsResumeMidPeriodBitForBit) {
  const std::vector<std::pair<std::string, std::string>> layouts = {
      {"dp4", "--set parallel.dp=4 "},
      {"dp4_zero1", "--set parallel.dp=4 --set parallel.zero=1 "},
      {"dp2_tp2", "--set parallel.dp=2 --set parallel.tp=2 "},
      // A node holds a pipeline (its tied embedding's two ends in different ZeRO pieces).
      {"dp2_pp2_zero1", "--set parallel.dp=2 --set parallel.pp=2 --set parallel.zero=1 "}};
  for (const auto& [name, layout] : layouts) {
    SCOPED_TRACE(name);
    const std::string common = "--set train.steps=10 --set checkpoint.every_steps=6 " + layout +
                               kTwoNodes +
                               "--set comm.outer.every_steps=4 --set comm.outer.quantize="
                               "\\\"int8\\\" ";
    const std::string output = expect_resumes_bit_for_bit(4, common, name, 6, 10);
    EXPECT_EQ(output.find("outer state: not in the checkpoint"), std::string::npos) << output;
    expect_same_tensors(path(name + "_full/checkpoints/step_00000010/state.h5"),
                        path(name + "_resumed/checkpoints/step_00000010/state.h5"));
  }
  // Another exchange (fp32 pseudo-gradients, no residuals): the saved outer state does not
  // apply; the run says so and goes on from the first node's weights.
  const auto r = mpirun(
      4, "--set train.steps=10 --set parallel.dp=4 " + std::string(kTwoNodes) +
             "--set comm.outer.every_steps=4 --set run.out_dir=" + quoted(path("other")) +
             " --set checkpoint.resume=" + quoted(path("dp4_full/checkpoints/step_00000006")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "outer state: not in the checkpoint for this layout"), 1) << r.output;
}

// [comm] budget_ms: at 1 Gbit/s between nodes (inter_node_gbps, not measured), this model's
// step sends 22 kB across nodes with the fp32 all-reduce (0.18 ms), 11 kB with fp16 (0.09 ms),
// 5.6 kB with int8 (0.045 ms), 0.78 kB with 1-bit Adam after its int8 warm-up (0.0062 ms),
// 0.56 kB with int8 outer steps every 10 (0.0045 ms). A budget of 0.05 ms takes int8; 0.01 ms
// 1-bit Adam; 0.005 ms outer steps every 10; "auto" uses the choice, any other method only hears
// of it.
TEST_F(MpiCli, BudgetChoosesTheWayAcrossNodes) {
  const std::string common = std::string("--set train.steps=4 --set parallel.dp=4 ") + kTwoNodes +
                             "--set comm.inter_node_gbps=1 ";
  const std::string automatic = "--set comm.compression.method=" + quoted("auto") + " ";
  auto r = mpirun(4, common + automatic +
                         "--set comm.budget_ms=0.05 --set run.out_dir=" + quoted(path("int8")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output,
                  "comm: 2 nodes at 1 Gbit/s ([comm] inter_node_gbps), budget 0.05 ms a "
                  "step: fp32 all-reduce 0.177 ms, fp16 0.0886 ms, int8 0.045 ms"),
            1)
      << r.output;
  EXPECT_EQ(count(r.output, "within it: int8 (method = \"auto\": used)"), 1) << r.output;
  for (const Crossing& c : crossings(path("int8/metrics.jsonl"))) {
    EXPECT_FALSE(c.outer);
    EXPECT_NEAR(double(c.inter_bytes), 5624, 64) << c.step;  // what the plan said it sends
  }
  r = mpirun(4, common + automatic +
                    "--set comm.budget_ms=0.01 --set optim.freeze_step=2 --set run.out_dir=" +
                    quoted(path("onebit")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "int8 0.045 ms, 1-bit Adam after 2 int8 steps 0.00623 ms, outer"), 1)
      << r.output;
  EXPECT_EQ(count(r.output, "within it: 1-bit Adam after 2 int8 steps (method = \"auto\": used)"),
            1)
      << r.output;
  const auto onebit = crossings(path("onebit/metrics.jsonl"));
  ASSERT_EQ(onebit.size(), 4u);
  for (int i = 0; i < 4; i++)  // the warm-up in int8, then 1 bit
    EXPECT_NEAR(double(onebit[i].inter_bytes), i < 2 ? 5624 : 775, 64) << i;
  r = mpirun(4, common + automatic +
                    "--set comm.budget_ms=0.005 --set run.out_dir=" + quoted(path("outer")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "within it: outer steps every 10 (int8) (method = \"auto\": used)"), 1)
      << r.output;
  const auto outer = crossings(path("outer/metrics.jsonl"));
  ASSERT_EQ(outer.size(), 4u);
  EXPECT_TRUE(outer[3].outer);  // the last step; none before it crossed nodes
  for (int i = 0; i < 3; i++) EXPECT_EQ(outer[i].inter_bytes, 0) << i;
  // Advice only: the run keeps its flat fp32 all-reduce.
  r = mpirun(4, common + "--set comm.budget_ms=0.05 --set run.out_dir=" + quoted(path("advice")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "within it: int8 (compression.method = \"auto\" would use it)"), 1)
      << r.output;
  for (const Crossing& c : crossings(path("advice/metrics.jsonl"))) EXPECT_EQ(c.inter_bytes, 0);
  r = mpirun(4, automatic);
  expect_refused(r,
                 "[comm.compression] method: \"auto\" chooses by [comm] budget_ms, which is "
                 "not set");
}

// Outer steps need nodes to average over, and the nodes' parameters whole between them.
TEST_F(MpiCli, OuterStepsRefuseLayoutsWithoutNodes) {
  auto r = mpirun(4, "--set parallel.dp=4 --set comm.outer.every_steps=2");  // one node
  expect_refused(r, "[comm.outer] every_steps = 2: the outer steps average the nodes' weights");
  EXPECT_FALSE(fs::exists(path("out")));
  r = mpirun(4, std::string("--set parallel.dp=4 --set parallel.zero=3 ") + kTwoNodes +
                    "--set comm.outer.every_steps=2");
  expect_refused(r,
                 "[comm.outer] every_steps: the outer steps work with parallel.zero = 0, 1 or 2");
  r = mpirun(4, std::string("--set parallel.dp=2 --set parallel.cp=2 ") + kTwoNodes +
                    "--set comm.outer.every_steps=2");
  expect_refused(r,
                 "[comm.outer] every_steps: outer steps across nodes do not combine with "
                 "context parallelism");
}

}  // namespace
}  // namespace trainer
