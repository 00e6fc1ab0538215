#pragma once
// The communicators of one rank: its data-, context-, tensor- and pipeline-parallel groups, the
// tied embedding's pair of stages and, for the hierarchical all-reduce, its data-parallel peers
// split by node. Collective over the world.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/parallel_dims.h"
#include "io/config.h"

namespace trainer {

// This rank's communicators, one per group it belongs to.
struct Groups {
  // dp: every rank holding the same parameters (ParallelDims::replica_group: the data-parallel
  // ranks and, with context parallelism, their context-parallel peers): gradients, ZeRO shards.
  // cp: the context-parallel ring.
  std::unique_ptr<Communicator> dp, cp, tp, pp;
  std::unique_ptr<Communicator> emb;  // first and last stage: the tied embedding
  // dp split by node (the hierarchical reduction, the outer steps): the peers on this rank's
  // node, and those at its position on the other nodes
  std::unique_ptr<Communicator> intra, inter;
};

// Turns each group's MPI communicator into the one the job uses (NCCL or staged for GPU
// buffers; traced when profiling), given the group's name ("dp", "tp", ...); null keeps MPI.
using GroupWrapper = std::function<std::unique_ptr<Communicator>(std::unique_ptr<Communicator>,
                                                                 const std::string& group)>;

// The ranks of `peers` on `rank`'s node, and those on the other nodes at its position within
// theirs (in node order). Throws ConfigError when nodes hold unequal numbers of peers.
struct NodeSplit {
  std::vector<int> intra, inter;
};
NodeSplit split_by_node(const std::vector<int>& peers, int rank,
                        const std::function<int(int)>& node);
// The node of each world rank: parallel.ranks_per_node consecutive ranks a node, or the hosts.
std::function<int(int)> node_of(World& world, const ParallelConfig& pc);

// by_node: make intra and inter (the hierarchical reduction, the outer steps across nodes).
// Throws ConfigError when nodes hold unequal numbers of data-parallel peers.
Groups make_groups(World& world, const ParallelDims& dims, const ParallelConfig& pc, bool by_node,
                   const GroupWrapper& wrap = nullptr);

}  // namespace trainer
