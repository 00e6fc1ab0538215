// Warm starts ([init] from): a fresh run takes only the weights of a checkpoint written in
// another layout (and precision), and its optimizer state, step, schedule and data order start
// fresh; a checkpoint of another shape is a clear error. Real mpirun runs and real files.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "io/hdf5_file.h"
#include "mpi_cli.h"
#include "test_util.h"

namespace trainer {
namespace {

// The validation losses of a run, by step.
std::vector<std::pair<int64_t, double>> val_losses(const std::string& out) {
  std::vector<std::pair<int64_t, double>> v;
  std::ifstream in(out + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("val_loss")) v.emplace_back(j["step"], j["val_loss"]);
  }
  return v;
}

TEST_F(MpiCli, WarmStartTakesTheWeightsOnlyFromAnotherLayout) {
  const std::string optim = "--set optim.lr=1e-2 --set optim.warmup_steps=4 ";
  // The source: 4 steps in tensor parallel, validated at its start and its end.
  const std::string source = path("source");
  auto r = mpirun(2, optim + "--set parallel.tp=2 --set train.steps=4 --set train.val_every=4 " +
                         "--set run.out_dir=" + quoted(source));
  ASSERT_EQ(r.code, 0) << r.output;
  const auto source_val = val_losses(source);
  ASSERT_EQ(source_val.size(), 2u);
  ASSERT_EQ(source_val.back().first, 4);
  const std::string weights = source + "/checkpoints/step_00000004/state.h5";

  // One process, fp32: at step 0 it validates exactly the source's final weights.
  const std::string one = path("one");
  r = mpirun(1, optim + "--set train.steps=1 --set train.val_every=10 --set init.from=" +
                    quoted(source) + " --set run.out_dir=" + quoted(one));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "initialized from " + weights +
                                " (weights of step 4; optimizer state, step, schedule and data "
                                "order start fresh)"),
            1)
      << r.output;
  const auto one_val = val_losses(one);
  ASSERT_FALSE(one_val.empty());
  EXPECT_EQ(one_val.front().first, 0);
  // fp32 sums in another order (tensor-parallel halves): a few units in the 7th digit.
  EXPECT_NEAR(one_val.front().second, source_val.back().second, 1e-5 * source_val.back().second);
  EXPECT_GT(std::abs(one_val.front().second - source_val.front().second), 1e-3);  // not its init
  // A fresh optimizer and schedule: Adam's first step moves every bias by lr(0) = lr / 4 exactly
  // (m / sqrt(v) = sign(g)); the source's moments or its step-4 learning rate would not.
  const std::vector<float> before = checkpoint_param(weights, "h.1.mlp.fc.bias"),
                           after = checkpoint_param(one + "/checkpoints/step_00000001/state.h5",
                                                    "h.1.mlp.fc.bias");
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < before.size(); i++)
    EXPECT_NEAR(std::abs(after[i] - before[i]), 1e-2 / 4, 1e-5) << i;

  // Two pipeline stages in bf16: the same weights, rounded to bf16 (about 3 significant digits).
  const std::string bf16 = path("bf16");
  r = mpirun(2, optim + "--set parallel.pp=2 --set train.steps=1 --set train.val_every=10 " +
                    "--set precision.compute=" + quoted("bf16") +
                    " --set init.from=" + quoted(weights) + " --set run.out_dir=" + quoted(bf16));
  ASSERT_EQ(r.code, 0) << r.output;
  const auto bf16_val = val_losses(bf16);
  ASSERT_FALSE(bf16_val.empty());
  EXPECT_NEAR(bf16_val.front().second, source_val.back().second, 2e-2 * source_val.back().second);
}

// A checkpoint that does not fit the model: exit 2 before anything is written, naming the
// tensor and both shapes (or the tensor missing or left over).
TEST_F(MpiCli, WarmStartFromAnotherShapeIsAnError) {
  const std::string source = path("source");
  auto r = mpirun(1, "--set train.steps=1 --set run.out_dir=" + quoted(source));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string weights = source + "/checkpoints/step_00000001/state.h5";
  struct Case {
    std::string settings, message;
  };
  for (const Case& c : std::vector<Case>{
           {"--set model.d_model=32",
            weights + ": params/wte.weight has shape [256, 16], this model's is [256, 32]"},
           {"--set model.n_layer=3",
            weights + ": no tensor params/h.2.ln1.weight, which this model needs ([16]; the "
                      "checkpoint's model has n_layer = 2)"},
           {"--set model.n_layer=1",
            weights + ": params/h.1.ln1.weight has no place in this model (n_layer = 2 there, 1 "
                      "here)"},
           {"--set model.n_head=4",
            weights + ": checkpoint is for a model with n_head = 2, this model has n_head = 4"},
       }) {
    SCOPED_TRACE(c.settings);
    r = mpirun(2, c.settings + " --set init.from=" + quoted(source));
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_EQ(count(r.output, c.message), 1) << r.output;
    EXPECT_FALSE(std::filesystem::exists(path("out"))) << "nothing is written";
  }
}

}  // namespace
}  // namespace trainer
