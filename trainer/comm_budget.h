#pragma once
// A choice by bandwidth ([comm] budget_ms): which way of crossing nodes keeps the inter-node
// communication a step exposes within a budget, given the bandwidth between nodes
// ([comm] inter_node_gbps, or measured at start-up: a timed all-reduce among each rank's peers on
// the other nodes, the slowest group's). The ways, in the order of the model quality they keep
// (bench/compression_quality.sh, measured on tiny.toml at dp 4 over two nodes): the fp32
// hierarchical all-reduce, fp16, int8 (compression of what crosses nodes), 1-bit Adam (for
// AdamW: after its freeze_step warm-up in int8; the warm-up's steps send int8's bytes), then
// outer steps (DiLoCo) with int8 pseudo-gradients every H = 10, 25, 50, 100, 250 or 500 steps.
// The first that
// fits is chosen, or the last when none does. Each way's bytes are what one rank sends across
// nodes a step, from the parameter count: its time is those bytes at the bandwidth, counted as
// exposed (a bound: backward hides part of an all-reduce, none of an outer step).
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "io/config.h"

namespace trainer {

struct CommWay {
  std::string name;             // "fp32 all-reduce", "int8", "outer steps every 50 (int8)"
  double bytes = 0, ms = 0;     // a rank's inter-node bytes a step, and their time
  std::string method = "none";  // what it sets: [comm.compression] method, or
  int outer_every = 0;          // [comm.outer] every_steps (with quantize = "int8")
  bool onebit_adam = false;     // [optim] name = "onebit_adam" (method: its warm-up's)
};
struct CommAdvice {
  double gbps = 0;
  bool measured = false;
  int nodes = 1;  // the nodes a data-parallel group spans
  std::vector<CommWay> ways;
  int chosen = -1;       // index into ways
  bool applied = false;  // method = "auto": cfg now uses it
  std::string line;      // the start-up report's line
};

// Collective over the world (every rank, the same answer). Without a budget, nothing (nodes 0).
// With compression.method = "auto" it sets cfg to the chosen way. Throws ConfigError for a
// layout whose nodes hold unequal numbers of data-parallel peers.
CommAdvice advise_communication(Config& cfg, World& world, const std::string& origin);

}  // namespace trainer
