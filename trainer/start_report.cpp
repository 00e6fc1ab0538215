#include "trainer/start_report.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>

#include "trainer/blas_setup.h"
#include "trainer/memory_budget.h"
#include "trainer/pipeline_schedule.h"
#include "trainer/planner.h"

namespace trainer {

Candidate planned_step(const Run& run, Cluster* cluster) {
  const Config& cfg = run.cfg;
  const double peak = run.kernels->peak_flops(compute_dtype(cfg.precision));
  if (peak <= 0) return {};
  PlanOptions o;
  Cluster& k = o.cluster;
  k.devices = run.dims.world();
  k.per_node = run.world.local_size();
  k.peak_flops = peak;
  const bool cpu = cfg.run.device == "cpu";
  // The node's ranks' threads over the cores they may run on together (mpirun binding each of
  // two ranks to a core of its own is no sharing; four unbound ranks on two cores are).
  if (cpu)
    k.oversubscription = double(run.world.local_size()) * omp_get_max_threads() / run.node.cores;
  set_bandwidths(k, cpu, 0, 0, run.node.gbps);
  Config c = cfg;
  c.train.grad_accum = run.schedule.accum(0, 0);  // the first step's (with a batch ramp)
  if (cluster) *cluster = k;
  return estimate_layout(c, run.dims, o);
}

// One line: the estimate and its parts.
static double print_planned_step(const Run& run, const char* prefix) {
  Cluster k;
  const Candidate e = planned_step(run, &k);
  if (e.total_s() <= 0) return 0;
  fmt::print(
      "{}the planner's estimate: {:.4g} s a step (compute {:.3g}, bubble {:.3g}, tp {:.3g}, cp "
      "{:.3g}, dp {:.3g}, optimizer {:.3g}) at {:.0f}% of the MFU peak{}\n",
      prefix, e.total_s(), e.compute_s, e.bubble_s, e.tp_s, e.cp_s, e.dp_s, e.optimizer_s,
      100 * PlanOptions().efficiency,
      run.world.local_size() > 1 ? fmt::format(", collectives inside the node at {:.3g} GB/s ({})",
                                               k.intra_bytes_per_s / 1e9, k.intra_source)
                                 : "");
  return e.total_s();
}

double print_start(const Run& run) {
  const Config& cfg = run.cfg;
  const ParallelDims& dims = run.dims;
  if (cfg.run.device == "cpu")
    fmt::print("trainer {} | run {} | device cpu, {} ranks x {} threads, OpenBLAS {} kernels\n",
               TRAINER_VERSION, cfg.run.name, run.world.size(), omp_get_max_threads(),
               blas_core_name());
  else
    fmt::print(
        "trainer {} | run {} | device {} (rank 0), {} ranks, collectives {}, {:.1f} GiB "
        "reserved per rank\n",
        TRAINER_VERSION, cfg.run.name, run.kernels->name(), run.world.size(),
        run.placement.collectives, double(run.kernels->memory().reserved) / (1 << 30));
  const ModelConfig& m = cfg.model;
  fmt::print(
      "model: {}, {} layers, {} heads{}, d_model {}, MLP {}, seq_len {}, vocab {} (padded {}, {}), "
      "{:.2f}M params\n",
      arch_name(m.arch), m.n_layer, m.n_head,
      m.kv_heads() != m.n_head ? fmt::format(" ({} key/value)", m.kv_heads()) : "", m.d_model,
      m.ffn(), m.seq_len, m.vocab_size, m.padded_vocab(), m.tie_embeddings ? "tied" : "untied",
      double(param_table(m).total) / 1e6);
  const int accum = run.schedule.accum(0, 0);  // the first step's, with a ramp
  const int64_t tokens_per_step =
      int64_t(cfg.train.micro_batch) * cfg.model.seq_len * accum * dims.dp();
  const std::vector<Dataset>& train = run.train_data;
  std::string train_tokens = fmt::format("{} train tokens ({} windows; {})", train[0].tokens(),
                                         train[0].windows(), train[0].describe());
  if (train.size() > 1) {
    train_tokens = fmt::format("a blend of {} sources", train.size());
    for (size_t k = 0; k < train.size(); k++)
      train_tokens += fmt::format("{} {:.4g} of {} tokens ({} windows; {})", k ? ";" : ":",
                                  run.blend.weights[k], train[k].tokens(), train[k].windows(),
                                  train[k].describe());
  }
  fmt::print(
      "data: {}, {} val tokens ({}) | batch {} x {} x {} micro-batches x dp {} = {} tokens/step\n",
      train_tokens, run.val_data.tokens(), run.val_data.describe(), cfg.train.micro_batch,
      cfg.model.seq_len, accum, dims.dp(), tokens_per_step);
  if (run.schedule.ramped())
    fmt::print("batch ramp: {} (global batches in sequences, through accumulation)\n",
               run.schedule.describe());
  fmt::print(
      "parallel: dp {}{} x tp {}{} x pp {} (order {}), zero {}, {} all-reduce, {} buckets {}, "
      "overlap {}, 1F1B bubble {:.1f}% ({} stages, {} micro-batches)\n",
      dims.dp(),
      dims.cp() > 1 ? fmt::format(" x cp {} (ring attention: {} tokens of each sequence a rank)",
                                  dims.cp(), cfg.model.seq_len / dims.cp())
                    : "",
      dims.tp(),
      run.model.shard().sequence_parallel ? " (sequence parallel: 1/tp of the rows between "
                                            "the tensor-parallel regions)"
                                          : "",
      dims.pp(), cfg.parallel.order, cfg.parallel.zero, cfg.parallel.allreduce,
      run.reducer.buckets(),
      cfg.parallel.zero >= 2
          ? fmt::format(
                "(the gradient units, reduced in every micro-batch; {} windows of {:.3g} MB{})",
                run.reducer.windows(), double(run.reducer.bucket_bytes()) / (1 << 20),
                run.gatherer ? fmt::format("; parameters gathered unit by unit into {} windows "
                                           "of {:.3g} MB, the next unit prefetched",
                                           run.gatherer->windows(),
                                           double(run.gatherer->window_elems() *
                                                  dtype_size(run.model.dtype())) /
                                               (1 << 20))
                             : "")
          : fmt::format("of {:.3g} MB", double(run.reducer.bucket_bytes()) / (1 << 20)),
      cfg.parallel.overlap ? "on" : "off",
      100 * pipeline_bubble(pipeline_stage_shares(cfg.model, dims.pp(), 1), accum), dims.pp(),
      accum);
  if (dims.pp() > 1) {
    const std::vector<int> bounds = pipeline_partition(cfg.model, dims.pp());
    std::string stages;
    for (int s = 0; s < dims.pp(); s++)
      stages += fmt::format(" {}:[{}, {})", s, bounds[s], bounds[s + 1]);
    fmt::print("pipeline stages (blocks; embedding on the first, head on the last):{}\n", stages);
  }
  const MemoryBudget b =
      memory_budget(cfg, dims, dims.coords(0), run.groups.intra ? run.groups.intra->size() : 0);
  const double MB = 1 << 20;
  // One line from the plan the buffers are allocated by (and that check_memory refuses by).
  fmt::print(
      "memory: recompute {}{}, rank 0 expects {:.1f} MB (weights {:.2f}{}, gradients {:.2f}{}, "
      "activations {:.2f}, AdamW {:.2f}{}{}, {}{}{}checkpoint copy {:.2f}, the process's own "
      "{:.0f})\n",
      cfg.memory.recompute,
      cfg.memory.recompute != "none" && cfg.memory.recompute_layers > 0
          ? fmt::format(" (first {} blocks of each stage)", cfg.memory.recompute_layers)
          : "",
      b.total() / MB, double(b.model.params) / MB,
      cfg.parallel.zero == 3 ? fmt::format(" held + shard {:.2f} + parameter windows {:.2f}",
                                           b.param_shard / MB, b.param_windows / MB)
                             : "",
      double(b.model.grads) / MB,
      b.node_grads > 0 ? fmt::format(" + summed inside the node {:.2f}", b.node_grads / MB) : "",
      double(b.model.activations + b.model.stats) / MB, b.optimizer / MB,
      b.offloaded > 0 ? fmt::format(" offloaded to host memory, updated on CPU threads{}",
                                    b.offload_staging > 0 ? fmt::format(" (device staging {:.2f})",
                                                                        b.offload_staging / MB)
                                                          : "")
                      : "",
      cfg.parallel.zero
          ? fmt::format(" (ZeRO-{}: 1/{} of the whole) + its gradient shard {:.2f}{}",
                        cfg.parallel.zero, run.gradient_replicas(), b.grad_shard / MB,
                        cfg.parallel.zero >= 2
                            ? fmt::format(" + gradient windows {:.2f}", b.grad_windows / MB)
                            : "")
          : "",
      b.collectives > 0 ? fmt::format("reduction temporaries <= {:.2f}, ", b.collectives / MB) : "",
      b.outer > 0 ? fmt::format("outer steps {:.2f}, ", b.outer / MB) : "",
      b.compression > 0 ? fmt::format("compression {:.2f}, ", b.compression / MB) : "",
      b.snapshot / MB, b.process / MB);
  const double planned_s = print_planned_step(run, "step: ");
  fmt::print("precision: compute {}, gradients {}, master weights and AdamW state fp32{}\n",
             precision_name(run.model.params().dtype), precision_name(run.model.grad_dtype()),
             cfg.precision.compute != "fp16" ? ""
             : run.scaler.dynamic()
                 ? fmt::format(", dynamic loss scale from {}", run.scaler.scale())
                 : fmt::format(", static loss scale {}", run.scaler.scale()));
  fmt::print("{}", dims.describe());
  constexpr int kRanksListed = 64;  // a thousand-rank job lists the first ones
  for (int r = 0; r < std::min(dims.world(), kRanksListed); r++) {
    const RankCoords c = dims.coords(r);
    fmt::print("  rank {}: dp {}{} tp {} pp {} on {} (node {})\n", r, c.dp,
               dims.cp() > 1 ? fmt::format(" cp {}", c.cp) : "", c.tp, c.pp, run.world.host_of(r),
               run.world.node_of(r));
  }
  if (dims.world() > kRanksListed)
    fmt::print("  ... {} more ranks on {} nodes in all\n", dims.world() - kRanksListed,
               run.world.node_of(dims.world() - 1) + 1);
  const double peak = run.kernels->peak_flops(compute_dtype(cfg.precision));
  fmt::print("MFU peak: {:.1f} GFLOP/s per rank ({}), {:.1f} MFLOP/token\n", peak / 1e9,
             cfg.run.peak_tflops > 0 ? "configured"
             : cfg.run.device == "cpu"
                 ? "best of 12 sgemm bursts; raised by any faster matmul or attention call"
             : peak > 0 ? "the GPU's data sheet"
                        : "unknown GPU: set [run] peak_tflops",
             run.flops_per_token / 1e6);
  return planned_s;
}

// --dry-run: what each pipeline stage's ranks would hold (their tensor-parallel ranks and ZeRO
// pieces hold the same), the largest rank, and how long a step would take at the MFU peak with
// the 1F1B bubble of its stages (communication aside): from the plan the buffers were just
// allocated by.
void print_dry_run(const Run& run) {
  const Config& cfg = run.cfg;
  const ParallelDims& dims = run.dims;
  const int node_ranks = run.groups.intra ? run.groups.intra->size() : 0;
  const double MB = 1 << 20;
  std::string stages;
  double largest = 0;
  int largest_rank = 0;
  for (int r = 0; r < dims.world(); r++) {
    const RankCoords c = dims.coords(r);
    if (c.dp != 0 || c.cp != 0) continue;  // replicas and ZeRO pieces hold what rank 0 does
    const double total = memory_budget(cfg, dims, c, node_ranks).total();
    if (total > largest) largest = total, largest_rank = r;
    if (c.tp == 0)
      stages += fmt::format("{}stage {} {:.1f} MB", stages.empty() ? "" : ", ", c.pp, total / MB);
  }
  fmt::print("dry run: memory per rank: {}; the largest is rank {} with {:.1f} MB\n", stages,
             largest_rank, largest / MB);
  const int accum = run.schedule.accum(0, 0);
  const double tokens = double(cfg.train.micro_batch) * cfg.model.seq_len * accum * dims.dp();
  const double flops = run.flops_per_token * tokens;
  const double peak = run.kernels->peak_flops(compute_dtype(cfg.precision));
  // The slowest stage works through every micro-batch, idle in the bubble of its fill and drain.
  const std::vector<double> shares = pipeline_stage_shares(cfg.model, dims.pp(), 1);
  const double slowest = *std::max_element(shares.begin(), shares.end());
  const double bubble = pipeline_bubble(shares, accum);
  if (peak > 0) {
    const double seconds = flops / (dims.world() * peak) * dims.pp() * slowest / (1 - bubble);
    fmt::print(
        "dry run: a step of {:.0f} tokens is {:.4g} TFLOP of model compute: at least {:.4g} s at "
        "the MFU peak of {:.1f} GFLOP/s per rank with the {:.1f}% bubble{} ({:.4g} s at 50% MFU), "
        "communication not counted\n",
        tokens, flops / 1e12, seconds, peak / 1e9, 100 * bubble,
        dims.pp() > 1
            ? fmt::format(" and the slowest stage's {:.1f}% of the model's compute", 100 * slowest)
            : "",
        2 * seconds);
  }
  fmt::print("dry run: set up and allocated on {} rank{}; nothing trained, no run files written\n",
             dims.world(), dims.world() == 1 ? "" : "s");
}

}  // namespace trainer
