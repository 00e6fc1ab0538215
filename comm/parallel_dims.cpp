#include "comm/parallel_dims.h"

#include <fmt/format.h>

#include "io/errors.h"

namespace trainer {
namespace {

const char* axis_name(Axis a) {
  return a == Axis::dp ? "dp" : a == Axis::tp ? "tp" : "pp";
}

std::array<Axis, 3> parse_order(const std::string& order) {
  std::array<Axis, 3> axes{};
  std::array<bool, 3> seen{};
  size_t start = 0;
  for (int i = 0; i < 3; i++) {
    const size_t end = order.find('-', start);
    const std::string name = order.substr(start, end == std::string::npos ? end : end - start);
    Axis a;
    if (name == "dp")
      a = Axis::dp;
    else if (name == "tp")
      a = Axis::tp;
    else if (name == "pp")
      a = Axis::pp;
    else
      break;
    if (seen[int(a)]) break;
    seen[int(a)] = true;
    axes[i] = a;
    if (i == 2 && end == std::string::npos) return axes;
    if (end == std::string::npos) break;
    start = end + 1;
  }
  throw ConfigError(fmt::format(
      "[parallel] order = \"{}\" must name tp, pp and dp once each, fastest-varying first "
      "(e.g. \"tp-pp-dp\")",
      order));
}

}  // namespace

ParallelDims ParallelDims::make(int world, int dp, int tp, int pp, const std::string& order,
                                const ModelConfig& model) {
  if (world < 1 || dp < 0 || tp < 1 || pp < 1)
    throw ConfigError(fmt::format("[parallel] invalid degrees: world {}, dp {}, tp {}, pp {}",
                                  world, dp, tp, pp));
  if (dp == 0) {
    if (world % (tp * pp) != 0)
      throw ConfigError(fmt::format(
          "[parallel] world size {} is not divisible by tp x pp = {} x {} = {}, so dp cannot be "
          "derived",
          world, tp, pp, tp * pp));
    dp = world / (tp * pp);
  }
  if (dp * tp * pp != world)
    throw ConfigError(
        fmt::format("[parallel] dp x tp x pp = {} x {} x {} = {} does not match the world size {}",
                    dp, tp, pp, dp * tp * pp, world));
  if (model.n_head % tp != 0)
    throw ConfigError(fmt::format("[parallel] tp = {} must divide n_head = {}", tp, model.n_head));
  if (model.kv_heads() % tp != 0)
    throw ConfigError(fmt::format(
        "[parallel] tp = {} must divide n_kv_head = {}: each rank holds whole key/value heads "
        "(they are split across the group, not replicated)",
        tp, model.kv_heads()));
  if (model.ffn() % tp != 0)
    throw ConfigError(
        fmt::format("[parallel] tp = {} must divide the MLP's hidden width {}", tp, model.ffn()));
  if (model.padded_vocab() % tp != 0)
    throw ConfigError(fmt::format(
        "[parallel] tp = {} must divide the padded vocabulary {} (make model.vocab_multiple a "
        "multiple of tp)",
        tp, model.padded_vocab()));
  if (pp > model.n_layer)
    throw ConfigError(
        fmt::format("[parallel] pp = {} exceeds n_layer = {}: every stage needs at least one layer",
                    pp, model.n_layer));

  ParallelDims d;
  d.world_ = world;
  d.size_ = {dp, tp, pp};
  d.order_ = parse_order(order);
  int stride = 1;
  for (Axis a : d.order_) {
    d.stride_[int(a)] = stride;
    stride *= d.size_[int(a)];
  }
  return d;
}

RankCoords ParallelDims::coords(int rank) const {
  auto at = [&](Axis a) { return rank / stride_[int(a)] % size_[int(a)]; };
  return {at(Axis::dp), at(Axis::tp), at(Axis::pp)};
}

int ParallelDims::rank_of(const RankCoords& c) const {
  return c.dp * stride_[int(Axis::dp)] + c.tp * stride_[int(Axis::tp)] +
         c.pp * stride_[int(Axis::pp)];
}

std::vector<int> ParallelDims::group(Axis axis, int rank) const {
  const RankCoords c = coords(rank);
  const int base = rank - c[axis] * stride_[int(axis)];
  std::vector<int> ranks(size(axis));
  for (int i = 0; i < size(axis); i++) ranks[i] = base + i * stride_[int(axis)];
  return ranks;
}

std::string ParallelDims::describe() const {
  std::string out =
      fmt::format("layout: world {} = dp {} x tp {} x pp {}, order {}-{}-{}\n", world_, dp(), tp(),
                  pp(), axis_name(order_[0]), axis_name(order_[1]), axis_name(order_[2]));
  for (Axis a : {Axis::tp, Axis::pp, Axis::dp}) {
    out += fmt::format("  {} groups:", axis_name(a));
    for (int r = 0; r < world_; r++) {
      if (coords(r)[a] != 0) continue;  // list each group once, from its first member
      out += " [";
      for (int m : group(a, r)) out += fmt::format("{}{}", m == r ? "" : " ", m);
      out += "]";
    }
    out += "\n";
  }
  return out;
}

}  // namespace trainer
