#include "trainer/memory_budget.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "comm/grad_reducer.h"
#include "comm/param_gatherer.h"
#include "trainer/metrics.h"
#include "trainer/run.h"

namespace trainer {

// A "Vm...:  123 kB" line of /proc/self/status, in MB.
static double proc_status_mb(std::string_view key) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.starts_with(key)) return std::stod(line.substr(key.size())) / 1024;
  return 0;
}
double peak_rss_mb() {
  return proc_status_mb("VmHWM:");
}
ResidentMemory resident_memory() {
  return {proc_status_mb("VmRSS:"), proc_status_mb("RssFile:")};
}

std::vector<PlannedAndMeasured> planned_and_measured(Run& run, ResidentMemory before_model,
                                                     SnapshotCopy copy) {
  const Config& cfg = run.cfg;
  const MemoryBudget b = memory_budget(cfg, run.dims, run.dims.coords(run.world.rank()),
                                       run.groups.intra ? run.groups.intra->size() : 0);
  const double MB = 1 << 20;
  double mine[3] = {0, 0, b.collectives / MB};
  if (cfg.run.device == "cpu") {
    const double held = copy == SnapshotCopy::taken     ? b.snapshot
                        : copy == SnapshotCopy::touched ? b.snapshot_weights
                                                        : 0;
    mine[0] = (b.total() - b.snapshot + held) / MB;
    mine[1] =
        peak_rss_mb() - before_model.total_mb - (resident_memory().file_mb - before_model.file_mb);
  } else {
    mine[0] = b.device() / MB;
    mine[1] = double(run.kernels->memory().peak) / MB;
  }
  std::vector<double> all(3 * size_t(run.world.size()));
  run.world.comm().all_gather(host_ptr(mine), host_ptr(all.data()), 3);
  std::vector<PlannedAndMeasured> out;
  if (run.world.rank() == 0)
    for (size_t r = 0; r < all.size(); r += 3) out.push_back({all[r], all[r + 1], all[r + 2]});
  return out;
}

void report_memory(Run& run, ResidentMemory before_model, SnapshotCopy copy, MetricsLog* log) {
  const double rss = peak_rss_mb();
  double rss_max = rss;
  run.world.comm().all_reduce(host_ptr(&rss_max), 1, ReduceOp::max);
  double gpu_peak = double(run.kernels->memory().peak) / (1 << 20), gpu_peak_max = gpu_peak;
  run.world.comm().all_reduce(host_ptr(&gpu_peak_max), 1, ReduceOp::max);
  const std::vector<PlannedAndMeasured> plan_check = planned_and_measured(run, before_model, copy);
  if (log) {
    fmt::print("peak memory: {:.0f} MB on rank 0, {:.0f} MB on the largest rank\n", rss, rss_max);
    // The plan's accounting (the planner's) against what each rank held.
    std::string ranks;
    double worst = 0;
    nlohmann::json planned_mb, measured_mb, bound_mb;
    for (size_t r = 0; r < plan_check.size(); r++) {
      const auto [plan, got, bound] = plan_check[r];
      // The reduction temporaries are a bound: anything between the count and the plan is on it.
      const double counted = plan - bound;
      const double off = got > plan ? got / plan - 1 : got < counted ? got / counted - 1 : 0;
      if (std::abs(off) > std::abs(worst)) worst = off;
      ranks += fmt::format("{}{}: {:.1f} / {:.1f}", r ? ", " : "", r, plan, got);
      planned_mb.push_back(plan);
      measured_mb.push_back(got);
      bound_mb.push_back(bound);
    }
    fmt::print("memory plan per rank (planned / measured MB, {}): {} | worst {:+.1f}%\n",
               run.cfg.run.device == "cpu"
                   ? fmt::format("peak RSS above the {:.0f} MB held before the model on "
                                 "rank 0, less file pages",
                                 before_model.total_mb)
                   : "the GPU allocator's peak",
               ranks, 100 * worst);
    log->event({{"memory_planned_mb", planned_mb},
                {"memory_measured_mb", measured_mb},
                {"memory_bound_mb", bound_mb}});
    if (run.cfg.run.device == "cuda") {
      fmt::print("peak GPU memory: {:.0f} MB on rank 0, {:.0f} MB on the largest rank\n", gpu_peak,
                 gpu_peak_max);
      log->event({{"peak_gpu_mb_rank0", gpu_peak}, {"peak_gpu_mb_max", gpu_peak_max}});
    }
    log->event({{"peak_rss_mb_rank0", rss}, {"peak_rss_mb_max", rss_max}});
  }
}

// node_ranks: see memory_budget.h.
MemoryBudget memory_budget(const Config& cfg, const ParallelDims& dims, const RankCoords& me,
                           int node_ranks) {
  const DType dtype = compute_dtype(cfg.precision);
  const StageOptions o = Run::model_options(cfg, me, dims, nullptr, nullptr);
  MemoryBudget b;
  b.model =
      StageExecutor::memory_needed(cfg.model, dtype, cfg.train.micro_batch, cfg.model.seq_len, o);
  const ParamTable table = param_table(cfg.model, *o.shard, o.total_multiple);
  const double elems = double(table.total);
  // With outer steps a node's ranks share the ZeRO shards and the reductions; else the replicas.
  const bool outer = cfg.comm.outer.on() && node_ranks > 0;
  const int shard_ranks = outer ? node_ranks : dims.replicas();
  const double owned = cfg.parallel.zero ? elems / shard_ranks : elems;
  b.optimizer = owned * 4 * (is_half(dtype) || cfg.memory.offload_optimizer ? 3 : 2);
  if (cfg.memory.offload_optimizer) {
    // Segments: whole parameters, or their ZeRO pieces (at most a piece of the shard).
    double largest = 0;
    for (const ParamInfo& p : table.params) largest = std::max(largest, double(p.numel));
    if (cfg.parallel.zero) largest = std::min(largest, std::ceil(elems / shard_ranks));
    b.optimizer += 2 * largest * 4;
    b.offloaded = b.optimizer;
    b.offload_staging = is_half(dtype) ? largest * 4 : 0;
  }
  b.grad_shard = cfg.parallel.zero ? owned * dtype_size(*o.grad_dtype) : 0;
  const std::vector<GradUnit> units = grad_units(table);
  const int windows = ReducerOptions().windows;
  if (o.windowed_grads)
    b.grad_windows = double(GradReducer::window_buffer_elems(units, shard_ranks,
                                                             outer ? 0 : node_ranks, windows)) *
                     dtype_size(*o.grad_dtype);
  if (node_ranks > 0 && !outer && !o.windowed_grads)
    b.node_grads = elems / node_ranks * dtype_size(*o.grad_dtype);
  if (o.windowed_params) {
    b.param_shard = owned * dtype_size(dtype);
    b.param_windows = double(ParamGatherer::window_buffer_elems(units, ParamGatherer::kWindows)) *
                      dtype_size(dtype);
  }
  if (shard_ranks > 1 && cfg.run.device == "cpu") {
    // ZeRO-2: the windows' reductions and the held units' (started at the end of the step,
    // while the last backward's windows may still be in flight).
    int64_t in_flight = table.total;
    if (o.windowed_grads) {
      in_flight = windows * largest_lent_unit(units);
      for (const GradUnit& u : units) in_flight += u.held ? u.elems() : 0;
    }
    b.collectives = double(in_flight) * dtype_size(*o.grad_dtype);
  }
  // Only the ranks that write take a copy (ZeRO: every rank its piece, with outer steps on the
  // first node only; otherwise the first replica). (With outer steps a node's replicas are
  // consecutive: the first node's are the first node_ranks.)
  const int index = dims.replica_index(me);
  const bool writes = cfg.parallel.zero ? !outer || index < node_ranks : index == 0;
  b.snapshot = b.snapshot_weights = writes ? owned * 4 * 3 : 0;
  if (outer) {
    // Without ZeRO each rank of a node exchanges a slice of the whole model.
    const double slice = cfg.parallel.zero ? owned : owned / node_ranks;
    const bool int8 = cfg.comm.outer.quantize == "int8";
    // int8 keeps a residual, and among more than two nodes the residual of the part it sums.
    const double nodes = double(dims.replicas()) / node_ranks;
    const double residuals = int8 ? slice + (nodes > 2 ? slice / nodes : 0) : 0;
    b.outer = (2 * owned + owned + slice + (int8 ? slice : 0) + residuals) * 4;
    // Its checkpoint state (trainer/outer_optimizer.cpp, state()): on the first node the outer
    // weights and momentum, on the others the node's weights and moments, kept by every rank
    // under ZeRO and otherwise by each node's first (the replicas of a node are consecutive);
    // and the residual.
    const bool saves = cfg.parallel.zero > 0 || index % node_ranks == 0;
    const double kept = saves ? (index < node_ranks ? 2 : 3) * owned : 0;
    b.snapshot += (kept + residuals) * 4;
  }
  const std::string& method = cfg.comm.compression.method;
  const bool momentum_exchanged = cfg.optim.exchanges_momentum();
  if ((method != "none" || momentum_exchanged) && shard_ranks > 1 && !outer) {
    const int L = cfg.parallel.allreduce == "hierarchical" && node_ranks > 0 ? node_ranks : 1;
    const double part = elems / L;
    // One bucket's messages (a scale per 256 values): all-gathered from every rank it is
    // exchanged with, or for int8 and onebit among more than two (comm/compression.cpp), in two
    // phases: its parts out, a part from each, the parts' sums, and a part's sum in fp32.
    const double bucket = std::min(elems, cfg.parallel.bucket_mb * (1 << 20) / 4) / L;
    const double peers = double(shard_ranks) / L, scales = bucket / 256 * 4;
    const bool by_parts = peers > 2 && cfg.comm.compression.two_phase;
    const bool feedback = cfg.comm.compression.error_feedback;
    auto gathered = [&](const std::string& m, double topk_ratio) {
      const double message = m == "int8"     ? bucket + scales
                             : m == "onebit" ? bucket / 8 + scales
                             : m == "topk"   ? bucket * topk_ratio * 8
                                             : 0.0;
      const bool two_phases = (m == "int8" || m == "onebit") && by_parts;
      // (With error feedback, the summed part's encoding decoded too.)
      return two_phases ? 3 * message + (feedback ? 2 : 1) * bucket / peers * 4 : peers * message;
    };
    // In two phases a rank keeps the residual of the part it sums, too.
    auto summed_part = [&](const std::string& m, bool feedback) {
      return (m == "int8" || m == "onebit") && by_parts && feedback ? part / peers : 0.0;
    };
    // A compressor's residual and its message decoded; 1-bit Adam's or DGC's own, and the
    // momentum (DGC's messages are largest at the start of its sparsity warm-up, 25%). The
    // checkpoint copies the residuals and the momentum.
    // (Top-k also orders the values: 4 bytes each.)
    const double gradients = method != "none" ? (method == "topk" ? 3 : 2) * part : 0;
    const double momentum = momentum_exchanged ? (cfg.optim.name == "dgc_adam" ? 4 : 3) * part : 0;
    const double parts_summed = summed_part(method, feedback) +
                                (cfg.optim.name == "onebit_adam" ? summed_part("onebit", true) : 0);
    const double momentum_messages = cfg.optim.name == "onebit_adam" ? gathered("onebit", 0)
                                     : cfg.optim.name == "dgc_adam"
                                         ? gathered("topk", std::max(cfg.optim.dgc_ratio, 0.25))
                                         : 0.0;
    b.compression = (gradients + momentum + parts_summed) * 4 +
                    std::max(gathered(method, cfg.comm.compression.topk_ratio), momentum_messages);
    const double residual = method != "none" && feedback ? part : 0;
    b.snapshot += (residual + parts_summed + (momentum_exchanged ? 2 * part : 0)) * 4;
  }
  return b;
}

// The kernel's MemAvailable shared by the ranks of this node, in bytes (0: unknown).
double host_available_bytes(const World& world) {
  std::ifstream in("/proc/meminfo");
  for (std::string key; in >> key;) {
    double kb = 0;
    in >> kb;
    if (key == "MemAvailable:") return kb * 1024 / std::max(1, world.local_size());
    in.ignore(1 << 10, '\n');
  }
  return 0;
}

int node_ranks(const Config& cfg, const ParallelDims& dims, int rank,
               const std::function<int(int)>& node) {
  int n = 0;
  if (cfg.comm.outer.on() || cfg.parallel.allreduce == "hierarchical")
    for (int r : dims.replica_group(rank)) n += node(r) == node(rank);
  return n;
}

// Bytes available to this rank: a GPU's arena, or on the CPU its share of the host's.
double available_bytes(Kernels& kernels, const World& world) {
  if (const int64_t reserved = kernels.memory().reserved; reserved > 0) return double(reserved);
  return host_available_bytes(world);
}

// A run that cannot fit is refused before anything is allocated (allocating first grows for
// tens of seconds and then fails somewhere).
void check_memory(const Config& cfg, World& world, Kernels& kernels, const std::string& origin) {
  const ParallelDims dims = Run::layout(cfg, world.size(), origin);
  // The data-parallel ranks on this node, as make_groups will find them: with outer steps they
  // share the shards; the hierarchical all-reduce holds 1/node_ranks of the gradients summed
  // inside the node.
  const MemoryBudget b =
      memory_budget(cfg, dims, dims.coords(world.rank()),
                    node_ranks(cfg, dims, world.rank(), node_of(world, cfg.parallel)));
  const StageExecutor::Memory& model = b.model;
  // A GPU holds its own part (offloaded state is the host's); on the CPU it is all one memory.
  const bool gpu = kernels.memory().reserved > 0;
  const double need = gpu ? b.device() : b.total();
  const double optimizer = b.optimizer - (gpu ? b.offloaded : 0) + b.offload_staging + b.grad_shard,
               snapshot = gpu ? 0 : b.snapshot;
  const double grads = double(model.grads) + b.grad_windows + b.node_grads;
  const double weights = double(model.params) + b.param_shard + b.param_windows;
  const double have = available_bytes(kernels, world);
  const double GB = 1 << 30;
  // On a GPU, what the host holds for it too: the offloaded optimizer (pinned) and the
  // checkpoint's copy.
  const double host = gpu ? b.offloaded + b.snapshot + b.process : 0,
               host_have = host_available_bytes(world);
  if (host > 0 && host_have > 0 && host > host_have)
    throw ConfigError(fmt::format(
        "{}: rank {} needs {:.2f} GB of host memory (offloaded optimizer state {:.2f}, checkpoint "
        "copy {:.2f}, the process's own {:.2f}) but {:.2f} GB is available to it (MemAvailable "
        "shared by {} rank(s) on this node): offload less (memory.offload_optimizer), or shard it "
        "over more ranks (zero)",
        origin, world.rank(), host / GB, b.offloaded / GB, b.snapshot / GB, b.process / GB,
        host_have / GB, world.local_size()));
  if (have <= 0 || need <= have) return;
  throw ConfigError(fmt::format(
      "{}: the run needs {:.2f} GB on rank {} (weights {:.2f}, gradients {:.2f}, activations "
      "{:.2f}, optimizer state {:.2f}, reduction temporaries {:.2f}, checkpoint copy {:.2f}, the "
      "process's own {:.2f}) but {:.2f} GB is available to it ({}): lower train.micro_batch, or "
      "spread the model over more ranks (tp, pp, zero)",
      origin, need / GB, world.rank(), weights / GB, grads / GB,
      double(model.activations + model.stats) / GB, optimizer / GB, b.collectives / GB,
      snapshot / GB, gpu ? 0 : b.process / GB, have / GB,
      kernels.memory().reserved > 0
          ? "the GPU memory reserved by run.gpu_memory_fraction"
          : fmt::format("MemAvailable shared by {} rank(s) on this node", world.local_size())));
}

}  // namespace trainer
