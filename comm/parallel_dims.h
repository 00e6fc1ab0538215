#pragma once
// The process layout as a value: world size and the (dp, cp, tp, pp) degrees give every rank its
// coordinates and its groups, with a pure function and no MPI, so that it is unit-tested on
// its own. The order names the axes from fastest- to slowest-varying rank: with the default
// "tp-pp-dp" tensor-parallel ranks are adjacent (inside a node), pipeline stages next, data
// parallel outermost. Context-parallel ranks (model/context_parallel.h) come right after the
// tensor-parallel ones, where Megatron puts them too: ring attention's traffic, second only to
// tensor parallelism's, stays inside a node where it can.
#include <array>
#include <string>
#include <vector>

#include "model/model_config.h"

namespace trainer {

enum class Axis { dp = 0, tp = 1, pp = 2, cp = 3 };

struct RankCoords {
  int dp = 0, tp = 0, pp = 0, cp = 0;
  int operator[](Axis a) const {
    return a == Axis::dp ? dp : a == Axis::tp ? tp : a == Axis::pp ? pp : cp;
  }
  bool operator==(const RankCoords&) const = default;
};

class ParallelDims {
 public:
  // dp = 0 derives dp from the world size. Throws ConfigError, with the numbers, when the
  // layout does not fit the world or the model.
  static ParallelDims make(int world, int dp, int tp, int pp, const std::string& order,
                           const ModelConfig& model, int cp = 1);

  int world() const { return world_; }
  int size(Axis a) const { return size_[int(a)]; }
  int dp() const { return size(Axis::dp); }
  int tp() const { return size(Axis::tp); }
  int pp() const { return size(Axis::pp); }
  int cp() const { return size(Axis::cp); }

  RankCoords coords(int rank) const;
  int rank_of(const RankCoords& c) const;
  // The ranks that share every coordinate of `rank` except `axis`, ordered by that axis.
  std::vector<int> group(Axis axis, int rank) const;
  // The ranks that hold the same parameters as `rank` (the same tp and pp coordinates): its
  // data- and context-parallel peers, ordered by (dp, cp). They sum their gradients and share
  // ZeRO's shards as one group (Megatron's data-parallel group with context parallelism).
  std::vector<int> replica_group(int rank) const;
  int replicas() const { return dp() * cp(); }
  // `rank`'s place in its replica group.
  int replica_index(const RankCoords& c) const { return c.dp * cp() + c.cp; }
  // One line per group kind listing its groups, e.g. "tp groups: [0 1] [2 3]".
  std::string describe() const;

 private:
  int world_ = 1;
  std::array<int, 4> size_{1, 1, 1, 1};    // by Axis
  std::array<int, 4> stride_{1, 1, 1, 1};  // by Axis
  std::array<Axis, 4> order_{Axis::tp, Axis::cp, Axis::pp, Axis::dp};
};

}  // namespace trainer
