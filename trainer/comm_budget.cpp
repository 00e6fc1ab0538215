#include "trainer/comm_budget.h"

#include <fmt/format.h>

#include <algorithm>
#include <memory>

#include "comm/bus_bandwidth.h"
#include "comm/rank_groups.h"
#include "model/model_definition.h"
#include "trainer/run.h"

namespace trainer {

CommAdvice advise_communication(Config& cfg, World& world, const std::string& origin) {
  CommAdvice a;
  if (cfg.comm.budget_ms <= 0) return a;
  const ParallelDims dims = Run::layout(cfg, world.size(), origin);
  const int rank = world.rank();
  const NodeSplit split =
      split_by_node(dims.replica_group(rank), rank, node_of(world, cfg.parallel));
  // Collective: every rank makes its group.
  const std::unique_ptr<Communicator> inter = world.group(split.inter);
  a.nodes = int(split.inter.size());
  const int L = int(split.intra.size()), N = a.nodes;
  // The largest stage's elements (every rank's ways are computed alike from it).
  const RankCoords me = dims.coords(rank);
  const ModelShard shard = ModelShard::make(cfg.model, me.tp, dims.tp(), me.pp, dims.pp());
  double elems = double(param_table(cfg.model, shard, 16 * int64_t(dims.replicas())).total);
  world.comm().all_reduce(host_ptr(&elems), 1, ReduceOp::max);
  a.gbps = cfg.comm.inter_node_gbps;
  if (N > 1 && a.gbps <= 0) {
    a.gbps = all_reduce_gbps(*inter, world.comm());
    a.measured = true;
  }
  auto way = [&](std::string name, double bytes, std::string method, int every) {
    const double ms = a.gbps > 0 ? bytes * 8 / (a.gbps * 1e9) * 1e3 : 0;
    a.ways.push_back({std::move(name), bytes, ms, std::move(method), every});
  };
  // A rank's part of the node's sum crosses nodes: ring all-reduce of it, or its int8 message
  // with a scale per 256 values, which moves as many messages (an all-gather between two nodes,
  // two phases between more: comm/compression.cpp), or with two_phase = false N - 1 of them.
  const double part = elems / L, ring = 2.0 * (N - 1) / N;
  const double messages = cfg.comm.compression.two_phase ? ring : N - 1;
  const double int8_bytes = messages * part * (1 + 4.0 / 256);
  way("fp32 all-reduce", ring * 4 * part, "none", 0);
  // Compression needs the flat fp32 gradients (ZeRO 0 or 1).
  const bool compressible = cfg.precision.grads == "fp32" && cfg.parallel.zero <= 1;
  if (compressible) {
    way("fp16", ring * 2 * part, "fp16", 0);
    way("int8", int8_bytes, "int8", 0);
    // After its warm-up (whose gradients cross in int8), 1-bit momentum: a sign per value and
    // a scale per 256. It replaces AdamW, and needs replicas on other nodes.
    // (Not for a run that ends in its warm-up, nor beside outer steps, which it excludes.)
    if (cfg.optim.name == "adamw" && cfg.parallel.zero <= 1 && N > 1 && !cfg.comm.outer.on() &&
        cfg.train.steps > cfg.optim.freeze_step) {
      way(fmt::format("1-bit Adam after {} int8 steps", cfg.optim.freeze_step),
          messages * part * (1.0 / 8 + 4.0 / 256), "int8", 0);
      a.ways.back().onebit_adam = true;
    }
  }
  if (cfg.parallel.cp == 1 && cfg.parallel.zero <= 2)
    for (int every : {10, 25, 50, 100, 250, 500})
      way(fmt::format("outer steps every {} (int8)", every), ring * part * (1 + 4.0 / 256) / every,
          "none", every);  // (two phases beyond two)
  for (size_t i = 0; i < a.ways.size() && a.chosen < 0; i++)
    if (N == 1 || a.ways[i].ms <= cfg.comm.budget_ms) a.chosen = int(i);
  if (a.chosen < 0) a.chosen = int(a.ways.size()) - 1;
  const CommWay& chosen = a.ways[size_t(a.chosen)];
  if (cfg.comm.compression.method == "auto") {
    cfg.comm.compression.method = chosen.method;
    if (chosen.onebit_adam) cfg.optim.name = "onebit_adam";
    if (chosen.outer_every > 0) {
      cfg.comm.outer.every_steps = chosen.outer_every;
      cfg.comm.outer.quantize = "int8";
    } else if (N > 1) {
      cfg.parallel.allreduce = "hierarchical";  // compress only what crosses nodes
    }
    a.applied = true;
  }
  std::string ways;
  for (const CommWay& w : a.ways)
    ways += fmt::format("{}{} {:.3g} ms", ways.empty() ? "" : ", ", w.name, w.ms);
  a.line = N == 1 ? fmt::format(
                        "comm: budget {:.3g} ms a step between nodes: the data-parallel ranks "
                        "are on one node, nothing crosses nodes{}",
                        cfg.comm.budget_ms, a.applied ? " (method = \"auto\": none)" : "")
                  : fmt::format(
                        "comm: {} nodes at {:.3g} Gbit/s ({}), budget {:.3g} ms a step: {} | "
                        "{} {}{}",
                        N, a.gbps, a.measured ? "measured" : "[comm] inter_node_gbps",
                        cfg.comm.budget_ms, ways,
                        a.ways[size_t(a.chosen)].ms <= cfg.comm.budget_ms ? "within it:"
                                                                          : "none fits; the least:",
                        chosen.name,
                        a.applied ? " (method = \"auto\": used)"
                                  : " (compression.method = \"auto\" would use it)");
  return a;
}

}  // namespace trainer
