#include "trainer/node_peers.h"

#include <omp.h>
#include <sched.h>
#include <unistd.h>

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

namespace {

// 1 for each of the machine's n cores this rank may run on. Under OMP_PROC_BIND the OpenMP
// runtime pins the initial thread to its first place before main, so the thread's affinity is
// that place alone: the union of the places (made from the process's affinity) is then what the
// rank's threads run on.
std::vector<double> cores_of_this_rank(int n) {
  std::vector<double> mine(size_t(n), 0.0);
  auto mark = [&](int c) {
    if (c >= 0 && c < n) mine[size_t(c)] = 1;
  };
  if (omp_get_proc_bind() != omp_proc_bind_false && omp_get_num_places() > 0) {
    for (int p = 0; p < omp_get_num_places(); p++) {
      std::vector<int> ids(size_t(omp_get_place_num_procs(p)));
      omp_get_place_proc_ids(p, ids.data());
      for (int c : ids) mark(c);
    }
    return mine;
  }
  // Sized for the machine (cpu_set_t holds 1024 cores).
  cpu_set_t* set = CPU_ALLOC(n);
  const size_t size = CPU_ALLOC_SIZE(n);
  CPU_ZERO_S(size, set);
  if (sched_getaffinity(0, size, set) == 0) {
    for (int c = 0; c < n; c++)
      if (CPU_ISSET_S(c, size, set)) mark(c);
  } else {
    std::fill(mine.begin(), mine.end(), 1.0);
  }
  CPU_FREE(set);
  return mine;
}

}  // namespace

NodePeers node_peers(World& world) {
  NodePeers node;
  node.comm = node_group(world);
  // The same count on every rank of a node, so that the sum lines up.
  const int n =
      std::max({1, int(sysconf(_SC_NPROCESSORS_CONF)), int(std::thread::hardware_concurrency())});
  const std::vector<double> mine = cores_of_this_rank(n);
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
