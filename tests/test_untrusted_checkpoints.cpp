// Checkpoints and run directories are untrusted input: an edited or damaged attribute, another
// model's checkpoints, a signal during start-up. Real runs, real files edited with h5py.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "mpi_cli.h"
#include "test_util.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;

class Untrusted : public MpiCli {};

// Every attribute of a real checkpoint set in turn to values negative, huge, NaN or merely
// wrong (about 50 runs): resume = "auto" ends on the previous checkpoint (step 2) or exits 2,
// within 60 s, never by a signal, and never resumes from the edited one.
TEST_F(Untrusted, EditedAttributesMakeACheckpointUnusable) {
  ASSERT_EQ(mpirun(1, "--set train.steps=4 --set checkpoint.every_steps=2").code, 0);
  const std::string ckpt = path("out/checkpoints/");
  fs::copy(ckpt + "step_00000004", path("pristine"), fs::copy_options::recursive);
  struct Edit {
    std::string attr, value;
  };
  std::vector<Edit> edits;
  for (const char* a : {"step",
                        "tokens",
                        "data_samples",
                        "data_skipped",
                        "loss_scale_clean_steps",
                        "loss_scale_hysteresis_left",
                        "loss_scale_min_scale_overflows",
                        "loss_scale_overflows",
                        "layout_world",
                        "layout_dp",
                        "layout_tp",
                        "layout_pp",
                        "layout_zero",
                        "rng_seed",
                        "format_version",
                        "vocab_size",
                        "seq_len",
                        "n_layer",
                        "n_head",
                        "d_model"})
    for (const char* v : {"-5", "2**40"}) edits.push_back({a, v});
  for (const char* a : {"step", "tokens", "data_samples", "layout_dp"})
    edits.push_back({a, "3"});  // in range, but not what was written
  for (const char* v : {"float(\"nan\")", "-1.0", "float(\"inf\")"})
    edits.push_back({"loss_scale", v});
  for (const char* a : {"layout_order", "config_hash", "meta_hash"})
    edits.push_back({a, "\"tp-dp-xx\""});
  edits.push_back({"recent_losses", "[1.0, float(\"nan\")]"});
  // Every edited state file made up front, in one Python process.
  std::vector<std::array<std::string, 3>> edited;
  for (size_t i = 0; i < edits.size(); i++) {
    const std::string file = path("edited_" + std::to_string(i) + ".h5");
    fs::copy_file(path("pristine/state.h5"), file);
    edited.push_back({file, edits[i].attr, edits[i].value});
  }
  set_attrs(edited);
  for (const Edit& e : edits) {
    SCOPED_TRACE(e.attr + " = " + e.value);
    fs::remove_all(ckpt + "step_00000004");
    fs::remove_all(ckpt + "step_00000003");
    fs::copy(path("pristine"), ckpt + "step_00000004", fs::copy_options::recursive);
    std::ofstream(ckpt + "latest") << "step_00000004\n";
    fs::copy_file(edited[&e - edits.data()][0], ckpt + "step_00000004/state.h5",
                  fs::copy_options::overwrite_existing);
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = mpirun(1, "--set train.steps=3 --set checkpoint.resume=" + quoted("auto"));
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(seconds, 60);
    EXPECT_TRUE(r.code == 0 || r.code == 2) << r.output;
    EXPECT_EQ(count(r.output, "resumed from " + ckpt + "step_00000004"), 0) << r.output;
    if (r.code == 0) {
      EXPECT_EQ(
          count(r.output, "skipping an unusable checkpoint: " + ckpt + "step_00000004/state.h5: "),
          1)
          << r.output;
      EXPECT_EQ(count(r.output, "resumed from " + ckpt + "step_00000002/state.h5 at step 2"), 1)
          << r.output;
    } else {
      EXPECT_EQ(count(r.output, "\n"), 1) << r.output;  // one line
    }
  }
}

// The reproducers, each with the message it must give: a planted layout size that made the
// verification loop forever, a negative data position that crashed the loader, and a step
// that does not match its directory.
TEST_F(Untrusted, TheReportedAttributeEditsAreNamed) {
  ASSERT_EQ(mpirun(1, "--set train.steps=4 --set checkpoint.every_steps=2").code, 0);
  const std::string state = path("out/checkpoints/step_00000004/state.h5");
  fs::copy_file(state, path("pristine.h5"));
  struct Case {
    std::string attr, value, message;
  };
  for (const Case& c : std::vector<Case>{
           {"layout_world", "2**40", "attribute layout_world = 1099511627776 out of range"},
           {"data_samples", "-29000", "attribute data_samples = -29000 out of range"},
           {"data_samples", "-5", "attribute data_samples = -5 out of range"},
           {"step", "3", "the attributes do not match their checksum meta_hash"},
       }) {
    SCOPED_TRACE(c.attr + " = " + c.value);
    fs::copy_file(path("pristine.h5"), state, fs::copy_options::overwrite_existing);
    set_attr(state, c.attr, c.value);
    // Named explicitly, the checkpoint is refused with exit 2 and nothing is written.
    const std::string metrics = text_of(path("out/metrics.jsonl"));
    const auto r = mpirun(1, "--set train.steps=6 --set checkpoint.resume=" + quoted(state));
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_EQ(count(r.output, state + ": " + c.message), 1) << r.output;
    EXPECT_EQ(text_of(path("out/metrics.jsonl")), metrics);
  }
}

// Checkpoints written before meta_hash existed (format_version 2) are still read, their
// attributes checked by range.
TEST_F(Untrusted, VersionTwoCheckpointsStillResume) {
  ASSERT_EQ(mpirun(1, "--set train.steps=2").code, 0);
  const std::string state = path("out/checkpoints/step_00000002/state.h5");
  const auto py = test::run_command(
      "/usr/bin/python3 -c 'import h5py, sys\n"
      "f = h5py.File(sys.argv[1], \"r+\")\n"
      "del f.attrs[\"meta_hash\"]\n"
      "f.attrs[\"format_version\"] = 2' " +
      state);
  ASSERT_EQ(py.code, 0) << py.output;
  const auto r = mpirun(1, "--set train.steps=3 --set checkpoint.resume=" + quoted("auto"));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "resumed from " + state + " at step 2"), 1) << r.output;
}

// Leftovers that cannot be removed (an immutable file, chattr +i) do not stop a run: start-up
// warns about a temporary it cannot clean, and a checkpoint replacing one of the same step is
// reported written (it is in place) with a warning about the old copy it could not remove.
TEST_F(Untrusted, LeftoversThatCannotBeRemovedAreWarningsNotErrors) {
  ASSERT_EQ(mpirun(1, "--set train.steps=4 --set checkpoint.every_steps=2").code, 0);
  const std::string ckpt = path("out/checkpoints/");
  fs::create_directory(ckpt + "step_00000003.tmp");
  std::ofstream(ckpt + "step_00000003.tmp/stuck") << "x";
  std::ofstream(ckpt + "step_00000004/stuck") << "x";
  const std::string stuck = ckpt + "step_00000003.tmp/stuck " + ckpt + "step_00000004/stuck";
  if (test::run_command("chattr +i " + stuck).code != 0)
    GTEST_SKIP() << "chattr +i is not available here (root on ext4 needed)";
  // Resumed from step 2, the run writes step 4 again over the old one.
  std::ofstream(ckpt + "latest") << "step_00000002\n";
  const auto r = mpirun(1,
                        "--set train.steps=5 --set checkpoint.every_steps=2 "
                        "--set checkpoint.resume=" +
                            quoted("auto"));
  test::run_command("chattr -i " + stuck + " " + ckpt + "step_00000004.old.*.tmp/stuck");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(
      count(r.output, "trainer: warning: cannot remove the leftover " + ckpt + "step_00000003.tmp"),
      1)
      << r.output;
  EXPECT_EQ(count(r.output, "checkpoint " + ckpt + "step_00000004 written"), 1) << r.output;
  EXPECT_EQ(count(r.output, "trainer: warning: after writing " + ckpt + "step_00000004"), 1)
      << r.output;
  EXPECT_EQ(count(r.output, "not written"), 0) << r.output;
}

// resume = "auto" in a run directory whose checkpoints are of another model is a config error
// naming the key and both values, not a fresh run beside them; an explicit path too, and
// neither writes anything.
TEST_F(Untrusted, ResumingAnotherModelIsAConfigError) {
  ASSERT_EQ(mpirun(2, "--set train.steps=2 --set parallel.dp=2").code, 0);
  const std::string metrics = text_of(path("out/metrics.jsonl")),
                    config = text_of(path("out/config.toml"));
  for (const std::string& resume : {quoted("auto"), quoted(path("out"))}) {
    SCOPED_TRACE(resume);
    const auto r = mpirun(2,
                          "--set train.steps=4 --set parallel.dp=2 --set model.d_model=32 "
                          "--set checkpoint.resume=" +
                              resume);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_EQ(count(r.output,
                    "the checkpoint is of a model with [model] d_model = 16, this "
                    "run's config has d_model = 32"),
              1)
        << r.output;
    EXPECT_EQ(count(r.output, "skipping"), 0) << r.output;
    EXPECT_EQ(text_of(path("out/metrics.jsonl")), metrics);
    EXPECT_EQ(text_of(path("out/config.toml")), config);
    EXPECT_FALSE(fs::exists(path("out/checkpoints/step_00000004")));
  }
}

// Planted files: nothing is written through a symlink the trainer did not make, a symlinked
// step directory is not a checkpoint, and `latest` may name only a step directory beside it.
TEST_F(Untrusted, PlantedFilesAreNotFollowed) {
  ASSERT_EQ(mpirun(1, "--set train.steps=4 --set checkpoint.every_steps=2").code, 0);
  const std::string ckpt = path("out/checkpoints/");
  // A symlink named like the temporary of `latest`, and one named like a newer step, pointing
  // at another run's checkpoint.
  std::ofstream(path("victim.txt")) << "precious\n";
  fs::create_symlink(path("victim.txt"), ckpt + "latest.tmp");
  ASSERT_EQ(mpirun(1, "--set train.steps=2 --set checkpoint.every_steps=1 --set run.out_dir=" +
                          quoted(path("other")))
                .code,
            0);
  fs::create_directory_symlink(path("other/checkpoints/step_00000001"), ckpt + "step_00000099");
  auto r = mpirun(1, "--set train.steps=6 --set checkpoint.resume=" + quoted("auto"));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "resumed from " + ckpt + "step_00000004/state.h5 at step 4"), 1)
      << r.output;
  EXPECT_EQ(text_of(path("victim.txt")), "precious\n");
  EXPECT_TRUE(fs::is_symlink(ckpt + "step_00000099"));  // left alone, not followed
  EXPECT_EQ(text_of(ckpt + "latest"), "step_00000006\n");

  // `latest` naming a path out of the directory, or the symlinked step: generate refuses it,
  // resume = "auto" passes over it to the newest real step.
  for (const std::string& name : std::vector<std::string>{path("other/checkpoints/step_00000002"),
                                                          "../../other", "step_00000099"}) {
    SCOPED_TRACE(name);
    std::ofstream(ckpt + "latest") << name << "\n";
    r = test::run_command(test::trainer_bin() + " generate --checkpoint " + path("out") +
                          " --tokens 5");
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_EQ(
        count(r.output, ckpt + "latest: names \"" + name + "\", not a step directory beside it"), 1)
        << r.output;
  }
  std::ofstream(ckpt + "latest") << "../../other\n";
  r = mpirun(1, "--set train.steps=7 --set checkpoint.resume=" + quoted("auto"));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "resumed from " + ckpt + "step_00000006/state.h5 at step 6"), 1)
      << r.output;
}

}  // namespace
}  // namespace trainer
