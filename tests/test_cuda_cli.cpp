// The trainer itself on the GPU, under mpirun: the same losses run to run and close to the
// CPU's, data parallelism over ranks that share the GPU (staged MPI collectives) equal to one
// rank, the memory fraction and collectives reaching the placement, phases timed only when asked,
// NVML's health readings in the metrics, and the GPU's operators in a profile. Skipped, saying
// so, where no GPU is visible (CTest label `gpu`). The kernels against the CPU: test_cuda.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "mpi_cli.h"
#include "test_util.h"

namespace trainer {
namespace {

class CudaCli : public MpiCli {
 protected:
  void SetUp() override {
    REQUIRE_GPU();
    MpiCli::SetUp();
  }
  std::vector<double> losses(const std::string& out) {
    std::vector<double> v;
    for (const StepRecord& s : steps_of(path(out + "/metrics.jsonl"))) v.push_back(s.loss);
    return v;
  }
  void expect_close(const std::vector<double>& a, const std::vector<double>& b, double rtol) {
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); i++) EXPECT_NEAR(a[i], b[i], rtol * b[i]) << "step " << i + 1;
  }
};

TEST_F(CudaCli, TrainsLikeTheCpuDeterministicallyAndWithRanksSharingTheGpu) {
  const std::string common = "--set train.steps=6 --set run.gpu_memory_fraction=0.2 ";
  auto run = [&](int ranks, const std::string& out, const std::string& extra) {
    const auto r = mpirun(ranks, common + "--set run.out_dir=" + quoted(path(out)) + " " + extra);
    EXPECT_EQ(r.code, 0) << r.output;
    return losses(out);
  };
  const auto cpu = run(1, "cpu", "");
  const auto gpu = run(1, "gpu", "--set run.device=" + quoted("cuda"));
  const auto again = run(1, "gpu2", "--set run.device=" + quoted("cuda"));
  EXPECT_EQ(gpu, again);  // bitwise, run to run
  expect_close(gpu, cpu, 1e-4);
  const auto dp2 = run(
      2, "dp2",
      "--set run.device=" + quoted("cuda") + " --set train.micro_batch=1 --set parallel.zero=1");
  const auto one = run(
      1, "one",
      "--set run.device=" + quoted("cuda") + " --set train.micro_batch=1 --set train.grad_accum=2");
  expect_close(dp2, one, 1e-5);
  const auto tp2 = run(2, "tp2", "--set run.device=" + quoted("cuda") + " --set parallel.tp=2");
  expect_close(tp2, gpu, 1e-5);
  const auto bf16 =
      run(1, "bf16",
          "--set run.device=" + quoted("cuda") + " --set precision.compute=" + quoted("bf16"));
  expect_close(bf16, cpu, 2e-2);
}

// run.gpu_memory_fraction reserves that share of the GPU, split between the ranks sharing it;
// run.gpu_collectives: "auto" stages through MPI for ranks sharing a GPU, "nccl" refuses them.
TEST_F(CudaCli, MemoryFractionAndCollectivesReachThePlacement) {
  // Each run in a directory of its own: a fresh run refuses one that already holds a run.
  int runs = 0;
  auto reserved_gib = [&](int ranks, const std::string& settings, std::string* banner) {
    std::string name = "m";
    name += std::to_string(runs++);
    const std::string dir = path(name);
    const auto r = mpirun(ranks, "--set train.steps=1 --set run.device=" + quoted("cuda") + " " +
                                     settings + " --set run.out_dir=" + quoted(dir));
    EXPECT_EQ(r.code, 0) << r.output;
    *banner = r.output;
    const size_t at = r.output.find(" GiB reserved per rank");
    if (at == std::string::npos) return 0.0;
    const size_t from = r.output.rfind(", ", at) + 2;
    return std::stod(r.output.substr(from, at - from));
  };
  std::string one, two, shared;
  const double a = reserved_gib(1, "--set run.gpu_memory_fraction=0.1", &one);
  const double b = reserved_gib(1, "--set run.gpu_memory_fraction=0.2", &two);
  const double c = reserved_gib(2, "--set run.gpu_memory_fraction=0.2", &shared);
  EXPECT_NEAR(b / a, 2.0, 0.2) << one << two;
  EXPECT_NEAR(c / a, 1.0, 0.1) << shared;  // 0.2 split between the two ranks on the GPU
  EXPECT_NE(shared.find("collectives mpi"), std::string::npos) << shared;
  const auto r = mpirun(2, "--set train.steps=1 --set run.device=" + quoted("cuda") +
                               " --set run.gpu_memory_fraction=0.2 --set run.gpu_collectives=" +
                               quoted("nccl") + " --set run.out_dir=" + quoted(path("n")));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("ranks share the GPU of rank 0"), std::string::npos) << r.output;
}

// run.phase_timing: on the GPU the step waits for the device after each micro-batch only when
// asked, and only then reports forward and backward times (otherwise they would be launches).
TEST_F(CudaCli, PhasesAreTimedOnlyWhenAsked) {
  for (bool timing : {false, true}) {
    const std::string out = path(timing ? "timed" : "untimed");
    const auto r =
        mpirun(1,
               "--set train.steps=2 --set run.gpu_memory_fraction=0.2 "
               "--set run.device=" +
                   quoted("cuda") + " --set run.phase_timing=" + (timing ? "true" : "false") +
                   " --set run.out_dir=" + quoted(out));
    ASSERT_EQ(r.code, 0) << r.output;
    std::ifstream in(out + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.contains("loss")) {
        EXPECT_EQ(j.contains("forward_ms"), timing) << line;
      }
    }
  }
}

// NVML's readings of each rank's GPU (trainer/gpu_health.h) in metrics.jsonl: at the start and at
// every log interval, one per rank (two ranks sharing the GPU), and the temperatures and power
// draws NVML reads in a range a GPU can have (one it cannot read stays null). NVML is optional:
// it comes with the driver, a container may lack it, and it may not know the GPU (a MIG
// instance); where the run says it skipped the readings, or NVML read no temperature, this
// test skips.
TEST_F(CudaCli, GpuHealthReadingsReachTheMetrics) {
  const std::string out = path("health");
  const auto r = mpirun(2,
                        "--set train.steps=2 --set train.log_every=1 "
                        "--set run.gpu_memory_fraction=0.2 --set run.device=" +
                            quoted("cuda") + " --set run.out_dir=" + quoted(out));
  ASSERT_EQ(r.code, 0) << r.output;
  if (const size_t at = r.output.find("GPU health: NVML readings skipped"); at != std::string::npos)
    GTEST_SKIP() << r.output.substr(at, r.output.find('\n', at) - at);
  std::ifstream in(out + "/metrics.jsonl");
  int readings = 0, temperatures = 0;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("gpu")) continue;
    readings++;
    ASSERT_EQ(j["gpu"].size(), 2u) << line;
    for (const auto& g : j["gpu"]) {
      EXPECT_TRUE(g.contains("ecc_uncorrected")) << line;
      EXPECT_TRUE(g["slowdown"].is_string()) << line;
      if (g["temperature_c"].is_number()) {
        temperatures++;
        EXPECT_GT(g["temperature_c"].get<double>(), 0) << line;
        EXPECT_LT(g["temperature_c"].get<double>(), 120) << line;
      }
      if (g["power_w"].is_number()) {
        EXPECT_GT(g["power_w"].get<double>(), 0) << line;
      }
    }
  }
  EXPECT_GE(readings, 3) << "the start and steps 0 and 1";
  if (temperatures == 0) GTEST_SKIP() << "NVML opened but read no temperature";
}

// [profile] on the GPU: the device's operators in the trace, on a track of their own ("GPU"),
// timed by events (so that each lasts what it ran, not what issuing it took), inside the traced
// steps, one after another as the stream ran them, and in the table of top operators.
TEST_F(CudaCli, AProfileHasTheGpusOperatorsOnTheirOwnTrack) {
  const std::string out = path("profiled");
  const auto r =
      mpirun(1, "--set train.steps=4 --set run.gpu_memory_fraction=0.2 --set run.device=" +
                    quoted("cuda") + " --set profile.steps=[1,2] --set run.out_dir=" + quoted(out));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "matmul_forward"), 1) << r.output;
  std::ifstream in(out + "/trace/rank_0.json");
  const nlohmann::json trace = nlohmann::json::parse(in);
  int gpu_track = -1;
  double first = INFINITY, last = -INFINITY;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name" && e["args"]["name"] == "GPU")
      gpu_track = e["tid"].get<int>();
    if (e["ph"] == "X" && e["cat"] == "step") {
      first = std::min(first, e["ts"].get<double>());
      last = std::max(last, e["ts"].get<double>() + e["dur"].get<double>());
    }
  }
  ASSERT_GE(gpu_track, 0) << "no GPU track";
  std::vector<std::pair<double, double>> ops;
  int matmuls = 0;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "X" && e["cat"] == "op") {
      EXPECT_EQ(e["tid"].get<int>(), gpu_track) << e.dump();
      ops.push_back({e["ts"].get<double>(), e["ts"].get<double>() + e["dur"].get<double>()});
      if (e["name"] == "matmul_forward") {
        matmuls++;
        EXPECT_GT(e["args"]["flops"].get<double>(), 0) << e.dump();
      }
    }
  EXPECT_GT(matmuls, 0);
  std::sort(ops.begin(), ops.end());
  for (size_t i = 0; i < ops.size(); i++) {
    // On the host's clock: inside the traced steps (microseconds; the last step's update may
    // still run as its span ends).
    EXPECT_GE(ops[i].first, first - 1e4) << i;
    EXPECT_LE(ops[i].second, last + 1e4) << i;
    if (i > 0) {
      EXPECT_GE(ops[i].first, ops[i - 1].second - 50) << "one stream: " << i;
    }
  }
}

}  // namespace
}  // namespace trainer
