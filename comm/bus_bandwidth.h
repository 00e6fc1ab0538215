#pragma once
// The bandwidth of a group's all-reduce, timed: what the planner and the inter-node budget
// ([comm] budget_ms) take in place of a data sheet's figure where the links are this machine's
// (shared memory between CPU ranks: copies on the ranks' own cores) or unknown (the network).
#include "comm/communicator.h"

namespace trainer {

// Collective over `world`: each rank passes its own group (of any size; one of one rank takes
// no part). Returns the slowest group's bus bandwidth in Gbit/s: the bytes a rank sends in a ring
// all-reduce, 2 (n - 1) / n of `bytes`, over the best of three timed all-reduces after a
// warm-up, each started together (a barrier of the world). 0 when no group has two ranks.
double all_reduce_gbps(Communicator& group, Communicator& world, int64_t bytes = 16 << 20);

}  // namespace trainer
