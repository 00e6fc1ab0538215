#include "comm/bus_bandwidth.h"

#include <algorithm>
#include <chrono>
#include <vector>

namespace trainer {

double all_reduce_gbps(Communicator& group, Communicator& world, int64_t bytes) {
  const int64_t n = bytes / 4;
  std::vector<float> buf(size_t(group.size() > 1 ? n : 0), 1.0f);
  double best = 1e30;
  for (int i = 0; i < 4; i++) {
    world.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    if (group.size() > 1) group.all_reduce(host_ptr(buf.data()), n, ReduceOp::sum);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i > 0) best = std::min(best, s);
  }
  // The slowest group's: the least bandwidth, as the largest of its negation (a rank alone takes
  // no part).
  const int n_ranks = group.size();
  double negated =
      n_ranks > 1 ? -(2.0 * 4 * double(n) * (n_ranks - 1) / n_ranks * 8 / best / 1e9) : -1e30;
  world.all_reduce(host_ptr(&negated), 1, ReduceOp::max);
  return negated <= -1e29 ? 0 : -negated;
}

}  // namespace trainer
