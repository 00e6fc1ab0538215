// Run directories: a fresh run does not start among another run's files (exit 2 naming them)
// unless run.overwrite removes them first, and resume = "auto" follows `latest`, falling back
// to older checkpoints only when it does not verify. Real mpirun runs and real files.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "mpi_cli.h"
#include "test_util.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;

TEST_F(MpiCli, AFreshRunDoesNotMixWithAnotherRun) {
  auto r = mpirun(1, "--set train.steps=4 --set checkpoint.every_steps=2");
  ASSERT_EQ(r.code, 0) << r.output;
  std::ofstream(path("out/notes.txt")) << "the user's, not the trainer's\n";
  const std::string metrics = text_of(path("out/metrics.jsonl"));

  // A fresh run into it: refused, and nothing of the old run changes.
  r = mpirun(1, "--set train.steps=2");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(count(r.output, "run.out_dir \"" + path("out") +
                                "\" already holds a run (config.toml, metrics.jsonl, "
                                "status.json, checkpoints/latest and 2 more): a fresh run "
                                "(checkpoint.resume = \"none\") will not mix with it"),
            1)
      << r.output;
  EXPECT_EQ(text_of(path("out/metrics.jsonl")), metrics);
  EXPECT_TRUE(fs::exists(path("out/checkpoints/step_00000004/state.h5")));

  // Overwrite and resume contradict each other.
  r = mpirun(
      1, "--set train.steps=6 --set run.overwrite=true --set checkpoint.resume=" + quoted("auto"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(count(r.output,
                  "run.overwrite = true removes the run in out_dir, but "
                  "checkpoint.resume = \"auto\" continues from a checkpoint"),
            1)
      << r.output;

  // run.overwrite removes the old run's files (only the trainer's) and starts afresh.
  r = mpirun(1, "--set train.steps=2 --set checkpoint.every_steps=2 --set run.overwrite=true");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_FALSE(fs::exists(path("out/checkpoints/step_00000004")));
  EXPECT_TRUE(fs::exists(path("out/checkpoints/step_00000002/state.h5")));
  EXPECT_EQ(loss_texts(path("out/metrics.jsonl")).size(), 2u);
  EXPECT_TRUE(fs::exists(path("out/notes.txt")));

  // A directory with none of the trainer's files is not a run: a fresh run goes in.
  fs::create_directories(path("other"));
  std::ofstream(path("other/notes.txt")) << "notes\n";
  r = mpirun(1, "--set train.steps=1 --set run.out_dir=" + quoted(path("other")));
  EXPECT_EQ(r.code, 0) << r.output;
}

TEST_F(MpiCli, AutoResumeFollowsLatest) {
  const std::string ckpt = path("out/checkpoints/");
  auto r = mpirun(1, "--set train.steps=4 --set checkpoint.every_steps=2");
  ASSERT_EQ(r.code, 0) << r.output;
  // step 4 is not the run's newest any more (another run's leftover, or a write whose `latest`
  // never moved): auto resumes from the one `latest` names, not the highest step.
  std::ofstream(ckpt + "latest") << "step_00000002\n";
  const std::string auto_resume =
      "--set checkpoint.every_steps=2 --set checkpoint.resume=" + quoted("auto");
  r = mpirun(1, "--set train.steps=6 " + auto_resume);
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "resumed from " + ckpt + "step_00000002/state.h5 at step 2"), 1)
      << r.output;
  EXPECT_EQ(count(r.output, "skipping an unusable checkpoint: " + ckpt +
                                "step_00000004: newer than `latest` (step_00000002)"),
            1)
      << r.output;

  // When `latest`'s checkpoint does not verify, the newest older one that does is taken.
  const std::string newest = ckpt + "step_00000006/state.h5";
  fs::resize_file(newest, fs::file_size(newest) / 2);
  r = mpirun(1, "--set train.steps=8 " + auto_resume);
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "skipping an unusable checkpoint: " + newest), 1) << r.output;
  EXPECT_EQ(count(r.output, "resumed from " + ckpt + "step_00000004/state.h5 at step 4"), 1)
      << r.output;
}

}  // namespace
}  // namespace trainer
