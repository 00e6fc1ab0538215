#pragma once
// `trainer plan`: a parallel layout, memory policy and micro-batch that fit a cluster, for the
// model and global batch of a config. It enumerates dp x tp x pp (x cp on the CPU backend) x
// ZeRO stage x recomputation x micro-batch size, keeps what fits in each device's memory (the
// same accounting the trainer allocates by and checks at start-up, trainer/memory_budget.h,
// whose figure the tests hold against measured peaks), and ranks the rest by an estimated step
// time: the model's FLOPs at a stated efficiency, the 1F1B bubble, and the communication each
// layout adds (tensor-parallel all-reduces inside a node, the ring's keys and values, the
// data-parallel reduction's exposed part) over the given bandwidths.
#include <string>
#include <vector>

#include "comm/parallel_dims.h"
#include "io/config.h"
#include "trainer/memory_budget.h"

namespace trainer {

// The cluster a plan is for: N devices of one kind.
struct Cluster {
  int devices = 1;
  int per_node = 8;
  double memory_bytes = 80e9;  // per device
  double peak_flops = 989e12;  // per device, dense, in the config's compute precision
  // Bus bandwidths for collectives, bytes/s per device: inside a node (NVLink) and between
  // nodes (the NIC).
  double intra_bytes_per_s = 450e9, inter_bytes_per_s = 50e9;
  // Where the figure inside a node comes from: "given", "assumed" (a default), or "measured":
  // an all-reduce timed among the node's ranks on this machine, their sharing of the cores
  // included (the estimate then does not divide it among them again).
  std::string intra_source = "assumed";
  // CPU ranks sharing a node's cores: threads wanted per core (1 or less: a core each; the peak
  // is a rank's with its cores to itself). Above 1, ranks all busy at once share the cores, and
  // the time a rank idles in the pipeline's bubble is compute for the others on its cores.
  double oversubscription = 1;
  std::string name = "H100 80GB";
};

struct PlanOptions {
  Cluster cluster;
  double efficiency = 0.5;  // of peak_flops the kernels reach (model FLOPs utilisation)
  double headroom = 0.1;    // of the memory kept free (allocator, libraries, fragmentation)
};

// One runnable choice and what it costs.
struct Candidate {
  int dp = 1, tp = 1, pp = 1, cp = 1, zero = 0;
  std::string recompute = "none";
  int micro_batch = 1, accum = 1;
  bool offload = false;
  MemoryBudget memory = {};  // the largest rank's (its pipeline stage: `stage`)
  int stage = 0;
  double bytes = 0;  // that rank's device memory
  // The step's estimate, seconds: compute (recomputation included) and the bubble, and the
  // exposed communication of tensor, context and data parallelism, and the optimizer.
  double compute_s = 0, bubble_s = 0, tp_s = 0, cp_s = 0, dp_s = 0, optimizer_s = 0;
  double total_s() const { return compute_s + bubble_s + tp_s + cp_s + dp_s + optimizer_s; }
};

struct Plan {
  int64_t global_sequences = 0;      // the config's global batch
  std::vector<Candidate> fitting;    // ranked, fastest first
  std::vector<std::string> reasons;  // why the other classes were dropped (for --explain)
  Candidate smallest = {};           // the least memory of all considered (when nothing fits)
  bool considered_any = false;
};

// The global batch a plan keeps, in sequences: the config's micro_batch x grad_accum x dp, its
// dp derived over `devices` when 0 (as the trainer derives it from the world); with a batch
// ramp, the ramp's last batch.
int64_t global_batch(const Config& cfg, int devices);

// Every choice for `cfg`'s model and global batch on the cluster; offload: with the optimizer
// offloaded to host memory.
Plan make_plan(const Config& cfg, const PlanOptions& options, bool offload);

// The estimate for the layout `cfg` configures on `dims` (its memory from the largest stage).
Candidate estimate_layout(const Config& cfg, const ParallelDims& dims, const PlanOptions& options);

// The config lines ([parallel], [memory], [train]) that run a candidate.
std::string candidate_toml(const Candidate& c);

// trainer plan: prints the five fastest that fit with their memory and time, and the TOML of
// the best; with explain, why the rest lost. When nothing fits, says so, what would fit with the
// optimizer offloaded, and returns 2.
struct PlanArgs {
  std::string config;
  std::vector<std::string> overrides;
  PlanOptions options;
  bool explain = false;
};
int plan_command(const PlanArgs& args);

// A device's dense peak in the precision given, from its name (h100, h200, a100, l40s, b200),
// or 0 when unknown.
double device_peak_flops(const std::string& name, const std::string& precision);

// The cluster of the command line, each value not given (0, "") from the device: a GPU's data
// sheet (by `device`'s name, or a number of TFLOP/s), or with [run] device = "cpu" this machine
// (its available memory and a measured sgemm, shared by the ranks of a node). Bandwidths in
// Gbit/s (measured_intra_gbps: see set_bandwidths). Throws ConfigError naming --gpu when it is
// neither.
void set_cluster_defaults(Cluster& k, const Config& cfg, const std::string& device, int per_node,
                          double memory_gb, double intra_gbps, double inter_gbps,
                          double measured_intra_gbps = 0);
// The bandwidths alone (Gbit/s; 0: the default, shared memory or NVLink inside a node, Ethernet
// or InfiniBand between nodes); measured_intra_gbps (0: none), in place of the default inside a
// node: all_reduce_gbps among a node's ranks (comm/bus_bandwidth.h).
void set_bandwidths(Cluster& k, bool cpu, double intra_gbps, double inter_gbps,
                    double measured_intra_gbps = 0);

}  // namespace trainer
