// Activation recomputation end to end, under a real mpirun: 20 steps of GPT-2 with dropout and
// of Llama, one process and tp 2 x pp 2 (four micro-batches in flight on the first stage; and
// with sequence parallelism),
// with recompute = none, selective and full. Recomputation changes what is kept, never what is
// computed: the losses, final weights and Adam moments are bitwise those of
// none in the same layout. (The unit tests in test_models.cpp show that a recomputation that
// does not run breaks this.) The start-up line reports each mode's planned activations, which
// shrink from none to selective to full.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "model/model_definition.h"
#include "mpi_cli.h"

namespace trainer {
namespace {

// The planned activation megabytes of the start-up line ("activations 1.23").
double planned_activations(const std::string& output) {
  const size_t at = output.find("activations ");
  return at == std::string::npos ? -1 : std::stod(output.substr(at + 12));
}

TEST_F(MpiCli, RecomputationIsBitwiseInEveryLayout) {
  struct Model {
    std::string name, settings;
    ModelConfig cfg;
  };
  ModelConfig gpt2;
  gpt2.seq_len = 16, gpt2.n_layer = 4, gpt2.n_head = 2, gpt2.d_model = 16;
  ModelConfig llama = gpt2;
  llama.arch = Arch::llama, llama.n_kv_head = 2, llama.ffn_hidden = 32;
  llama.tie_embeddings = false;
  const std::vector<Model> models = {
      {"gpt2_dropout", "--set model.n_layer=4 --set model.dropout=0.1", gpt2},
      {"llama",
       "--set model.n_layer=4 --set model.arch=\\\"llama\\\" --set model.n_kv_head=2 "
       "--set model.ffn_hidden=32",
       llama}};
  const std::vector<std::pair<int, std::string>> layouts = {
      {1, "--set train.grad_accum=4"},
      {4, "--set parallel.tp=2 --set parallel.pp=2 --set parallel.micro_batches=4"},
      // Sequence parallelism: the re-run forward's gathers and scatters, in backward's scratch.
      {4,
       "--set parallel.tp=2 --set parallel.pp=2 --set parallel.micro_batches=4 "
       "--set parallel.sequence_parallel=true"}};
  for (const Model& m : models)
    for (const auto& [ranks, layout] : layouts) {
      std::vector<std::vector<double>> traces;
      std::vector<std::vector<float>> finals;
      std::vector<double> activations;
      for (const char* mode : {"none", "selective", "full"}) {
        const std::string out =
            path(m.name + std::to_string(ranks) +
                 (layout.find("sequence") != std::string::npos ? "sp" : "") + mode);
        const auto r = mpirun(ranks, m.settings + " " + layout +
                                         " --set train.steps=20 --set train.log_every=5 "
                                         "--set memory.recompute=" +
                                         quoted(mode) + " --set run.out_dir=" + quoted(out));
        ASSERT_EQ(r.code, 0) << r.output;
        activations.push_back(planned_activations(r.output));
        std::vector<double> trace;
        for (const StepRecord& s : steps_of(out + "/metrics.jsonl")) trace.push_back(s.loss);
        ASSERT_EQ(trace.size(), 20u);
        traces.push_back(trace);
        std::vector<float> all;
        const std::string state = out + "/checkpoints/step_00000020/state.h5";
        for (const ParamInfo& p : param_table(m.cfg).params)
          for (const char* group : {"", "m/", "v/"}) {
            const std::vector<float> v =
                *group ? [&] {
                  H5File f = H5File::open_read(state);
                  std::vector<float> x(p.logical_numel());
                  f.read(std::string("optim/") + group + p.name, p.shape, x.data());
                  return x;
                }()
                       : checkpoint_param(state, p.name);
            all.insert(all.end(), v.begin(), v.end());
          }
        finals.push_back(std::move(all));
      }
      const std::string where = m.name + " on " + std::to_string(ranks) + " ranks" +
                                (layout.find("sequence") != std::string::npos ? " (sp)" : "");
      for (int i : {1, 2}) {
        EXPECT_EQ(traces[i], traces[0]) << where << (i == 1 ? ", selective" : ", full");
        EXPECT_TRUE(finals[i] == finals[0]) << where << (i == 1 ? ", selective" : ", full");
      }
      EXPECT_GT(activations[0], activations[1]) << where;
      EXPECT_GT(activations[1], activations[2]) << where;
      std::printf("[ %s ] planned activations none %.3f, selective %.3f, full %.3f MB\n",
                  where.c_str(), activations[0], activations[1], activations[2]);
    }
}

// The memory recomputation saves is real: llama-tiny's shape with a wider MLP (micro-batch 16 x
// 128, so that activations dominate what changes; SwiGLU width 1024, so that selective, which
// drops the SwiGLU output, saves 25 MB) in one process under none, selective and full; the
// measured peak RSS falls by the planned activation memory, within 10%. (The RSS itself also
// holds libraries and buffers no plan counts, so differences are compared, not totals.)
TEST_F(MpiCli, RecomputationSavesThePlannedMemory) {
  std::vector<double> planned, measured;
  for (const char* mode : {"none", "selective", "full"}) {
    const auto r = test::run_command(
        "OMP_NUM_THREADS=1 " + test::trainer_bin() + " train " + path("run.toml") +
        " --set model.arch=\\\"llama\\\" --set model.seq_len=128 --set model.n_layer=4 "
        "--set model.n_head=6 --set model.n_kv_head=2 --set model.d_model=192 "
        "--set model.ffn_hidden=1024 --set train.micro_batch=16 --set train.steps=1 "
        "--set checkpoint.every_steps=0 --set run.out_dir=" +
        quoted(path(std::string("out_") + mode)) + " --set memory.recompute=" + quoted(mode));
    ASSERT_EQ(r.code, 0) << r.output;
    planned.push_back(megabytes_after(r.output, "activations "));
    measured.push_back(megabytes_after(r.output, "peak memory: "));
    ASSERT_GT(planned.back(), 0) << r.output;
    ASSERT_GT(measured.back(), 0) << r.output;
  }
  for (int i : {1, 2}) {
    const double want = planned[0] - planned[i], got = measured[0] - measured[i];
    EXPECT_GT(want, 20) << i;  // tens of MB: well above the RSS's noise
    EXPECT_NEAR(got, want, 0.1 * want) << (i == 1 ? "selective" : "full");
  }
  std::printf(
      "[ llama-tiny ] planned activations %.1f / %.1f / %.1f MB, peak RSS %.0f / %.0f / "
      "%.0f MB (none / selective / full)\n",
      planned[0], planned[1], planned[2], measured[0], measured[1], measured[2]);
}

}  // namespace
}  // namespace trainer
