#include "trainer/planner.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <thread>

#include "comm/parallel_dims.h"
#include "io/errors.h"
#include "kernels/kernels.h"
#include "model/model_definition.h"
#include "trainer/report_error.h"
#include "trainer/run.h"

namespace trainer {
namespace {

std::vector<int> divisors(int64_t n) {
  std::vector<int> d;
  for (int64_t i = 1; i <= n; i++)
    if (n % i == 0) d.push_back(int(i));
  return d;
}

// Time of an all-reduce of `bytes` over n devices (a ring's 2 (n - 1) / n of it on each link).
double all_reduce_s(double bytes, int n, double bytes_per_s) {
  return n > 1 ? 2.0 * (n - 1) / n * bytes / bytes_per_s : 0;
}

// The step's estimate for a candidate whose memory is known (see Candidate's fields).
void estimate(Candidate& c, const Config& cfg, const PlanOptions& o) {
  const ModelConfig& m = cfg.model;
  const Cluster& k = o.cluster;
  const double T = m.seq_len, C = m.d_model;
  const double act = dtype_size(compute_dtype(cfg.precision));
  const double grad = cfg.precision.grads == "fp32" ? 4 : act;
  // Full recomputation runs the blocks' forward again (a third of their FLOPs; not the embedding
  // or the head). Selective remakes the MLP's activation only, elementwise: no FLOPs counted.
  const double block_scale = c.recompute == "full" ? 4.0 / 3 : 1;
  // A micro-batch through stage s takes t_s on one rank at its peak (its tokens shared by the
  // tp x cp ranks of the stage). With 1F1B the slowest stage works through all M micro-batches,
  // and the others' time before its first and after its last is the fill and drain:
  // (M - 1) t_max + sum t_s (balanced stages: (M + S - 1) t, the bubble (S - 1) / M of compute).
  // That is 1F1B's schedule (pipeline_bubble) when the slowest stage is the last, the head's, as
  // the partition usually leaves it; elsewhere a bound.
  const double micro = double(c.micro_batch) * T * flops_per_token(m) / (c.tp * c.cp) /
                       (k.peak_flops * o.efficiency);
  double slowest = 0, through = 0;
  for (double share : pipeline_stage_shares(m, c.pp, block_scale)) {
    slowest = std::max(slowest, share * micro);
    through += share * micro;
  }
  c.compute_s = c.accum * slowest;
  c.bubble_s = through - slowest;  // the fill and drain (exactly 0 for one stage)
  const double all_busy = k.oversubscription * c.accum * through / c.pp;
  if (all_busy > c.compute_s) {
    // Ranks sharing cores: all of them busy take `oversubscription` times as long; a rank idle in
    // the bubble leaves its share of the cores to the others.
    c.bubble_s = std::max(0.0, c.compute_s + c.bubble_s - all_busy);
    c.compute_s = all_busy;
  }
  // A CPU collective inside a node is copies and sums on the ranks' cores: ranks sharing cores
  // share its bandwidth (a measured figure has that in it), and with no core to spare nothing
  // hides it behind backward.
  const double oversubscribed = std::max(1.0, k.oversubscription);
  const double intra_bw =
      k.intra_source == "measured" ? k.intra_bytes_per_s : k.intra_bytes_per_s / oversubscribed;
  const double layers = std::ceil(double(m.n_layer) / c.pp);
  const double rows = double(c.micro_batch) * T / c.cp;  // a micro-batch's tokens on a rank
  // Tensor parallelism: two all-reduces of the stream in each block's forward and two in its
  // backward (sequence parallelism moves the same bytes), two more where the forward is re-run.
  const int tp_collectives = c.recompute == "full" ? 6 : 4;
  c.tp_s = tp_collectives * layers * c.accum * all_reduce_s(rows * C * act, c.tp, intra_bw);
  // Context parallelism: the ring passes each rank's qkv rows cp - 1 times forward, and again in
  // backward, and their gradients (fp32 with 16-bit activations) cp times, home included.
  const double qkv = double(m.d_model + 2 * int64_t(m.kv_heads()) * m.head_size()) / c.tp;
  const double ring = rows * qkv * act;
  const double cp_bw = c.tp * c.cp <= k.per_node ? intra_bw : k.inter_bytes_per_s;
  c.cp_s =
      c.cp > 1 ? layers * c.accum * ((c.cp - 1) * 2 * ring + c.cp * rows * qkv * 4) / cp_bw : 0;
  // Data parallelism over the dp x cp replicas: the gradients reduced and (ZeRO) the updated
  // pieces gathered; ZeRO-3 gathers each unit's weights again for forward and backward. The
  // reduction overlaps backward: ZeRO-0/1 reduce during the last micro-batch's, ZeRO-2/3 during
  // each one's; what backward cannot cover is exposed.
  const int R = c.dp * c.cp;
  const double params = double(param_table(m).total) / (c.tp * c.pp);
  const double share = R > 1 ? double(R - 1) / R : 0;
  const double dp_bw = k.devices <= k.per_node ? intra_bw : k.inter_bytes_per_s;
  // Without [parallel] overlap the reduction starts after backward: nothing hides it.
  const double backward =
      cfg.parallel.overlap && k.oversubscription <= 1 ? c.compute_s * 2 / 3 / c.accum : 0;
  const double gather = share * params * act / dp_bw;
  if (c.zero <= 1) {
    c.dp_s = std::max(0.0, 2 * share * params * grad / dp_bw - backward);
  } else {
    const double reduce = share * params * grad / dp_bw;  // every micro-batch
    c.dp_s = c.accum * std::max(0.0, reduce - backward) + gather;
    if (c.zero == 3) c.dp_s += 2 * c.accum * std::max(0.0, gather - backward / 2);
  }
  // The optimizer reads and writes its state (16 bytes a parameter); offloaded, the host does
  // at ~20 GB/s after the gradients crossed PCIe (~25 GB/s) and before the fp32 weights cross
  // back.
  const double owned = c.zero ? params / R : params;
  c.optimizer_s = c.offload ? owned * 16 / 20e9 + owned * (grad + 4) / 25e9
                            : owned * 16 / (cfg.run.device == "cpu" ? 10e9 : 2e12);
}

std::string gb(double bytes) {
  return fmt::format("{:.1f}", bytes / 1e9);
}

std::string layout_name(const Candidate& c) {
  return fmt::format("dp {} tp {} pp {}{} zero {} recompute {} micro-batch {} x {}{}", c.dp, c.tp,
                     c.pp, c.cp > 1 ? fmt::format(" cp {}", c.cp) : "", c.zero, c.recompute,
                     c.micro_batch, c.accum, c.offload ? " offload" : "");
}

void print_candidates(const Plan& p, const Config& cfg, int shown) {
  fmt::print(
      "  #  layout{:62} | device GB: total (weights, gradients, activations, optimizer, other) | "
      "step s: total (compute, bubble, tp, cp, dp, optimizer) | tokens/s\n",
      "");
  for (int i = 0; i < std::min<int>(shown, int(p.fitting.size())); i++) {
    const Candidate& c = p.fitting[i];
    const MemoryBudget& b = c.memory;
    const double weights = double(b.model.params) + b.param_shard + b.param_windows;
    const double grads = double(b.model.grads) + b.grad_windows + b.grad_shard;
    const double acts = double(b.model.activations + b.model.stats);
    // The optimizer's part of `bytes`: on a GPU without its offloaded state.
    const double optimizer =
        b.optimizer + b.offload_staging - (c.bytes < b.total() ? b.offloaded : 0);
    const double other = c.bytes - weights - grads - acts - optimizer;
    fmt::print(
        "  {}  {:68} | {:>6} ({}, {}, {}, {}, {}) | {:.3g} ({:.3g}, {:.3g}, {:.3g}, {:.3g}, "
        "{:.3g}, {:.3g}) | {:.0f}\n",
        i + 1, layout_name(c), gb(c.bytes), gb(weights), gb(grads), gb(acts), gb(optimizer),
        gb(other), c.total_s(), c.compute_s, c.bubble_s, c.tp_s, c.cp_s, c.dp_s, c.optimizer_s,
        double(p.global_sequences) * cfg.model.seq_len / c.total_s());
  }
}

}  // namespace

int64_t global_batch(const Config& cfg, int devices) {
  if (!cfg.train.batch_ramp.empty()) return cfg.train.batch_ramp.back()[1];
  const ParallelConfig& p = cfg.parallel;
  const int dp = p.dp > 0 ? p.dp : std::max(1, devices / std::max(1, p.tp * p.pp * p.cp));
  return int64_t(cfg.train.micro_batch) * cfg.train.grad_accum * dp;
}

double device_peak_flops(const std::string& name, const std::string& precision) {
  std::string n;
  for (char ch : name) n += char(std::tolower(static_cast<unsigned char>(ch)));
  const bool half = precision != "fp32";
  // Dense tensor-core peaks from the data sheets (SXM parts); fp32: TF32.
  if (n.starts_with("h100") || n.starts_with("h200")) return half ? 989e12 : 495e12;
  if (n.starts_with("b200")) return half ? 2250e12 : 1100e12;
  if (n.starts_with("a100")) return half ? 312e12 : 156e12;
  if (n.starts_with("l40s")) return half ? 362e12 : 183e12;
  return 0;
}

void set_cluster_defaults(Cluster& k, const Config& cfg, const std::string& device, int per_node,
                          double memory_gb, double intra_gbps, double inter_gbps,
                          double measured_intra_gbps) {
  const bool cpu = cfg.run.device == "cpu";
  // A CPU plan's ranks share this machine, one a core at most; GPUs come 8 to a node.
  const int cores = std::max(1, int(std::thread::hardware_concurrency()));
  k.per_node = per_node > 0 ? per_node : cpu ? std::clamp(cores, 1, k.devices) : 8;
  // The threads a CPU rank runs (per_node unbound ranks share the cores out); its ranks' threads
  // over the node's cores above 1: they take turns.
  const int threads = threads_per_rank(cfg.run.threads, double(cores) / k.per_node);
  if (cpu) k.oversubscription = double(k.per_node) * threads / cores;
  if (cpu && device.empty()) {
    // This machine: a few 1024-cubed sgemms on the threads this process runs (on the cores it may
    // run on: under mpirun perhaps one), and MemAvailable. A rank's peak is a core's rate times
    // the cores its threads take (with all ranks busy, the estimate shares them out).
    auto kernels = make_cpu_kernels();
    const int n = 1024;
    DPtr a = kernels->alloc(int64_t(n) * n, DType::f32),
         w = kernels->alloc(int64_t(n) * n, DType::f32),
         out = kernels->alloc(int64_t(n) * n, DType::f32);
    for (int i = 0; i < 4; i++) kernels->matmul_forward(out, a, w, DPtr{}, n, n, n);
    const int ran_on = std::clamp(std::min(omp_get_max_threads(), omp_get_num_procs()), 1, cores);
    k.peak_flops = kernels->peak_flops(DType::f32) / ran_on * std::min(threads, cores);
    for (DPtr p : {a, w, out}) kernels->free(p);
    k.name = fmt::format("CPU rank ({:.0f} GFLOP/s sgemm)", k.peak_flops / 1e9);
    std::ifstream in("/proc/meminfo");
    for (std::string key; in >> key;) {
      double kb = 0;
      in >> kb;
      if (key == "MemAvailable:") k.memory_bytes = kb * 1024 / k.per_node;
      in.ignore(1 << 10, '\n');
    }
  } else {
    const std::string name = device.empty() ? "h100" : device;
    char* end = nullptr;
    const double tflops = std::strtod(name.c_str(), &end);
    if (end && *end == '\0' && tflops > 0) {
      k.peak_flops = tflops * 1e12;
      k.name = fmt::format("{:g}-TFLOP/s device", tflops);
    } else {
      k.peak_flops = device_peak_flops(name, cfg.precision.compute);
      if (k.peak_flops <= 0)
        throw ConfigError(fmt::format(
            "--gpu: \"{}\" is neither a known GPU (h100, h200, a100, b200, l40s) nor TFLOP/s",
            name));
      k.name = name;
      k.memory_bytes = name.starts_with("h200")   ? 141e9
                       : name.starts_with("b200") ? 192e9
                       : name.starts_with("l40s") ? 48e9
                                                  : 80e9;
    }
  }
  if (memory_gb > 0) k.memory_bytes = memory_gb * 1e9;
  set_bandwidths(k, cpu, intra_gbps, inter_gbps, measured_intra_gbps);
}

void set_bandwidths(Cluster& k, bool cpu, double intra_gbps, double inter_gbps,
                    double measured_intra_gbps) {
  k.intra_source = intra_gbps > 0 ? "given" : measured_intra_gbps > 0 ? "measured" : "assumed";
  const double intra = intra_gbps > 0            ? intra_gbps
                       : measured_intra_gbps > 0 ? measured_intra_gbps
                       : cpu                     ? 40
                                                 : 3600;
  k.intra_bytes_per_s = intra * 1e9 / 8;
  k.inter_bytes_per_s = (inter_gbps > 0 ? inter_gbps : cpu ? 10 : 400) * 1e9 / 8;
}

Plan make_plan(const Config& base, const PlanOptions& o, bool offload) {
  const ModelConfig& m = base.model;
  const Cluster& k = o.cluster;
  const bool gpu = base.run.device != "cpu";
  Plan plan;
  plan.global_sequences = global_batch(base, k.devices);
  const int64_t G = plan.global_sequences;
  const double limit = k.memory_bytes * (1 - o.headroom);
  std::map<std::string, int> dropped;  // a reason, and how many choices it dropped
  int64_t too_big = 0;
  for (int tp : divisors(k.devices)) {
    if (tp > k.per_node) {
      dropped[fmt::format(
          "tp {}: more than a node's {} devices (tensor parallelism stays inside "
          "one)",
          tp, k.per_node)]++;
      continue;
    }
    for (int pp : divisors(k.devices / tp))
      for (int cp : divisors(k.devices / tp / pp)) {
        const int dp = k.devices / tp / pp / cp;
        if (cp > 1 && gpu) {
          dropped["cp > 1: the CUDA backend has no ring attention yet"]++;
          continue;
        }
        ParallelDims dims;
        try {
          dims = ParallelDims::make(k.devices, dp, tp, pp, base.parallel.order, m, cp);
        } catch (const ConfigError& e) {
          dropped[e.what()]++;
          continue;
        }
        if (G % dp) {
          dropped[fmt::format("dp {}: does not divide the global batch of {} sequences", dp, G)]++;
          continue;
        }
        for (int mb : divisors(G / dp))
          for (int zero = 0; zero <= 3; zero++) {
            if (zero > 0 && dp * cp == 1) continue;  // nothing to shard over
            if (zero >= 2 && base.comm.compression.method != "none") {
              dropped["zero 2 and 3: gradient compression applies to ZeRO 0 and 1 only"]++;
              continue;
            }
            for (const char* recompute : {"none", "selective", "full"}) {
              Config c = base;
              c.parallel.dp = dp;
              c.parallel.tp = tp;
              c.parallel.pp = pp;
              c.parallel.cp = cp;
              c.parallel.zero = zero;
              c.parallel.micro_batches = 0;
              c.parallel.sequence_parallel = base.parallel.sequence_parallel && tp > 1;
              c.train.micro_batch = mb;
              c.train.grad_accum = int(G / dp / mb);
              c.train.batch_ramp.clear();  // the plan is for the ramp's last batch
              c.memory.recompute = recompute;
              c.memory.recompute_layers = 0;
              c.memory.offload_optimizer = offload;
              if (c.parallel.sequence_parallel && int64_t(mb) * (m.seq_len / cp) % tp) continue;
              Candidate cand = estimate_layout(c, dims, o);
              if (!plan.considered_any || cand.bytes < plan.smallest.bytes) plan.smallest = cand;
              plan.considered_any = true;
              if (cand.bytes > limit) {
                too_big++;
                continue;
              }
              plan.fitting.push_back(cand);
            }
          }
      }
  }
  // Fastest first; of equally fast ones, the one that holds the least.
  std::stable_sort(
      plan.fitting.begin(), plan.fitting.end(), [](const Candidate& a, const Candidate& b) {
        return a.total_s() != b.total_s() ? a.total_s() < b.total_s() : a.bytes < b.bytes;
      });
  for (const auto& [why, n] : dropped)
    plan.reasons.push_back(fmt::format("{} ({} layout{})", why, n, n == 1 ? "" : "s"));
  if (too_big)
    plan.reasons.push_back(
        fmt::format("{} choices need more than the {} GB a device has free (the least: {} GB, {})",
                    too_big, gb(limit), gb(plan.smallest.bytes), layout_name(plan.smallest)));
  return plan;
}

Candidate estimate_layout(const Config& cfg, const ParallelDims& dims, const PlanOptions& o) {
  const bool gpu = cfg.run.device != "cpu";
  Candidate cand{dims.dp(),
                 dims.tp(),
                 dims.pp(),
                 dims.cp(),
                 cfg.parallel.zero,
                 cfg.memory.recompute,
                 cfg.train.micro_batch,
                 cfg.train.grad_accum,
                 cfg.memory.offload_optimizer};
  // Consecutive ranks share a node, as mpirun places them by slot.
  const int per_node =
      cfg.parallel.ranks_per_node > 0 ? cfg.parallel.ranks_per_node : o.cluster.per_node;
  for (int s = 0; s < dims.pp(); s++) {  // the largest stage's first rank
    const RankCoords first{0, 0, s, 0};
    const MemoryBudget b = memory_budget(
        cfg, dims, first,
        node_ranks(cfg, dims, dims.rank_of(first), [&](int r) { return r / per_node; }));
    const double bytes = gpu ? b.device() : b.total();
    if (bytes > cand.bytes) cand.bytes = bytes, cand.memory = b, cand.stage = s;
  }
  estimate(cand, cfg, o);
  return cand;
}

std::string candidate_toml(const Candidate& c) {
  std::string t = fmt::format("[parallel]\ndp = {}\ntp = {}\npp = {}\n", c.dp, c.tp, c.pp);
  if (c.cp > 1) t += fmt::format("cp = {}\n", c.cp);
  t += fmt::format("zero = {}\n\n[memory]\nrecompute = \"{}\"\n", c.zero, c.recompute);
  if (c.offload) t += "offload_optimizer = true\n";
  t += fmt::format("\n[train]\nmicro_batch = {}\ngrad_accum = {}\n", c.micro_batch, c.accum);
  return t;
}

int plan_command(const PlanArgs& args) {
  const Config cfg = load_config(args.config, args.overrides);
  const PlanOptions& o = args.options;
  const Cluster& k = o.cluster;
  fmt::print(
      "plan: {} ({:.2f}B parameters, seq_len {}) on {} x {} ({} GB each, {} GB usable; {:.3g} "
      "TFLOP/s {} at {:.0f}%; {:.3g} GB/s {} inside nodes of {}, {:.3g} GB/s between them); "
      "global batch {} sequences\n",
      cfg.run.name, double(param_table(cfg.model).total) / 1e9, cfg.model.seq_len, k.devices,
      k.name, gb(k.memory_bytes), gb(k.memory_bytes * (1 - o.headroom)), k.peak_flops / 1e12,
      cfg.precision.compute, 100 * o.efficiency, k.intra_bytes_per_s / 1e9, k.intra_source,
      k.per_node, k.inter_bytes_per_s / 1e9, global_batch(cfg, k.devices));
  const Plan p = make_plan(cfg, o, cfg.memory.offload_optimizer);
  auto explain = [&](const Plan& plan) {
    if (!args.explain) return;
    fmt::print("not considered or dropped:\n");
    for (const std::string& why : plan.reasons) fmt::print("  {}\n", why);
  };
  if (!p.fitting.empty()) {
    fmt::print("{} choices fit; the fastest:\n", p.fitting.size());
    print_candidates(p, cfg, 5);
    explain(p);
    fmt::print("\nthe best, as config:\n\n{}", candidate_toml(p.fitting.front()));
    return 0;
  }
  // The verdict on stderr, the rest (what would fit, --explain) on stdout as for a plan.
  if (!p.considered_any) {
    fmt::print(stderr,
               "trainer: plan: no layout of {} devices applies to this model (see --explain)\n",
               k.devices);
    explain(p);
    return kExitBadInput;
  }
  fmt::print(stderr,
             "trainer: plan: nothing fits: every choice needs more than the {} GB a device has "
             "free (the least: {} GB, {})\n",
             gb(k.memory_bytes * (1 - o.headroom)), gb(p.smallest.bytes), layout_name(p.smallest));
  explain(p);
  if (!cfg.memory.offload_optimizer) {
    const Plan off = make_plan(cfg, o, true);
    if (!off.fitting.empty()) {
      fmt::print("with [memory] offload_optimizer = true, {} choices fit; the fastest:\n",
                 off.fitting.size());
      print_candidates(off, cfg, 5);
      fmt::print("\nthe best, as config:\n\n{}", candidate_toml(off.fitting.front()));
    } else {
      fmt::print("nor with the optimizer offloaded: more devices, or more memory each\n");
    }
  }
  return kExitBadInput;
}

}  // namespace trainer
