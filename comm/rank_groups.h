#pragma once
// The communicators of one rank: its data-, tensor- and pipeline-parallel groups, the tied
// embedding's pair of stages and, for the hierarchical all-reduce, its data-parallel peers split
// by node. Collective over the world.
#include <functional>
#include <memory>

#include "comm/communicator.h"
#include "comm/parallel_dims.h"
#include "io/config.h"

namespace trainer {

// This rank's communicators, one per group it belongs to.
struct Groups {
  std::unique_ptr<Communicator> dp, tp, pp;
  std::unique_ptr<Communicator> emb;           // first and last stage: the tied embedding
  std::unique_ptr<Communicator> intra, inter;  // hierarchical reduction: dp split by node
};

// Turns each group's MPI communicator into the one the job uses (NCCL or staged for GPU
// buffers); null keeps MPI.
using GroupWrapper = std::function<std::unique_ptr<Communicator>(std::unique_ptr<Communicator>)>;

// Throws ConfigError when the hierarchical reduction finds nodes with unequal numbers of
// data-parallel peers.
Groups make_groups(World& world, const ParallelDims& dims, const ParallelConfig& pc,
                   const GroupWrapper& wrap = nullptr);

}  // namespace trainer
