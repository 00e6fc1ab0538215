#pragma once
// This rank's node: the communicator of its ranks, how they share the node's cores, and how
// fast an all-reduce among them runs. The cores decide a CPU rank's threads (threads_per_rank)
// and the planner's oversubscription; the bandwidth is the planner's figure inside a node.
#include <memory>
#include <span>

#include "comm/communicator.h"

namespace trainer {

// From how many of the node's ranks may run on each core, and which cores this rank may run on
// (1 or 0 per core, both indexed by core).
struct CoreShare {
  int cores = 1;     // the cores some rank of the node may run on: the union of their affinities
  double share = 1;  // this rank's fair share: over its cores, 1 / the ranks that may run there
};
CoreShare share_cores(std::span<const double> ranks_on_core, std::span<const double> mine);

struct NodePeers {
  std::unique_ptr<Communicator> comm;  // the ranks of this node
  int cores = 1;                       // the cores its ranks may run on together (CoreShare::cores)
  double core_share = 1;               // this rank's share of them (CoreShare::share)
  // The bus bandwidth of an all-reduce among them in Gbit/s, timed by train() before the model
  // on the CPU, where it is copies on the ranks' own cores; 0 on GPUs and where a node has one
  // rank.
  double gbps = 0;
};
// Collective over the world: the node's communicator and its ranks' affinities (one all-reduce).
NodePeers node_peers(World& world);

// The ranks on this rank's node, as a communicator (collective over the world).
std::unique_ptr<Communicator> node_group(World& world);

// A CPU rank's threads: [run] threads when set (> 0), or its share of the cores, at least one.
// Unbound ranks split the node's cores; ranks bound to cores of their own (mpirun's default for
// two) take theirs; ranks that share a cpuset (a Slurm job's cgroup) split it.
int threads_per_rank(int configured, double core_share);

}  // namespace trainer
