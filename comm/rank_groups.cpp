#include "comm/rank_groups.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <map>
#include <utility>
#include <vector>

namespace trainer {

NodeSplit split_by_node(const std::vector<int>& peers, int rank,
                        const std::function<int(int)>& node) {
  std::map<int, std::vector<int>> by_node;
  std::vector<int> node_order;
  for (int r : peers) {
    if (!by_node.count(node(r))) node_order.push_back(node(r));
    by_node[node(r)].push_back(r);
  }
  const std::vector<int>& mine = by_node[node(rank)];
  for (const auto& [n, members] : by_node)
    if (members.size() != mine.size())
      throw ConfigError(fmt::format(
          "[parallel] allreduce = \"hierarchical\" and [comm.outer] need the same number of "
          "data-parallel ranks on every node, found {} on node {} and {} on node {} (set "
          "parallel.ranks_per_node)",
          mine.size(), node(rank), members.size(), n));
  const size_t position = std::find(mine.begin(), mine.end(), rank) - mine.begin();
  std::vector<int> across;
  for (int n : node_order) across.push_back(by_node[n][position]);
  return {mine, across};
}

std::function<int(int)> node_of(World& world, const ParallelConfig& pc) {
  return [&world, per_node = pc.ranks_per_node](int r) {
    return per_node > 0 ? r / per_node : world.node_of(r);
  };
}

Groups make_groups(World& world, const ParallelDims& dims, const ParallelConfig& pc, bool by_node,
                   const GroupWrapper& wrap) {
  const int rank = world.rank();
  // Collective: every rank makes the same groups in the same order.
  auto group = [&](const std::vector<int>& members, const char* name) {
    std::unique_ptr<Communicator> c = world.group(members);
    return wrap ? wrap(std::move(c), name) : std::move(c);
  };
  Groups g;
  g.dp = group(dims.replica_group(rank), "dp");
  g.cp = group(dims.group(Axis::cp, rank), "cp");
  g.tp = group(dims.group(Axis::tp, rank), "tp");
  g.pp = group(dims.group(Axis::pp, rank), "pp");
  const std::vector<int> stages = dims.group(Axis::pp, rank);
  const RankCoords me = dims.coords(rank);
  const bool ends = me.pp == 0 || me.pp == dims.pp() - 1;
  g.emb = group(dims.pp() > 1 && ends ? std::vector<int>{stages.front(), stages.back()}
                                      : std::vector<int>{rank},
                "emb");
  if (by_node) {
    auto [intra, inter] = split_by_node(dims.replica_group(rank), rank, node_of(world, pc));
    g.intra = group(intra, "intra");
    g.inter = group(inter, "inter");
  }
  return g;
}

}  // namespace trainer
