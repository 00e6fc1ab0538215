#include "comm/parallel_dims.h"

#include <fmt/format.h>

#include "io/errors.h"

namespace trainer {
namespace {

const char* axis_name(Axis a) {
  return a == Axis::dp ? "dp" : a == Axis::tp ? "tp" : a == Axis::pp ? "pp" : "cp";
}

// The configured order of tp, pp and dp, with cp right after tp.
std::array<Axis, 4> with_cp(const std::array<Axis, 3>& order) {
  std::array<Axis, 4> axes{};
  int n = 0;
  for (Axis a : order) {
    axes[n++] = a;
    if (a == Axis::tp) axes[n++] = Axis::cp;
  }
  return axes;
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
                                const ModelConfig& model, int cp) {
  if (world < 1 || dp < 0 || tp < 1 || pp < 1 || cp < 1)
    throw ConfigError(fmt::format(
        "[parallel] invalid degrees: world {}, dp {}, cp {}, tp {}, pp {}", world, dp, cp, tp, pp));
  const int model_ranks = tp * pp * cp;  // one data-parallel replica's
  // cp is named only where it is used.
  const std::string names = cp > 1 ? "cp x tp x pp" : "tp x pp";
  const std::string values =
      cp > 1 ? fmt::format("{} x {} x {}", cp, tp, pp) : fmt::format("{} x {}", tp, pp);
  if (dp == 0) {
    if (world % model_ranks != 0)
      throw ConfigError(fmt::format(
          "[parallel] world size {} is not divisible by {} = {} = {}, so dp cannot be derived",
          world, names, values, model_ranks));
    dp = world / model_ranks;
  }
  if (int64_t(dp) * model_ranks != world)
    throw ConfigError(
        fmt::format("[parallel] dp x {} = {} x {} = {} does not match the world size {}", names, dp,
                    values, int64_t(dp) * model_ranks, world));
  if (cp > 1 && model.seq_len % (2 * cp) != 0)
    throw ConfigError(fmt::format(
        "[parallel] cp = {} cuts each sequence into 2 x cp = {} chunks: model.seq_len = {} is not "
        "a multiple of it",
        cp, 2 * cp, model.seq_len));
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
  d.size_ = {dp, tp, pp, cp};
  d.order_ = with_cp(parse_order(order));
  int stride = 1;
  for (Axis a : d.order_) {
    d.stride_[int(a)] = stride;
    stride *= d.size_[int(a)];
  }
  return d;
}

RankCoords ParallelDims::coords(int rank) const {
  auto at = [&](Axis a) { return rank / stride_[int(a)] % size_[int(a)]; };
  return {at(Axis::dp), at(Axis::tp), at(Axis::pp), at(Axis::cp)};
}

int ParallelDims::rank_of(const RankCoords& c) const {
  return c.dp * stride_[int(Axis::dp)] + c.tp * stride_[int(Axis::tp)] +
         c.pp * stride_[int(Axis::pp)] + c.cp * stride_[int(Axis::cp)];
}

std::vector<int> ParallelDims::replica_group(int rank) const {
  RankCoords c = coords(rank);
  std::vector<int> ranks;
  for (c.dp = 0; c.dp < dp(); c.dp++)
    for (c.cp = 0; c.cp < cp(); c.cp++) ranks.push_back(rank_of(c));
  return ranks;
}

std::vector<int> ParallelDims::group(Axis axis, int rank) const {
  const RankCoords c = coords(rank);
  const int base = rank - c[axis] * stride_[int(axis)];
  std::vector<int> ranks(size(axis));
  for (int i = 0; i < size(axis); i++) ranks[i] = base + i * stride_[int(axis)];
  return ranks;
}

std::string ParallelDims::describe() const {
  std::string out = fmt::format("layout: world {} = dp {}{} x tp {} x pp {}, order ", world_, dp(),
                                cp() > 1 ? fmt::format(" x cp {}", cp()) : "", tp(), pp());
  for (Axis a : order_)
    if (a != Axis::cp || cp() > 1)
      out += fmt::format("{}{}", a == order_[0] ? "" : "-", axis_name(a));
  out += "\n";
  for (Axis a : {Axis::tp, Axis::cp, Axis::pp, Axis::dp}) {
    if (a == Axis::cp && cp() == 1) continue;
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
