#pragma once
// DiLoCo / local SGD across nodes ([comm.outer]; Douillard et al. 2023, "DiLoCo: Distributed
// Low-Communication Training of Language Models", after Lin et al.'s local SGD).
//
// Each node is a worker: its ranks train synchronously among themselves (the data-parallel
// reduction runs over the node's ranks only, with its own inner optimizer state), and every H
// steps the workers meet. Each has moved from the outer weights; the mean of those moves, the
// pseudo-gradient mean(outer - local), is the gradient of an outer SGD step with Nesterov
// momentum, and every worker continues from the new outer weights. Between the outer steps
// nothing crosses the nodes: inter-node traffic falls by the factor H (times 4 more with the
// pseudo-gradient int8-quantized, with error feedback).
//
// This rank's share is its inner optimizer's segments: without ZeRO the whole model, the same on
// every rank of the node, of which each rank exchanges a 1/node_ranks slice with its peers on
// the other nodes and gathers the others' slices inside the node; with ZeRO-1 and -2 its piece
// of the node's shard, exchanged whole with the ranks that hold the same piece elsewhere. The
// outer weights and momentum are fp32, in host memory, updated on the CPU (once per H steps).
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "comm/compression.h"
#include "io/config.h"
#include "model/stage_executor.h"
#include "trainer/adamw.h"

namespace trainer {

class OuterOptimizer {
 public:
  // inter: this rank's peers on the other nodes (one per node, in node order); intra: those on
  // its node. sharded: the inner optimizer holds a ZeRO piece (else the whole model).
  OuterOptimizer(const OuterConfig& cfg, StageExecutor& model, AdamW& inner, Communicator& inter,
                 Communicator& intra, bool sharded);

  // The outer weights from the present weights (which every node shares: a fresh start, or a
  // restore without outer state), momentum and residual zero.
  void reset();
  // Whether an outer step follows step `step` (0-based) of a run of `steps`: every H steps, and
  // after the last, so that the run ends on the outer weights.
  bool due(int64_t step, int64_t steps) const {
    return (step + 1) % cfg_.every_steps == 0 || step + 1 == steps;
  }
  // The outer step after update `update` (1-based; the compute copy is rounded from the master
  // weights as that update's was). Under ZeRO the caller then gathers the node's pieces.
  void step(int64_t update);

  // For checkpoints: what this rank keeps (see outer_optimizer.cpp); set_state is collective
  // over the world's ranks (each node gets the outer state from the first) and returns false on
  // every rank if any rank's saved state did not fit (another layout), changing nothing. state
  // writes into `out` (a checkpoint's copy, its capacity reused from the last one).
  void state(std::vector<float>& out) const;
  bool set_state(const std::vector<float>& saved, Communicator& world, int64_t update);

  int workers() const { return inter_.size(); }
  // The outer step's own elements (this rank's share) and what it sends across nodes.
  int64_t elements() const { return n_; }

 private:
  void read_weights(float* dst) const;
  void write_weights(const float* src, int64_t update);
  void read_moments(AdamW::State which, float* dst) const;
  void write_moments(AdamW::State which, const float* src);
  bool saves() const { return sharded_ || intra_.rank() == 0; }

  OuterConfig cfg_;
  StageExecutor& model_;
  AdamW& inner_;
  Communicator &inter_, &intra_;
  bool sharded_, split_;  // split_: the node's ranks exchange a slice each (no ZeRO)
  // This rank's elements (its segments in turn), and the slice of them it exchanges.
  int64_t n_ = 0, slice_ = 0;
  std::vector<float> outer_, momentum_;
  std::unique_ptr<Compressor> quantizer_;  // int8 with error feedback, or null
};

}  // namespace trainer
