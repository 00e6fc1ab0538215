// The data order end to end under mpirun.
// A blend of three training sources ([[data.sources]]): the checkpoint records each source's
// position, a resume continues bit for bit in the same layout and within reduction-order
// tolerance in another, new weights on resume continue each source where it stood, and a resume
// with another number of sources is one line and exit code 2.
// A batch ramp (train.batch_ramp): each step's global batch follows the table in every layout,
// and a resume in the middle of the ramp continues it bit for bit. Slow data loading is warned
// about.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <vector>

#include "io/blend.h"
#include "io/hdf5_file.h"
#include "io/token_shard.h"
#include "mpi_cli.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;

class BlendedRun : public MpiCli {
 protected:
  void SetUp() override {
    MpiCli::SetUp();
    // Three sources: the thirds of the prepared text, recorded with its tokenizer.
    TokenShard all(path("data/train.bin"), 256);
    const int64_t third = all.size() / 3;
    for (int k = 0; k < 3; k++) {
      std::vector<int32_t> tokens(size_t(third) + 1);
      all.read(k * third, third + 1, tokens.data());
      write_token_shard(path(fmt::format("src{}.bin", k)), tokens, 256, all.tokenizer_hash());
    }
    write_config({0.5, 0.3, 0.2});
  }
  void write_config(const std::vector<double>& weights) {
    std::ofstream out(path("run.toml"));
    out << "[run]\nout_dir = \"" << path("out") << "\"\nthreads = 1\npeak_tflops = 1.0\n"
        << "[model]\nseq_len = 16\nn_layer = 2\nn_head = 2\nd_model = 16\n"
        << "[data]\nval = \"" << path("data/val.bin") << "\"\n";
    for (size_t k = 0; k < weights.size(); k++)
      out << "[[data.sources]]\npath = \"" << path(fmt::format("src{}.bin", k))
          << "\"\nweight = " << weights[k] << "\n";
    out << "[train]\nmicro_batch = 2\nsteps = 8\nval_every = 0\nsample_every = 0\n"
        << "[checkpoint]\nevery_steps = 4\n";
  }
  std::string state(const std::string& run, int step) {
    return path(fmt::format("{}/checkpoints/step_{:08d}/state.h5", run, step));
  }
};

TEST_F(BlendedRun, ResumesAcrossLayoutsAndContinuesEachSourceUnderNewWeights) {
  const std::string dp2 = "--set parallel.dp=2 ";
  auto r = mpirun(2, dp2 + "--set run.out_dir=" + quoted(path("full")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("data: a blend of 3 sources: 0.5 of "), std::string::npos) << r.output;
  // Step 4: 4 steps x 2 ranks x 2 sequences = 16 samples, split 8/5/3 as the blend does.
  {
    H5File f = H5File::open_read(state("full", 4));
    EXPECT_EQ(f.attr_ints("data_source_samples"), (std::vector<int64_t>{8, 5, 3}));
    EXPECT_EQ(f.attr_doubles("data_blend_weights"), (std::vector<double>{0.5, 0.3, 0.2}));
  }
  const std::string from = "--set checkpoint.resume=" + quoted(state("full", 4)) + " ";
  r = mpirun(2, dp2 + from + "--set run.out_dir=" + quoted(path("same")));
  ASSERT_EQ(r.code, 0) << r.output;
  const auto full = loss_texts(path("full/metrics.jsonl"));
  const auto same = loss_texts(path("same/metrics.jsonl"));
  ASSERT_EQ(full.size(), 8u);
  ASSERT_EQ(same.size(), 4u);
  for (int i = 0; i < 4; i++) EXPECT_EQ(same[i], full[4 + i]);
  // One process with the same global batch reads the same samples.
  r = mpirun(1, from + "--set train.grad_accum=2 --set run.out_dir=" + quoted(path("one")));
  ASSERT_EQ(r.code, 0) << r.output;
  const auto f = steps_of(path("full/metrics.jsonl")), one = steps_of(path("one/metrics.jsonl"));
  ASSERT_EQ(one.size(), 4u);
  for (int i = 0; i < 4; i++) EXPECT_NEAR(one[i].loss, f[4 + i].loss, 1e-5 * f[4 + i].loss);
  {
    H5File a = H5File::open_read(state("full", 8)), b = H5File::open_read(state("one", 8));
    EXPECT_EQ(a.attr_ints("data_source_samples"), b.attr_ints("data_source_samples"));
  }

  // New weights: from sample 16 on, each source continues from 8/5/3 in the new mix.
  write_config({0.1, 0.1, 0.8});
  r = mpirun(2, dp2 + from + "--set run.out_dir=" + quoted(path("reweighted")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("data: the blend's weights change from [0.5, 0.3, 0.2] to [0.1, 0.1, "
                          "0.8] at sample 16; each source continues from its position [8, 5, 3]"),
            std::string::npos)
      << r.output;
  BlendPlan plan = BlendPlan::fresh({0.1, 0.1, 0.8});
  plan.start = 16;
  plan.base = {8, 5, 3};
  {
    H5File h = H5File::open_read(state("reweighted", 8));
    EXPECT_EQ(h.attr_ints("data_source_samples"), BlendOrder(plan).positions(32));
    EXPECT_EQ(h.attr_int("data_blend_start"), 16);
  }
  // Resumed again with those weights, the changed blend itself continues.
  r = mpirun(1, "--set train.steps=10 --set train.grad_accum=2 --set checkpoint.resume=" +
                    quoted(state("reweighted", 8)) + " --set run.out_dir=" + quoted(path("again")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output.find("weights change"), std::string::npos) << r.output;
  EXPECT_EQ(H5File::open_read(state("again", 10)).attr_ints("data_source_samples"),
            BlendOrder(plan).positions(40));

  // Another number of sources: one line, exit code 2, on every rank.
  write_config({0.5, 0.5});
  expect_refused(mpirun(2, dp2 + from + "--set run.out_dir=" + quoted(path("two"))),
                 "[data] sources: the checkpoint was trained on 3 sources, the config names 2");
}

// A checkpoint's blend attributes edited out of range: each edit is named on resume (exit 2). At
// step 4 on one process the blend has taken 8 samples.
TEST_F(BlendedRun, EditedBlendAttributesAreNamed) {
  ASSERT_EQ(mpirun(1, "--set train.steps=4").code, 0);
  const std::string file = state("out", 4);
  fs::copy_file(file, path("pristine.h5"));
  struct Case {
    std::string attr, value, message;
  };
  for (const Case& c : std::vector<Case>{
           {"data_blend_weights", "[1.0]",
            "data_blend_weights = [1 values] out of range (expected "
            "2 to 4096)"},
           {"data_blend_weights", "[0.5, 0.6, -0.1]",
            "data_blend_weights = [... -0.1 ...] out of range (expected (0, 1])"},
           {"data_blend_weights", "[0.5, 0.3, 0.3]",
            "data_blend_weights = summing to 1.1 out of range (expected 1)"},
           {"data_blend_start", "10**6",
            "data_blend_start = 1000000 out of range (expected 0 to 8)"},
           {"data_blend_base", "[0, 0]",
            "data_blend_base = [2 values] out of range (expected one per source, 3)"},
           {"data_source_samples", "[-1, 5, 4]",
            "data_source_samples = -1 out of range (expected source 0's position, 0 (its base) "
            "to "},
           {"data_source_samples", "[4, 2, 1]",
            "data_source_samples = 7 samples since the blend's start out of range (expected "
            "data_samples - data_blend_start = 8)"},
       }) {
    SCOPED_TRACE(c.attr + " = " + c.value);
    fs::copy_file(path("pristine.h5"), file, fs::copy_options::overwrite_existing);
    set_attr(file, c.attr, c.value);
    expect_refused(mpirun(1, "--set train.steps=6 --set checkpoint.resume=" + quoted(file)),
                   file + ": attribute " + c.message);
  }
}

// Global batches of 4, 8 and 16 sequences from steps 0, 3 and 6: two ranks accumulate 1, 2 and 4
// micro-batches of 2, one rank 2, 4 and 8.
TEST_F(MpiCli, BatchRampFollowsTheTableAndResumesMidRamp) {
  const std::string ramp =
      "--set train.steps=8 --set checkpoint.every_steps=4 "
      "--set 'train.batch_ramp=[[0, 4], [3, 8], [6, 16]]' ";
  auto r = mpirun(2, ramp + "--set parallel.dp=2 --set run.out_dir=" + quoted(path("full")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("batch ramp: 4 sequences from step 0, 8 sequences from step 3, 16 "
                          "sequences from step 6"),
            std::string::npos)
      << r.output;
  std::vector<int64_t> batches, tokens;
  for (std::ifstream in(path("full/metrics.jsonl")); !in.eof();) {
    std::string line;
    if (!std::getline(in, line) || line.empty()) continue;
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("loss")) continue;
    batches.push_back(j["batch"]);
    tokens.push_back(j["tokens"]);
  }
  EXPECT_EQ(batches, (std::vector<int64_t>{4, 4, 4, 8, 8, 8, 16, 16}));
  EXPECT_EQ(tokens.back(), (3 * 4 + 3 * 8 + 2 * 16) * 16);
  // Step 4 is in the middle of the ramp: 3 x 4 + 8 samples before it.
  const std::string from =
      "--set checkpoint.resume=" + quoted(path("full/checkpoints/step_00000004")) + " ";
  r = mpirun(2, ramp + from + "--set parallel.dp=2 --set run.out_dir=" + quoted(path("same")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("(data position: sample 20)"), std::string::npos) << r.output;
  const auto full = loss_texts(path("full/metrics.jsonl"));
  const auto same = loss_texts(path("same/metrics.jsonl"));
  ASSERT_EQ(same.size(), 4u);
  for (int i = 0; i < 4; i++) EXPECT_EQ(same[i], full[4 + i]);
  // One rank accumulates twice as many micro-batches for the same global batches.
  r = mpirun(1, ramp + "--set run.out_dir=" + quoted(path("one")));
  ASSERT_EQ(r.code, 0) << r.output;
  const auto f = steps_of(path("full/metrics.jsonl")), one = steps_of(path("one/metrics.jsonl"));
  ASSERT_EQ(one.size(), 8u);
  for (int i = 0; i < 8; i++) EXPECT_NEAR(one[i].loss, f[i].loss, 1e-5 * f[i].loss) << i;
  // A row that two ranks cannot split into micro-batches of 2: one line, exit 2.
  expect_refused(mpirun(2, "--set 'train.batch_ramp=[[0, 2], [3, 8]]' --set parallel.dp=2"),
                 "trainer: config error: " + path("run.toml") +
                     ": [train] batch_ramp: 2 sequences at 0 steps do not divide into "
                     "micro-batches of 2 sequences on each of dp = 2 ranks (a multiple of 4 is "
                     "needed)\n");
}

// prepare --compress writes zstd shards; a run on them through data.cache_dir trains exactly as on
// the same shards decompressed by zstd itself, and the next run takes them from the cache.
TEST_F(MpiCli, CompressedShardsTrainAsThePlainOnes) {
  auto r = test::run_command(test::trainer_bin() + " prepare --input " + test::source_dir() +
                             "/tests/data/pride_and_prejudice_opening.txt --out-dir " +
                             path("zdata") + " --compress --shard-tokens 5995");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("wrote " + path("zdata/train_000000.bin.zst")), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(path("zdata/train_000000.bin")));
  const std::string common = "--set train.steps=3 --set data.prefetch=2 ";
  const std::string zst = common + "--set 'data.train=\"" + path("zdata/train_*.bin.zst") +
                          "\"' --set 'data.val=\"" + path("zdata/val_*.bin.zst") +
                          "\"' --set 'data.cache_dir=\"" + path("cache") + "\"' ";
  r = mpirun(1, zst + "--set run.out_dir=" + quoted(path("zst")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("zstd-compressed, decompressed into the cache"), std::string::npos)
      << r.output;
  r = mpirun(1, zst + "--set run.out_dir=" + quoted(path("zst2")));
  ASSERT_EQ(r.code, 0) << r.output;
  // 6000 val tokens: a shard of 5995 and one of 5, too short for a window.
  EXPECT_NE(r.output.find("6000 val tokens (2 shards, trainer format; 2 zstd-compressed, from the "
                          "cache; 1 shorter than a window, unused)"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(loss_texts(path("zst/metrics.jsonl")), loss_texts(path("zst2/metrics.jsonl")));
  // The same shards decompressed by zstd itself, as plain shards: the same run.
  for (const auto& e : fs::directory_iterator(path("zdata"))) {
    const std::string name = e.path().filename().string();
    if (!name.ends_with(".zst")) continue;
    ASSERT_EQ(test::run_command("zstd -q -d " + e.path().string() + " -o " + path("zdata/") +
                                name.substr(0, name.size() - 4))
                  .code,
              0);
  }
  r = mpirun(1, common + "--set 'data.train=\"" + path("zdata/train_*.bin") +
                    "\"' --set 'data.val=\"" + path("zdata/val_*.bin") +
                    "\"' --set run.out_dir=" + quoted(path("unpacked")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(loss_texts(path("zst/metrics.jsonl")), loss_texts(path("unpacked/metrics.jsonl")));
}

// Data loading on the critical path is named: storage made slow (40 ms more per step than the
// tiny model's step) makes the 20th consecutive starved step print a warning and log it. (That a
// step fed in time resets the count is DataTest.DataWaitWatchCountsConsecutiveStarvedSteps: a run
// without the hook could still be starved on a loaded machine.)
TEST_F(MpiCli, SlowDataLoadingIsWarnedAbout) {
  auto r =
      mpirun(1, "--set train.steps=25 --set data.prefetch=1", "TRAINER_TEST_DATA_DELAY_MS=40 ");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output,
                  "warning: data loading is on the critical path: rank 0 waited for "
                  "data more than 5% of the step for 20 steps in a row"),
            1)
      << r.output;
  EXPECT_NE(text_of(path("out/metrics.jsonl")).find("\"warning\":\"data loading"),
            std::string::npos);
}

}  // namespace
}  // namespace trainer
