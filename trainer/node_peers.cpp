#include "trainer/node_peers.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

namespace trainer {

CoreShare share_cores(std::span<const double> ranks_on_core, std::span<const double> mine) {
  CoreShare s{0, 0};
  for (size_t c = 0; c < ranks_on_core.size(); c++) {
    if (ranks_on_core[c] > 0) s.cores++;
    if (c < mine.size() && mine[c] > 0 && ranks_on_core[c] > 0) s.share += 1 / ranks_on_core[c];
  }
  s.cores = std::max(1, s.cores);
  return s;
}

std::unique_ptr<Communicator> node_group(World& world) {
  std::vector<int> members;
  for (int r = 0; r < world.size(); r++)
    if (world.node_of(r) == world.node_of(world.rank())) members.push_back(r);
  return world.group(members);
}

NodePeers node_peers(World& world) {
  NodePeers node;
  node.comm = node_group(world);
  std::vector<double> mine(CPU_SETSIZE, 0.0);  // 1 for each core this rank may run on
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed) == 0) {
    for (int c = 0; c < CPU_SETSIZE; c++) mine[c] = CPU_ISSET(c, &allowed) ? 1 : 0;
  } else {
    const int all = std::clamp(int(std::thread::hardware_concurrency()), 1, CPU_SETSIZE);
    std::fill(mine.begin(), mine.begin() + all, 1.0);
  }
  std::vector<double> ranks_on_core = mine;
  node.comm->all_reduce(host_ptr(ranks_on_core.data()), int64_t(ranks_on_core.size()),
                        ReduceOp::sum);
  const CoreShare share = share_cores(ranks_on_core, mine);
  node.cores = share.cores;
  node.core_share = share.share;
  return node;
}

int threads_per_rank(int configured, double core_share) {
  if (configured > 0) return configured;
  return std::max(1, int(std::floor(core_share + 1e-9)));
}

}  // namespace trainer
