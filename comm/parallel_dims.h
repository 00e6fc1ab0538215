#pragma once
// The process layout as a value: world size and the (dp, tp, pp) degrees give every rank its
// coordinates and its groups, with a pure function and no MPI, so that it is unit-tested on
// its own. The order names the axes from fastest- to slowest-varying rank: with the default
// "tp-pp-dp" tensor-parallel ranks are adjacent (inside a node), pipeline stages next, data
// parallel outermost.
#include <array>
#include <string>
#include <vector>

#include "model/model_config.h"

namespace trainer {

enum class Axis { dp = 0, tp = 1, pp = 2 };

struct RankCoords {
  int dp = 0, tp = 0, pp = 0;
  int operator[](Axis a) const { return a == Axis::dp ? dp : a == Axis::tp ? tp : pp; }
  bool operator==(const RankCoords&) const = default;
};

class ParallelDims {
 public:
  // dp = 0 derives dp from the world size. Throws ConfigError, with the numbers, when the
  // layout does not fit the world or the model.
  static ParallelDims make(int world, int dp, int tp, int pp, const std::string& order,
                           const ModelConfig& model);

  int world() const { return world_; }
  int size(Axis a) const { return size_[int(a)]; }
  int dp() const { return size(Axis::dp); }
  int tp() const { return size(Axis::tp); }
  int pp() const { return size(Axis::pp); }

  RankCoords coords(int rank) const;
  int rank_of(const RankCoords& c) const;
  // The ranks that share every coordinate of `rank` except `axis`, ordered by that axis.
  std::vector<int> group(Axis axis, int rank) const;
  // One line per group kind listing its groups, e.g. "tp groups: [0 1] [2 3]".
  std::string describe() const;

 private:
  int world_ = 1;
  std::array<int, 3> size_{1, 1, 1};    // by Axis
  std::array<int, 3> stride_{1, 1, 1};  // by Axis
  std::array<Axis, 3> order_{Axis::tp, Axis::pp, Axis::dp};
};

}  // namespace trainer
