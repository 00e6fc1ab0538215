// How a node's ranks share its cores (trainer/node_peers.h): the rule on its own, and the
// threads the binary starts under mpirun.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "mpi_cli.h"
#include "test_util.h"
#include "trainer/node_peers.h"

namespace trainer {
namespace {

// A rank's threads are its fair share of the cores it may run on: over each of its cores, one
// over the node's ranks that may run there. Cases by affinity (core counts per rank): unbound
// ranks split the node, bound ranks keep their own cores, ranks that share a cpuset (a Slurm
// job's cgroup of 16 of 64 cores) split it rather than each taking all 16.
TEST(NodePeers, RanksTakeTheirFairShareOfTheCores) {
  auto cores = [](int n, int from, int to) {  // 1 for cores [from, to) of n
    std::vector<double> v(size_t(n), 0.0);
    for (int c = from; c < to; c++) v[size_t(c)] = 1;
    return v;
  };
  auto times = [](std::vector<double> v, double k) {
    for (double& x : v) x *= k;
    return v;
  };
  struct Case {
    const char* what;
    std::vector<double> ranks_on_core, mine;
    int union_cores, threads;
  };
  const std::vector<double> both = cores(2, 0, 2);
  const std::vector<Case> cases = {
      {"one rank, two cores", both, both, 2, 2},
      {"two unbound ranks, two cores", times(both, 2), both, 2, 1},
      {"two ranks bound to a core each", both, cores(2, 0, 1), 2, 1},
      {"four unbound ranks, two cores", times(both, 4), both, 2, 1},
      {"four ranks in a 16-core cgroup of 64", times(cores(64, 0, 16), 4), cores(64, 0, 16), 16, 4},
      {"two ranks bound to a socket each", cores(16, 0, 16), cores(16, 8, 16), 16, 8},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const CoreShare s = share_cores(c.ranks_on_core, c.mine);
    EXPECT_EQ(s.cores, c.union_cores);
    EXPECT_EQ(threads_per_rank(0, s.share), c.threads);
    EXPECT_EQ(threads_per_rank(3, s.share), 3);  // [run] threads, when set, is taken as it is
  }
}

// The same through the binary: with [run] threads = 0, one unbound rank runs a thread on every
// core (with OpenMP's own binding too), and two ranks split them, bound by mpirun (a core each,
// its default for one or two ranks) or not. (A cpuset shared by ranks, the case the old rule
// got wrong, is the unit test's: this machine has none.)
TEST_F(MpiCli, RanksTakeTheirShareOfTheCores) {
  const double cores = number_after(test::run_command("nproc").output, "");
  auto threads = [&](int ranks, const std::string& env) {
    const auto r = mpirun(ranks, "--set run.threads=0 --dry-run", env);
    EXPECT_EQ(r.code, 0) << r.output;
    return number_after(line_from(r.output, "device cpu, "), "ranks x ");
  };
  const std::string unbound = "OMPI_MCA_hwloc_base_binding_policy=none ";
  EXPECT_EQ(threads(1, unbound), cores);
  // OpenMP's binding pins the main thread to its first place before main: the rank's cores are
  // its places, not that thread's affinity (which gave 1 thread).
  EXPECT_EQ(threads(1, unbound + "OMP_PROC_BIND=true "), cores);
  EXPECT_EQ(threads(2, unbound), std::max(1.0, std::floor(cores / 2)));
  if (cores == 2) {
    EXPECT_EQ(threads(2, ""), 1);  // mpirun's default: a core each
  }
}

}  // namespace
}  // namespace trainer
