// Each configuration knob changed, and its effect observed in what the run reports
// (metrics.jsonl, the log, the files it writes), so that a knob disconnected from its mechanism
// fails a test, not only a knob whose numbers come out wrong. Real runs under mpirun.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "io/hdf5_file.h"
#include "mpi_cli.h"
#include "test_util.h"

namespace trainer {
namespace {

// The step records of a run's metrics.jsonl.
std::vector<nlohmann::json> step_records(const std::string& out) {
  std::vector<nlohmann::json> v;
  std::ifstream in(out + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) v.push_back(std::move(j));
  }
  return v;
}

// Gradient overlap, seen in what the run reports: with overlap on, rank 0's first bucket starts
// while layers' backward is still to run (as soon as the last layer's gradients are final) and
// most buckets start during backward, on every layout that reduces gradients (accumulation,
// ZeRO-1 and -2, pipeline stages); with overlap off, every bucket starts after backward (ZeRO-2
// reduces each unit as its backward ends, and backward waits for it).
TEST_F(MpiCli, OverlapStartsBucketsWhileBackwardRuns) {
  const std::string common =
      "--set model.n_layer=4 --set parallel.bucket_mb=0.002 --set train.steps=2 ";
  struct Case {
    std::string name;
    int ranks, stage_layers;
    std::string settings;
  };
  const std::vector<Case> cases = {
      {"dp2", 2, 4, ""},
      {"dp2_zero1_accum2", 2, 4, "--set parallel.zero=1 --set train.grad_accum=2"},
      // ZeRO-2: a unit's reduction starts as its backward ends, in every micro-batch.
      {"dp2_zero2_accum2", 2, 4, "--set parallel.zero=2 --set train.grad_accum=2"},
      {"dp2_pp2", 4, 2, "--set parallel.pp=2 --set parallel.micro_batches=2"},
  };
  for (const Case& c : cases)
    for (bool overlap : {true, false}) {
      const std::string out = path(c.name + (overlap ? "_on" : "_off"));
      const auto r = mpirun(c.ranks, common + c.settings +
                                         " --set parallel.overlap=" + (overlap ? "true" : "false") +
                                         " --set run.out_dir=" + quoted(out));
      ASSERT_EQ(r.code, 0) << r.output;
      int steps = 0;
      for (const auto& j : step_records(out)) {
        steps++;
        const int buckets = j["buckets"], early = j["buckets_overlapped"];
        const int first = j["first_bucket_layers_left"];
        SCOPED_TRACE(c.name + (overlap ? " overlap on: " : " overlap off: ") + j.dump());
        EXPECT_GT(buckets, 4);
        if (overlap) {
          EXPECT_GE(first, c.stage_layers - 1);  // before the last layer's backward ran
          EXPECT_GE(3 * early, buckets);         // a first stage's embeddings come last
        } else {
          EXPECT_EQ(first, -1);
          EXPECT_EQ(early, 0);
        }
      }
      EXPECT_EQ(steps, 2);
    }
}

// ZeRO-3 gathers each unit's parameters ahead of its use: of the 2 x accumulation x lent units
// opened per step (each block and the head's unit, forward and backward; GPT-2's tied embedding
// is held whole), at most the step's first waits for its gather to start; the others were
// prefetched, or kept from the forward for the backward, which is why fewer gathers than opens
// happen. Without prefetching, every gather would be waited for.
TEST_F(MpiCli, ZeroThreeGathersTheNextUnitAhead) {
  const std::string out = path("zero3");
  const auto r = mpirun(2,
                        "--set model.n_layer=4 --set train.steps=3 --set parallel.zero=3 "
                        "--set train.grad_accum=2 --set run.out_dir=" +
                            quoted(out));
  ASSERT_EQ(r.code, 0) << r.output;
  const int lent = 4 + 1, opens = 2 * 2 * lent;
  int steps = 0;
  for (const auto& j : step_records(out)) {
    steps++;
    SCOPED_TRACE(j.dump());
    const int gathers = j["param_gathers"], ready = j["param_ready"], waited = j["param_waited"];
    EXPECT_EQ(ready + waited, opens);
    EXPECT_LE(waited, 1);
    EXPECT_GE(gathers, lent);  // each unit at least once after the update
    EXPECT_LT(gathers, opens);
  }
  EXPECT_EQ(steps, 3);
  // ZeRO 0-2 report none.
  const auto z1 = mpirun(
      2, "--set train.steps=1 --set parallel.zero=1 --set run.out_dir=" + quoted(path("zero1")));
  ASSERT_EQ(z1.code, 0) << z1.output;
  for (const auto& j : step_records(path("zero1"))) EXPECT_FALSE(j.contains("param_gathers"));
}

// scripts/plot_run.py draws a real run's metrics.jsonl (two runs overlaid, one with a
// validation loss and checkpoints, whose stalls join the stacked step time) into a 1600 x 900
// PNG; a directory without metrics.jsonl is one line naming the file, exit 2.
TEST_F(MpiCli, PlotRunDrawsARunDirectory) {
  for (const char* name : {"a", "b"}) {
    const auto r = mpirun(2,
                          "--set train.steps=12 --set train.val_every=4 "
                          "--set checkpoint.every_steps=6 --set run.out_dir=" +
                              quoted(path(name)));
    ASSERT_EQ(r.code, 0) << r.output;
  }
  const std::string script = "/usr/bin/python3 " + test::source_dir() + "/scripts/plot_run.py ";
  const std::string png = path("dashboard.png");
  auto r = test::run_command(script + path("a") + " " + path("b") + " --out " + png);
  ASSERT_EQ(r.code, 0) << r.output;
  std::ifstream in(png, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 20000u);  // drawn, not an empty canvas
  ASSERT_EQ(bytes.substr(1, 3), "PNG");
  auto be32 = [&](size_t at) {
    return (uint32_t(uint8_t(bytes[at])) << 24) | (uint32_t(uint8_t(bytes[at + 1])) << 16) |
           (uint32_t(uint8_t(bytes[at + 2])) << 8) | uint32_t(uint8_t(bytes[at + 3]));
  };
  EXPECT_EQ(be32(16), 1600u);  // IHDR: width, height
  EXPECT_EQ(be32(20), 900u);
  r = test::run_command(script + path("nowhere"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(count(r.output, path("nowhere") + "/metrics.jsonl: no such file"), 1) << r.output;
  EXPECT_EQ(count(r.output, "\n"), 1) << r.output;
}

// [profile] steps = [1, 2] at dp 2 with tp 2 (4 ranks; 2 kB buckets, so that several of a
// step's reductions are in flight together): each rank writes a trace-event file
// whose events all have ph, ts, dur, pid and tid; it holds exactly the two profiled steps, and
// within each, the phases (and the layers and timed operators within them) cover at least 95%
// of its wall time; matrix multiplies carry their FLOPs; scripts/merge_traces.py joins the four
// ranks into one file; every transfer of a group (dp, tp) is an event on the group's track with
// the bytes it sent (together, what the run logged for those steps) and its wait on the calling
// thread's; rank 0 prints the table of its phases, top operators and transfers. Steps outside
// the window record nothing, and a run without [profile] writes no trace. Every CPU operator is
// an event: the matrix multiplies and attention with their FLOPs, the others without.
TEST_F(MpiCli, ProfileTracesEveryPhaseOfTheChosenSteps) {
  const auto r = mpirun(4,
                        "--set train.steps=4 --set parallel.dp=2 --set parallel.tp=2 "
                        "--set parallel.bucket_mb=0.002 "
                        "--set profile.steps=[1,2] --set run.out_dir=" +
                            quoted(path("run")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "profile: 2 steps traced"), 1) << r.output;
  // The table's operators are the 8 that took longest, and which of this tiny model's make it
  // depends on the machine's moment (matmul_forward once fell out): any matrix multiply, with
  // its GFLOP/s.
  const std::regex gemm_row(R"(\n  matmul_(forward|backward) +\d+ +[\d.]+ +[\d.]+% +[\d.]+\n)");
  EXPECT_TRUE(std::regex_search(r.output, gemm_row)) << r.output;
  for (int rank = 0; rank < 4; rank++) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    std::ifstream in(path("run/trace/rank_" + std::to_string(rank) + ".json"));
    ASSERT_TRUE(in.good());
    const nlohmann::json trace = nlohmann::json::parse(in);
    std::vector<std::pair<double, double>> steps, inside;  // [begin, end) in microseconds
    std::map<std::string, int> phases;                     // by name, over the traced steps
    int matmuls = 0, layers = 0, waits = 0;
    std::set<std::string> ops;
    std::map<std::string, double> traced_bytes;                    // by group
    std::map<int, std::vector<std::pair<double, double>>> tracks;  // by tid
    for (const auto& e : trace["traceEvents"]) {
      for (const char* key : {"ph", "ts", "pid", "tid", "name"}) ASSERT_TRUE(e.contains(key)) << e;
      EXPECT_EQ(e["pid"], rank);
      if (e["ph"] != "X") continue;
      ASSERT_TRUE(e.contains("dur")) << e;
      ASSERT_GE(e["dur"].get<double>(), 0) << e;
      const double b = e["ts"], end = b + e["dur"].get<double>();
      tracks[e["tid"].get<int>()].push_back({b, end});
      if (e["cat"] == "step") steps.push_back({b, end});
      if (e["cat"] == "phase" && e["name"] != "data" && e["name"] != "checkpoint")
        inside.push_back({b, end});
      if (e["cat"] == "phase") phases[e["name"].get<std::string>()]++;
      if (e["name"] == "matmul_forward") {
        matmuls++;
        EXPECT_GT(e["args"]["flops"].get<double>(), 0);
      }
      layers += e["cat"] == "layer";
      if (e["cat"] == "op") ops.insert(e["name"].get<std::string>());
      waits += e["cat"] == "comm_wait";
      if (e["cat"] == "collective") {  // "all_reduce tp", on the group's own track
        const std::string name = e["name"];
        ASSERT_TRUE(e.contains("args") && e["args"].contains("bytes")) << e;
        traced_bytes[name.substr(name.find(' ') + 1)] += e["args"]["bytes"].get<double>();
      }
    }
    // Every transfer of the traced steps is in the trace: the bytes of each group's events are
    // the bytes the run logged for those steps.
    std::map<std::string, double> logged;
    std::ifstream metrics(path("run/metrics.jsonl"));
    for (std::string line; std::getline(metrics, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.contains("loss") && (j["step"] == 1 || j["step"] == 2) && rank == 0)
        for (const auto& [group, bytes] : j["bytes_sent_groups"].items())
          logged[group] += bytes.get<double>();
    }
    EXPECT_GT(waits, 0);
    // The spans of a track nest (trace viewers draw one that overlaps another partly wrongly):
    // transfers in flight together are on different lanes.
    for (auto& [tid, spans] : tracks) {
      std::sort(spans.begin(), spans.end(), [](const auto& x, const auto& y) {
        return x.first != y.first ? x.first < y.first : x.second > y.second;
      });
      std::vector<double> open;  // ends of the enclosing spans
      for (const auto& [b, end] : spans) {
        while (!open.empty() && open.back() <= b + 0.01) open.pop_back();
        if (!open.empty()) {
          EXPECT_LE(end, open.back() + 0.01) << "track " << tid << " at " << b;
        }
        open.push_back(end);
      }
    }
    if (rank == 0) {
      EXPECT_GT(logged["dp"], 0);
      EXPECT_GT(logged["tp"], 0);
      for (const auto& [group, bytes] : logged) EXPECT_EQ(traced_bytes[group], bytes) << group;
    }
    ASSERT_EQ(steps.size(), 2u);
    EXPECT_GT(matmuls, 0);
    // The CPU's other operators too: a GPT-2 step's norms, activations, embedding, loss and
    // optimizer (each one span, 16-bit staging included).
    for (const char* op :
         {"encoder_forward", "encoder_backward", "layernorm_forward", "layernorm_backward",
          "gelu_forward", "gelu_backward", "residual_forward", "crossentropy_stats",
          "crossentropy_loss", "crossentropy_backward", "adamw_update", "attention_forward",
          "attention_backward"})
      EXPECT_TRUE(ops.count(op)) << op;
    if (rank == 0) {  // the first replica sums the squares of the gradient norm
      EXPECT_TRUE(ops.count("sum_squares"));
    }
    EXPECT_EQ(layers, 2 * 2 * cli_model().n_layer);  // 2 steps x (forward, backward) x blocks
    // Each step's phases, once a step; the data waits inside its forward and backward.
    for (const char* phase :
         {"forward and backward", "gradient reduction", "loss and norm", "optimizer"})
      EXPECT_EQ(phases[phase], 2) << phase;
    EXPECT_GE(phases["data"], 2);
    for (const auto& [b, end] : steps) {
      double covered = 0;
      // The phases do not overlap; the last ends where the step does (to rounding: ts + dur).
      for (const auto& [pb, pe] : inside)
        if (pb >= b - 0.01 && pe <= end + 0.01) covered += pe - pb;
      EXPECT_GE(covered / (end - b), 0.95) << "step at " << b;
    }
  }
  const auto merged = test::run_command("/usr/bin/python3 " + test::source_dir() +
                                        "/scripts/merge_traces.py " + path("run"));
  ASSERT_EQ(merged.code, 0) << merged.output;
  std::ifstream in(path("run/trace/all_ranks.json"));
  const nlohmann::json all = nlohmann::json::parse(in);
  std::set<int> pids;
  for (const auto& e : all["traceEvents"]) pids.insert(e["pid"].get<int>());
  EXPECT_EQ(pids, (std::set<int>{0, 1, 2, 3}));
  const auto plain = mpirun(1, "--set train.steps=2 --set run.out_dir=" + quoted(path("plain")));
  ASSERT_EQ(plain.code, 0) << plain.output;
  EXPECT_FALSE(std::filesystem::exists(path("plain/trace")));
}

// A training step on one rank (the whole vocabulary) makes the cross-entropy's gradients in its
// forward, one pass over the logits (StageExecutor::training_forward): its profile has that
// operator once a micro-batch and neither of the two passes (which tp = 2 above keeps).
TEST_F(MpiCli, OneRankTrainsWithTheCrossEntropyInOnePass) {
  const auto r = mpirun(1,
                        "--set train.steps=2 --set train.grad_accum=2 --set profile.steps=[1,1] "
                        "--set run.out_dir=" +
                            quoted(path("run")));
  ASSERT_EQ(r.code, 0) << r.output;
  std::ifstream in(path("run/trace/rank_0.json"));
  ASSERT_TRUE(in.good());
  const nlohmann::json trace = nlohmann::json::parse(in);
  std::map<std::string, int> ops;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "X" && e["cat"] == "op") ops[e["name"].get<std::string>()]++;
  EXPECT_EQ(ops.count("crossentropy_stats") + ops.count("crossentropy_backward"), 0u);
  EXPECT_EQ(ops["crossentropy_stats_and_backward"], 2)  // one step of two micro-batches
      << testing::PrintToString(ops);
}

// data.prefetch = N: N batches ready ahead of every step (the loader's consumer holds one more).
TEST_F(MpiCli, PrefetchKeepsThatManyBatchesReady) {
  for (int prefetch : {1, 3}) {
    const std::string out = path("prefetch" + std::to_string(prefetch));
    // Steps of a few milliseconds, so that the loader thread gets a core between them.
    const auto r = mpirun(1,
                          "--set train.steps=12 --set model.d_model=64 --set train.micro_batch=8 "
                          "--set data.prefetch=" +
                              std::to_string(prefetch) + " --set run.out_dir=" + quoted(out));
    ASSERT_EQ(r.code, 0) << r.output;
    int most = 0;
    for (const auto& j : step_records(out)) {
      EXPECT_LE(int(j["data_queue"]), prefetch) << j;
      if (j["step"] > 2) most = std::max(most, int(j["data_queue"]));
    }
    EXPECT_EQ(most, prefetch);
  }
}

// The first line of `output` that starts with `prefix`, without the prefix ("" if none).
std::string line_after(const std::string& output, const std::string& prefix) {
  const size_t at = output.find(prefix);
  if (at == std::string::npos) return "";
  const size_t end = output.find('\n', at);
  return output.substr(at + prefix.size(), end - at - prefix.size());
}

// parallel.bucket_mb cuts the gradient buffer: half the size, about twice the buckets; and in
// the gradient buffer's own element size: 16-bit gradients (precision.grads = "compute") fit
// twice as many elements in a bucket, so the same bucket_mb gives half as many.
TEST_F(MpiCli, BucketSizeIsInTheGradientsOwnBytes) {
  auto buckets = [&](const std::string& name, const std::string& settings) {
    const std::string out = path(name);
    const auto r =
        mpirun(2, "--set model.n_layer=4 " + settings + " --set run.out_dir=" + quoted(out));
    EXPECT_EQ(r.code, 0) << r.output;
    const auto steps = step_records(out);
    EXPECT_FALSE(steps.empty()) << r.output;
    return std::pair{steps.empty() ? 0 : int(steps[0]["buckets"]), r.output};
  };
  const auto [fp32, fp32_log] = buckets("fp32", "--set parallel.bucket_mb=0.004");
  const auto [half_size, unused] = buckets("half", "--set parallel.bucket_mb=0.002");
  const auto [bf16, bf16_log] =
      buckets("bf16", "--set parallel.bucket_mb=0.004 --set precision.compute=" + quoted("bf16") +
                          " --set precision.grads=" + quoted("compute"));
  EXPECT_GT(fp32, 4);
  EXPECT_NEAR(half_size, 2 * fp32, 1);
  EXPECT_NEAR(2 * bf16, fp32, 1);
  // The start-up banner reports the same buckets and the gradient buffer's own type and size.
  EXPECT_NE(fp32_log.find(std::to_string(fp32) + " buckets of 0.00403 MB"), std::string::npos)
      << fp32_log;
  EXPECT_NE(bf16_log.find(std::to_string(bf16) + " buckets of 0.00403 MB"), std::string::npos)
      << bf16_log;
  EXPECT_NE(bf16_log.find("precision: compute bf16, gradients bf16,"), std::string::npos);
  EXPECT_NE(fp32_log.find("precision: compute fp32, gradients fp32,"), std::string::npos);
  const std::string mem32 = line_after(fp32_log, "memory: ");
  const std::string mem16 = line_after(bf16_log, "memory: ");
  const double grads32 = std::stod(line_after(mem32, ", gradients "));
  const double grads16 = std::stod(line_after(mem16, ", gradients "));
  EXPECT_NEAR(grads16, grads32 / 2, 0.011) << mem32 << "\n" << mem16;
}

// parallel.allreduce = "hierarchical": the bucket traffic goes to the node's and the cross-node
// communicators, not the data-parallel one, and across nodes it is a third of the whole (with 2
// ranks per node: reduce-scatter and all-gather inside, an all-reduce of halves across).
TEST_F(MpiCli, HierarchicalAllReduceSendsLessAcrossNodes) {
  auto groups = [&](const std::string& name, const std::string& settings) {
    const std::string out = path(name);
    const auto r = mpirun(
        4, "--set parallel.bucket_mb=0.002 " + settings + " --set run.out_dir=" + quoted(out));
    EXPECT_EQ(r.code, 0) << r.output;
    const auto steps = step_records(out);
    return steps.empty() ? nlohmann::json{} : steps.back()["bytes_sent_groups"];
  };
  const nlohmann::json flat = groups("flat", "");
  const nlohmann::json hier = groups("hier", "--set parallel.allreduce=" + quoted("hierarchical") +
                                                 " --set parallel.ranks_per_node=2");
  ASSERT_TRUE(flat.contains("dp")) << flat;
  EXPECT_FALSE(flat.contains("intra") || flat.contains("inter")) << flat;
  ASSERT_TRUE(hier.contains("intra") && hier.contains("inter")) << hier;
  EXPECT_FALSE(hier.contains("dp")) << hier;
  const double intra = hier["intra"], inter = hier["inter"], dp = flat["dp"];
  EXPECT_NEAR(inter / (intra + inter), 1.0 / 3, 0.01) << hier;
  EXPECT_NEAR(intra + inter, dp, 0.01 * dp) << flat << hier;
}

// parallel.order decides which ranks form each group: the start-up banner lists them.
TEST_F(MpiCli, RankOrderDecidesTheGroups) {
  const std::string layout = "--set parallel.dp=2 --set parallel.tp=2 ";
  auto r = mpirun(4, layout + "--set run.out_dir=" + quoted(path("tp_first")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(line_after(r.output, "  tp groups: "), "[0 1] [2 3]") << r.output;
  EXPECT_EQ(line_after(r.output, "  dp groups: "), "[0 2] [1 3]") << r.output;
  r = mpirun(4, layout + "--set parallel.order=" + quoted("dp-tp-pp") +
                    " --set run.out_dir=" + quoted(path("dp_first")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(line_after(r.output, "  tp groups: "), "[0 2] [1 3]") << r.output;
  EXPECT_EQ(line_after(r.output, "  dp groups: "), "[0 1] [2 3]") << r.output;
}

// One step's records (val_loss, sample) and the step records, from a run's metrics.jsonl.
std::vector<int64_t> steps_with(const std::string& out, const std::string& key) {
  std::vector<int64_t> v;
  std::ifstream in(out + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains(key)) v.push_back(j["step"]);
  }
  return v;
}

// [comm.compression]: warmup_steps uncompressed steps come first; buckets under min_bucket_kb
// stay uncompressed; topk_ratio and powersgd_rank set how much is sent; error_feedback keeps
// a residual per rank, which the checkpoint holds.
TEST_F(MpiCli, CompressionKnobsChangeWhatIsSent) {
  auto run = [&](const std::string& name, const std::string& method, const std::string& settings) {
    const std::string out = path(name);
    const auto r = mpirun(2, "--set train.steps=4 --set comm.compression.method=" + quoted(method) +
                                 " " + settings + " --set run.out_dir=" + quoted(out));
    EXPECT_EQ(r.code, 0) << r.output;
    return step_records(out);
  };
  auto sent = [](const std::vector<nlohmann::json>& steps) {
    return steps.empty() ? 0.0 : double(steps.back()["bytes_sent"]);
  };
  const auto warm = run("warmup", "int8", "--set comm.compression.warmup_steps=2");
  ASSERT_EQ(warm.size(), 4u);
  for (const auto& j : warm)
    if (j["step"] < 2)
      EXPECT_EQ(j["bytes_uncompressed"], 0) << j;
    else
      EXPECT_GT(j["bytes_uncompressed"], 0) << j;
  EXPECT_LT(double(warm[3]["bytes_sent"]), double(warm[0]["bytes_sent"]) / 3);

  const auto plain = run("plain", "none", "");
  const auto big = run("min_bucket", "int8", "--set comm.compression.min_bucket_kb=100000");
  for (const auto& j : big) EXPECT_EQ(j["bytes_uncompressed"], 0) << j;
  EXPECT_EQ(sent(big), sent(plain));

  const double top1 = sent(run("topk1", "topk", "--set comm.compression.topk_ratio=0.01"));
  const double top2 = sent(run("topk2", "topk", "--set comm.compression.topk_ratio=0.02"));
  EXPECT_NEAR(top2 / top1, 2.0, 0.1);
  const double rank2 = sent(run("psgd2", "powersgd", "--set comm.compression.powersgd_rank=2"));
  const double rank4 = sent(run("psgd4", "powersgd", "--set comm.compression.powersgd_rank=4"));
  EXPECT_GT(rank4, 1.4 * rank2);  // P and Q double; vectors and small matrices go uncompressed
  EXPECT_LT(rank4, 2.0 * rank2);

  auto state = [&](const std::string& name) {
    H5File f = H5File::open_read(path(name + "/checkpoints/step_00000004/state.h5"));
    return f.exists("comm/state/rank_0") ? f.shape("comm/state/rank_0")[0] : int64_t(0);
  };
  run("feedback", "int8", "");
  run("no_feedback", "int8", "--set comm.compression.error_feedback=false");
  EXPECT_GT(state("feedback"), 10000);  // a residual for every gradient element
  EXPECT_EQ(state("no_feedback"), 0);
}

// Hierarchically (two nodes of 2 ranks), compression is for the links between nodes: the node
// sums each bucket in full precision, only its parts cross nodes compressed, and they are
// gathered back in full precision. int8 sends a quarter of the inter-node bytes (and a scale per
// 256 values), the same intra-node bytes.
TEST_F(MpiCli, HierarchicalCompressionCompressesOnlyWhatCrossesNodes) {
  auto last_step = [&](const std::string& name, const std::string& method) {
    const std::string out = path(name);
    const auto r = mpirun(4, "--set train.steps=2 --set parallel.dp=4 --set parallel.allreduce=" +
                                 quoted("hierarchical") + " --set parallel.ranks_per_node=2 " +
                                 "--set comm.compression.method=" + quoted(method) +
                                 " --set run.out_dir=" + quoted(out));
    EXPECT_EQ(r.code, 0) << r.output;
    const auto steps = step_records(out);
    return steps.empty() ? nlohmann::json{} : steps.back()["bytes_sent_groups"];
  };
  const nlohmann::json plain = last_step("plain", "none"), int8 = last_step("int8", "int8");
  ASSERT_TRUE(plain.contains("inter") && int8.contains("inter")) << plain << int8;
  EXPECT_EQ(int8["intra"], plain["intra"]);
  EXPECT_EQ(int8.value("dp", 0), 0) << int8;  // nothing over the whole group
  const double ratio = double(int8["inter"]) / double(plain["inter"]);
  EXPECT_GT(ratio, 0.25);
  EXPECT_LT(ratio, 0.27);
}

// precision.stochastic_rounding: bf16 weights rounded from the fp32 master stochastically
// train differently from round-to-nearest, and reproducibly (a function of seed and step).
TEST_F(MpiCli, StochasticRoundingChangesTheBf16Trajectory) {
  auto losses = [&](const std::string& name, bool stochastic) {
    const std::string out = path(name);
    const auto r = mpirun(
        1, "--set train.steps=6 --set optim.lr=1e-2 --set precision.compute=" + quoted("bf16") +
               " --set precision.stochastic_rounding=" + (stochastic ? "true" : "false") +
               " --set run.out_dir=" + quoted(out));
    EXPECT_EQ(r.code, 0) << r.output;
    std::vector<double> v;
    for (const auto& j : step_records(out)) v.push_back(j["loss"]);
    return v;
  };
  const auto nearest = losses("nearest", false), sr = losses("sr", true),
             again = losses("sr2", true);
  ASSERT_EQ(sr.size(), 6u);
  EXPECT_EQ(sr, again);
  EXPECT_EQ(sr[0], nearest[0]);  // the same initial weights
  EXPECT_NE(sr, nearest);
}

// model.dropout reaches the training forwards (the first step's loss already differs: the same
// weights, dropped activations), deterministically.
TEST_F(MpiCli, DropoutReachesTrainingOnly) {
  auto records = [&](const std::string& name, double p) {
    const std::string out = path(name);
    const auto r = mpirun(1, "--set train.steps=3 --set train.val_every=3 --set model.dropout=" +
                                 std::to_string(p) + " --set run.out_dir=" + quoted(out));
    EXPECT_EQ(r.code, 0) << r.output;
    std::vector<double> loss;
    for (const auto& j : step_records(out)) loss.push_back(j["loss"]);
    return loss;
  };
  const auto plain = records("plain", 0), dropped = records("dropped", 0.2),
             again = records("again", 0.2);
  ASSERT_EQ(dropped.size(), 3u);
  EXPECT_NE(dropped[0], plain[0]);
  EXPECT_EQ(dropped, again);
}

// run.peak_tflops is the MFU denominator; run.threads the OpenMP threads each rank runs.
TEST_F(MpiCli, PeakAndThreadsReachTheRun) {
  auto run = [&](const std::string& name, const std::string& settings) {
    const std::string out = path(name);
    const auto r =
        mpirun(1, "--set train.steps=3 " + settings + " --set run.out_dir=" + quoted(out));
    EXPECT_EQ(r.code, 0) << r.output;
    const auto steps = step_records(out);
    return std::pair{
        steps.empty() ? 0.0 : double(steps.back()["mfu"]) / double(steps.back()["tokens_per_s"]),
        r.output};
  };
  const auto [one, one_log] = run("one", "--set run.peak_tflops=1.0 --set run.threads=1");
  const auto [two, two_log] = run("two", "--set run.peak_tflops=2.0 --set run.threads=2");
  EXPECT_NEAR(one / two, 2.0, 1e-9);
  EXPECT_NE(one_log.find("1 ranks x 1 threads"), std::string::npos) << one_log;
  EXPECT_NE(two_log.find("1 ranks x 2 threads"), std::string::npos) << two_log;
  EXPECT_NE(two_log.find("MFU peak: 2000.0 GFLOP/s per rank (configured)"), std::string::npos);
}

// MFU cannot exceed 100%, however wrong the start-up peak: here it is set to 1 MFLOP/s, as a
// start-up measurement disturbed a thousandfold would give (MFU was 10^5 % before). The model's
// own matmuls raise every rank's peak, the step records carry the world's peak, and MFU stays
// at or below 1 on one rank and on two unequal pipeline stages.
TEST_F(MpiCli, MfuCannotExceedOneWhenTheStartUpPeakIsWrong) {
  for (const auto& [ranks, layout] :
       {std::pair{1, std::string()}, std::pair{2, std::string("--set parallel.pp=2 ")}}) {
    const std::string out = path("out" + std::to_string(ranks));
    const auto r = mpirun(ranks, "--set train.steps=3 --set run.peak_tflops=1e-6 " + layout +
                                     "--set run.out_dir=" + quoted(out));
    ASSERT_EQ(r.code, 0) << r.output;
    const auto steps = step_records(out);
    ASSERT_EQ(steps.size(), 3u);
    for (const auto& j : steps) {
      EXPECT_GT(double(j["mfu"]), 0.0) << j;
      EXPECT_LE(double(j["mfu"]), 1.0) << j;
      EXPECT_GT(double(j["peak_flops"]), ranks * 1e6) << j;  // raised above the floor
    }
  }
}

// The learning rate the optimizer applies: Adam's first update moves every parameter by the
// step's learning rate (m / sqrt(v) = sign(g)), so the biases, which start at zero and are not
// decayed, end the first step at +-lr(0) = lr / warmup_steps. And which parameters weight decay
// touches: after one step, only the flagged group differs from a run without the flag.
TEST_F(MpiCli, LearningRateAndWeightDecayReachTheOptimizer) {
  auto run = [&](const std::string& name, const std::string& settings) {
    const auto r =
        mpirun(1, "--set train.steps=1 --set optim.lr=1e-2 --set optim.weight_decay=0.5 " +
                      settings + " --set run.out_dir=" + quoted(path(name)));
    EXPECT_EQ(r.code, 0) << r.output;
  };
  auto tensor = [&](const std::string& name, const std::string& param) {
    return checkpoint_param(path(name + "/checkpoints/step_00000001/state.h5"), param);
  };
  auto largest = [](const std::vector<float>& v) {
    float m = 0;
    for (float x : v) m = std::max(m, std::abs(x));
    return m;
  };
  run("warmup4", "--set optim.warmup_steps=4");
  EXPECT_NEAR(largest(tensor("warmup4", "h.0.mlp.fc.bias")), 1e-2 / 4, 1e-5);
  run("plain", "");
  EXPECT_NEAR(largest(tensor("plain", "h.0.mlp.fc.bias")), 1e-2, 1e-5);
  // The LR schedule as logged, for each schedule, against its definition.
  for (const std::string schedule : {"linear", "constant"}) {
    const std::string out = path("schedule_" + schedule);
    const auto r = mpirun(1,
                          "--set train.steps=6 --set optim.lr=1e-2 --set optim.min_lr=1e-3 "
                          "--set optim.warmup_steps=2 --set optim.schedule=" +
                              quoted(schedule) + " --set run.out_dir=" + quoted(out));
    ASSERT_EQ(r.code, 0) << r.output;
    const std::vector<double> want = schedule == "linear"
                                         ? std::vector<double>{5e-3, 1e-2, 1e-2, 7e-3, 4e-3, 1e-3}
                                         : std::vector<double>{5e-3, 1e-2, 1e-2, 1e-2, 1e-2, 1e-2};
    const auto steps = step_records(out);
    ASSERT_EQ(steps.size(), want.size());
    for (size_t i = 0; i < want.size(); i++)
      EXPECT_NEAR(double(steps[i]["lr"]), want[i], 1e-12) << schedule << " step " << i;
  }

  run("decay_embeddings", "--set optim.decay_embeddings=true");
  run("decay_norms", "--set optim.decay_norms_and_biases=true");
  EXPECT_NE(tensor("decay_embeddings", "wte.weight"), tensor("plain", "wte.weight"));
  EXPECT_EQ(tensor("decay_embeddings", "ln_f.weight"), tensor("plain", "ln_f.weight"));
  EXPECT_EQ(tensor("decay_norms", "wte.weight"), tensor("plain", "wte.weight"));
  EXPECT_NE(tensor("decay_norms", "ln_f.weight"), tensor("plain", "ln_f.weight"));
  // Matrices are decayed in all three runs alike.
  EXPECT_EQ(tensor("decay_norms", "h.0.mlp.fc.weight"), tensor("plain", "h.0.mlp.fc.weight"));
}

// log_every, val_every, val_batches and sample_every: which steps log a line, validate and
// sample, and over how many batches validation averages.
TEST_F(MpiCli, LoggingValidationAndSamplingFollowTheirIntervals) {
  const std::string out = path("intervals");
  auto r = mpirun(1,
                  "--set train.steps=8 --set train.log_every=3 --set train.val_every=2 "
                  "--set train.sample_every=3 --set train.sample_tokens=4 --set run.out_dir=" +
                      quoted(out));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(steps_with(out, "val_loss"), (std::vector<int64_t>{0, 2, 4, 6, 8}));
  EXPECT_EQ(steps_with(out, "sample"), (std::vector<int64_t>{0, 3, 6, 8}));
  std::vector<int64_t> logged;
  for (size_t at = r.output.find("\nstep "); at != std::string::npos;
       at = r.output.find("\nstep ", at + 1))
    if (r.output.compare(at + 12, 3, "/8 ") == 0)
      logged.push_back(std::stoll(r.output.substr(at + 6, 6)));
  EXPECT_EQ(logged, (std::vector<int64_t>{0, 3, 6, 7})) << r.output;

  auto val_loss = [&](int batches) {
    const std::string o = path("val" + std::to_string(batches));
    const auto v = mpirun(1,
                          "--set train.steps=1 --set train.val_every=1 --set run.overwrite=true "
                          "--set train.val_batches=" +
                              std::to_string(batches) + " --set run.out_dir=" + quoted(o));
    EXPECT_EQ(v.code, 0) << v.output;
    std::ifstream in(o + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);)
      if (const auto j = nlohmann::json::parse(line); j.contains("val_loss"))
        return double(j["val_loss"]);
    return double(NAN);
  };
  const double one = val_loss(1), four = val_loss(4);
  EXPECT_NE(one, four);
  EXPECT_EQ(four, val_loss(4));
}

// The position of the first metrics record with `key` (and step `step`), -1 if none.
int record_index(const std::string& out, const std::string& key, int64_t step) {
  std::ifstream in(out + "/metrics.jsonl");
  int i = 0;
  for (std::string line; std::getline(in, line); i++) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains(key) && j["step"] == step) return i;
  }
  return -1;
}

// checkpoint.async: a slow write (TRAINER_TEST_WRITE_DELAY) of step 2's checkpoint runs on the
// writer thread while step 3 goes on; with async = false step 3 waits for it. The log says
// which happened, also where MPI gives no thread support (then every write is in the step).
TEST_F(MpiCli, CheckpointsWriteInTheBackgroundOrInTheStep) {
  struct Case {
    std::string name, settings, env;
    bool background;
  };
  const std::vector<Case> cases = {
      {"async", "", "", true},
      {"sync", "--set checkpoint.async=false", "", false},
      {"funneled", "", "TRAINER_MPI_THREAD_LEVEL=funneled ", false},
  };
  for (const Case& c : cases) {
    const std::string out = path(c.name);
    const auto r = mpirun(2,
                          "--set train.steps=6 --set checkpoint.every_steps=2 " + c.settings +
                              " --set run.out_dir=" + quoted(out),
                          c.env + "TRAINER_TEST_WRITE_DELAY=2,1.5 ");
    ASSERT_EQ(r.code, 0) << r.output;
    const int written = record_index(out, "checkpoint", 2), next = record_index(out, "loss", 3);
    ASSERT_GE(written, 0) << c.name;
    EXPECT_EQ(next < written, c.background) << c.name << ": step 3 at record " << next
                                            << ", step 2's checkpoint written at " << written;
    std::ifstream in(out + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.contains("checkpoint_stall_ms") && j["step"] == 2) {
        EXPECT_EQ(j["async"], c.background);
      }
    }
    EXPECT_EQ(count(r.output, "written synchronously, not in the background"),
              c.name == "funneled" ? 1 : 0)
        << r.output;
  }
}

// checkpoint_timeout_s ends the job when a write hangs: on the writer thread (async), when the
// step waits for it (async = false), and in the step itself without thread support.
TEST_F(MpiCli, HungCheckpointWritesEndTheJobAfterTheTimeout) {
  for (const std::string& settings : {std::string("--set checkpoint.async=false"), std::string(""),
                                      std::string("--set checkpoint.async=false#funneled")}) {
    const bool funneled = settings.ends_with("#funneled");
    const std::string set = settings.substr(0, settings.find('#'));
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = mpirun(2,
                          "--set train.steps=6 --set checkpoint.every_steps=2 "
                          "--set faults.checkpoint_timeout_s=1 --set run.overwrite=true " +
                              set,
                          std::string(funneled ? "TRAINER_MPI_THREAD_LEVEL=funneled " : "") +
                              "TRAINER_TEST_WRITE_DELAY=2,40 ");
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(r.code, 0) << settings << "\n" << r.output;
    EXPECT_NE(r.code, 124) << "hung: " << settings;
    EXPECT_LT(seconds, 20) << settings;
    EXPECT_NE(r.output.find("the checkpoint write of step 2 did not finish within 1 s"),
              std::string::npos)
        << settings << "\n"
        << r.output;
  }
}

}  // namespace
}  // namespace trainer
