#pragma once
// The trainer binary under a real mpirun, for the end-to-end tests of parallel training and of
// checkpoints and faults: a small model on an excerpt of Pride and Prejudice, run.toml in a
// fresh directory per test.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "io/hdf5_file.h"
#include "model/model_definition.h"
#include "test_util.h"

namespace trainer {

inline std::string quoted(const std::string& s);
inline std::vector<std::string> loss_texts(const std::string& metrics);

// The binary under mpirun when something is wrong: every rank stops, one line says why, the
// exit code is 2, nothing is written, and nothing hangs (timeout would exit 124).
class MpiCli : public test::TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    const auto r = test::run_command(
        test::trainer_bin() + " prepare --input " + test::source_dir() +
        "/tests/data/pride_and_prejudice_opening.txt" + " --out-dir " + path("data"));
    ASSERT_EQ(r.code, 0) << r.output;
    std::ofstream(path("run.toml"))
        << "[run]\nout_dir = \"" << path("out") << "\"\nthreads = 1\npeak_tflops = 1.0\n"
        << "[model]\nseq_len = 16\nn_layer = 2\nn_head = 2\nd_model = 16\n"
        << "[data]\ntrain = \"" << path("data/train.bin") << "\"\nval = \"" << path("data/val.bin")
        << "\"\n"
        << "[train]\nmicro_batch = 2\nsteps = 2\nval_every = 0\nsample_every = 0\n";
  }
  // env: "NAME=value " assignments for the ranks (local ranks inherit mpirun's environment).
  std::string mpirun_command(int ranks, const std::string& settings) {
    // -q: without Open MPI's own banner about the non-zero exit.
    return "timeout 60 " + test::mpiexec() + " -q --allow-run-as-root --oversubscribe -np " +
           std::to_string(ranks) + " " + test::trainer_bin() + " train " + path("run.toml") + " " +
           settings;
  }
  test::CommandResult mpirun(int ranks, const std::string& settings, const std::string& env = "") {
    return test::run_command(env + mpirun_command(ranks, settings));
  }
  // Shell: waits (up to 60 s) until the run in out/ has logged step `step`.
  std::string wait_for_step(int step) {
    return "for i in $(seq 1 3000); do grep -q '\"step\":" + std::to_string(step) + ",' " +
           path("out/metrics.jsonl") + " 2>/dev/null && break; sleep 0.02; done; ";
  }
  // Shell: a pgrep/pkill pattern for the ranks of run.toml.
  std::string ranks_pattern() {
    return "'^" + test::trainer_bin() + " train " + path("run.toml") + "'";
  }
  // Sets attribute `name` of an HDF5 file to a Python expression, keeping its type family.
  void set_attr(const std::string& file, const std::string& name, const std::string& value) {
    set_attrs({{file, name, value}});
  }
  // Several (file, attribute, value) edits in one Python process (h5py's start-up is ~0.3 s).
  void set_attrs(const std::vector<std::array<std::string, 3>>& edits) {
    std::string args;
    for (const auto& [file, name, value] : edits)
      args += " " + file + " " + name + " '" + value + "'";
    const auto r = test::run_command(
        "/usr/bin/python3 -c 'import h5py, numpy as np, sys\n"
        "for file, name, value in zip(*[iter(sys.argv[1:])] * 3):\n"
        "  f = h5py.File(file, \"r+\")\n"
        "  v = eval(value)\n"
        "  old = f.attrs.get(name, 0.0)\n"
        "  if isinstance(old, (bytes, str)) or (hasattr(old, \"dtype\") and old.dtype.kind in "
        "\"SUO\"):"
        " v = str(v)\n"
        "  elif hasattr(old, \"dtype\") and old.dtype.kind == \"i\" and isinstance(v, float):"
        " v = np.float64(v)\n"
        "  if name in f.attrs: del f.attrs[name]\n"
        "  f.attrs[name] = v\n"
        "  f.close()'" +
        args);
    ASSERT_EQ(r.code, 0) << r.output;
  }
  // The run was refused: exit code 2 and the line saying why.
  static void expect_refused(const test::CommandResult& r, const std::string& why) {
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find(why), std::string::npos) << r.output;
  }
  // Trains `settings` (whose train.steps is `steps`, with a checkpoint every `at` steps) into
  // <name>_full, resumes it from step `at` into <name>_resumed, and expects each resumed step's
  // loss to be the full run's, bit for bit. Returns the resumed run's output.
  std::string expect_resumes_bit_for_bit(int ranks, const std::string& settings,
                                         const std::string& name, int at, int steps) {
    auto r = mpirun(ranks, settings + " --set run.out_dir=" + quoted(path(name + "_full")));
    EXPECT_EQ(r.code, 0) << r.output;
    char step_dir[32];
    std::snprintf(step_dir, sizeof step_dir, "/checkpoints/step_%08d", at);
    r = mpirun(ranks, settings + " --set run.out_dir=" + quoted(path(name + "_resumed")) +
                          " --set checkpoint.resume=" + quoted(path(name + "_full") + step_dir));
    EXPECT_EQ(r.code, 0) << r.output;
    const auto full = loss_texts(path(name + "_full/metrics.jsonl"));
    const auto resumed = loss_texts(path(name + "_resumed/metrics.jsonl"));
    EXPECT_EQ(resumed.size(), size_t(steps - at));
    for (size_t i = 0; i < resumed.size() && at + i < full.size(); i++)
      EXPECT_EQ(resumed[i], full[at + i]);
    return r.output;
  }
  static int count(const std::string& text, const std::string& what) {
    int n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) n++;
    return n;
  }
};

struct StepRecord {
  int64_t step;
  double loss, loss_scale;
  bool skipped;
};
// Each step's bytes sent by this rank (rank 0's log) between nodes, and whether an outer step
// followed it.
struct Crossing {
  int64_t step, inter_bytes;
  bool outer;
};
inline std::vector<Crossing> crossings(const std::string& metrics) {
  std::vector<Crossing> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("loss")) continue;
    int64_t inter = 0;
    if (j.contains("bytes_sent_groups") && j["bytes_sent_groups"].contains("inter"))
      inter = j["bytes_sent_groups"]["inter"];
    out.push_back({j["step"], inter, j.value("outer_step", false)});
  }
  return out;
}

inline std::vector<StepRecord> steps_of(const std::string& metrics) {
  std::vector<StepRecord> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.push_back({j["step"], j["loss"], j["loss_scale"], j["skipped"]});
  }
  return out;
}

// The rest of the line of `text` that starts at `what` ("" when `what` is not there).
inline std::string line_from(const std::string& text, const std::string& what) {
  const size_t at = text.find(what);
  return at == std::string::npos ? std::string() : text.substr(at, text.find('\n', at) - at);
}

// The number that follows `what` in `text` (NaN when `what` is not there).
inline double number_after(const std::string& text, const std::string& what) {
  const size_t at = text.find(what);
  return at == std::string::npos ? NAN : std::stod(text.substr(at + what.size()));
}

// A whole file as text ("" when it cannot be read).
inline std::string text_of(const std::string& file) {
  std::ifstream in(file);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The model of MpiCli's run.toml.
inline ModelConfig cli_model() {
  ModelConfig cfg;
  cfg.seq_len = 16, cfg.n_layer = 2, cfg.n_head = 2, cfg.d_model = 16;
  return cfg;
}

// Every tensor of two checkpoints is bitwise equal (params, moments).
inline void expect_same_tensors(const std::string& a_file, const std::string& b_file,
                                const ModelConfig& cfg = cli_model()) {
  H5File a = H5File::open_read(a_file);
  H5File b = H5File::open_read(b_file);
  for (const ParamInfo& p : param_table(cfg).params)
    for (const std::string group : {"params/", "optim/m/", "optim/v/"}) {
      std::vector<float> x(p.logical_numel()), y(p.logical_numel());
      a.read(group + p.name, p.shape, x.data());
      b.read(group + p.name, p.shape, y.data());
      ASSERT_EQ(x, y) << group << p.name;
    }
}

// The fp32 values of params/<name> in a checkpoint's state.h5.
inline std::vector<float> checkpoint_param(const std::string& state_file, const std::string& name) {
  H5File f = H5File::open_read(state_file);
  const std::vector<int64_t> shape = f.shape("params/" + name);
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  f.read("params/" + name, shape, v.data());
  return v;
}

// The number printed right after `what` in a run's output (-1 when it is not there): the
// megabytes of the start-up report's memory line and of the peak at the end.
inline double megabytes_after(const std::string& output, const std::string& what) {
  const size_t at = output.find(what);
  return at == std::string::npos ? -1.0 : std::stod(output.substr(at + what.size()));
}

// A quoted TOML string for --set through the shell.
inline std::string quoted(const std::string& s) {
  return "\\\"" + s + "\\\"";
}

inline std::vector<std::string> loss_texts(const std::string& metrics) {
  std::vector<std::string> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.push_back(j["step"].dump() + " " + j["loss"].dump());
  }
  return out;
}

}  // namespace trainer
