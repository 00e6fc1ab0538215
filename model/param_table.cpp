#include "model/param_table.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "model/grad_units.h"

namespace trainer {

namespace {

// Relative cost per token of blocks [first, end) on a stage: a block's GEMMs (a multiply-add per
// weight) and attention (about T C for the causal half of QK^T and AV, twice); the last stage
// also runs the LM head (C V).
double stage_cost(const ModelConfig& cfg, int first, int end, bool last) {
  const double C = cfg.d_model;
  const double block = double(cfg.block_matmul_params()) + 2.0 * cfg.seq_len * C;
  return (end - first) * block + (last ? C * cfg.padded_vocab() : 0.0);
}

}  // namespace

std::vector<double> pipeline_stage_shares(const ModelConfig& cfg, int stages, double block_scale) {
  const std::vector<int> bounds = pipeline_partition(cfg, stages);
  const double head = stage_cost(cfg, 0, 0, true), block = stage_cost(cfg, 0, 1, false);
  const double whole = cfg.n_layer * block + head;
  std::vector<double> shares(static_cast<size_t>(stages));
  for (int s = 0; s < stages; s++)
    shares[s] =
        ((bounds[s + 1] - bounds[s]) * block * block_scale + (s == stages - 1 ? head : 0)) / whole;
  return shares;
}

double pipeline_imbalance(const ModelConfig& cfg, int stages) {
  const std::vector<double> shares = pipeline_stage_shares(cfg, stages, 1);
  return *std::max_element(shares.begin(), shares.end()) * stages;
}

std::vector<int> pipeline_partition(const ModelConfig& cfg, int stages) {
  const int L = cfg.n_layer;
  if (stages < 1 || stages > L) throw std::invalid_argument("pipeline_partition: bad stages");
  // best[s][e]: the least possible maximum stage cost for blocks [0, e) on stages [0, s].
  const double inf = 1e300;
  std::vector<std::vector<double>> best(stages, std::vector<double>(L + 1, inf));
  std::vector<std::vector<int>> cut(stages, std::vector<int>(L + 1, 0));
  for (int e = 1; e <= L; e++) best[0][e] = stage_cost(cfg, 0, e, stages == 1);
  for (int s = 1; s < stages; s++)
    for (int e = s + 1; e <= L; e++)
      for (int b = s; b < e; b++) {  // stage s holds [b, e)
        const double c = std::max(best[s - 1][b], stage_cost(cfg, b, e, s == stages - 1));
        if (c < best[s][e] - 1e-9 * c) {  // ties keep the earliest cut: more layers later
          best[s][e] = c;
          cut[s][e] = b;
        }
      }
  std::vector<int> bounds(stages + 1, L);
  for (int s = stages - 1; s > 0; s--) bounds[s] = cut[s][bounds[s + 1]];
  bounds[0] = 0;
  return bounds;
}

ModelShard ModelShard::make(const ModelConfig& cfg, int tp_rank, int tp_size, int stage,
                            int stages) {
  if (tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size || stages < 1 || stage < 0 ||
      stage >= stages || stages > cfg.n_layer)
    throw std::invalid_argument("ModelShard: bad tensor or pipeline coordinates");
  ModelShard s{tp_rank, tp_size, stage, stages};
  const std::vector<int> bounds = pipeline_partition(cfg, stages);
  s.first_layer = bounds[stage];
  s.end_layer = bounds[stage + 1];
  return s;
}

int64_t ParamInfo::logical_numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<int64_t> ParamInfo::local_shape() const {
  std::vector<int64_t> s = shape;
  if (split_dim < 0) return s;
  const int64_t piece = split_extent / split_parts / tp_size;
  // Only the embedding's split dimension is padded (to the padded vocab), and it has one part:
  // the rows of this rank's piece that fall below the real length are real.
  const int64_t start = tp_rank * piece;
  s[split_dim] = split_parts > 1 ? piece * split_parts
                                 : std::clamp<int64_t>(shape[split_dim] - start, 0, piece);
  return s;
}

int64_t ParamInfo::local_numel() const {
  int64_t n = 1;
  for (int64_t d : local_shape()) n *= d;
  return n;
}

int64_t ParamInfo::logical_index(int64_t i) const {
  if (split_dim < 0) return i;
  const std::vector<int64_t> local = local_shape();
  int64_t inner = 1;
  for (size_t d = split_dim + 1; d < shape.size(); d++) inner *= shape[d];
  const int64_t len = local[split_dim];
  const int64_t outer = i / (len * inner), j = i / inner % len, k = i % inner;
  const int64_t part_len = split_extent / split_parts, piece = part_len / tp_size;
  const int64_t global_j = j / piece * part_len + tp_rank * piece + j % piece;
  return (outer * shape[split_dim] + global_j) * inner + k;
}

int64_t ParamInfo::contiguous_from(int64_t i) const {
  if (split_dim < 0) return local_numel() - i;
  const std::vector<int64_t> local = local_shape();
  int64_t inner = 1;
  for (size_t d = split_dim + 1; d < shape.size(); d++) inner *= shape[d];
  const int64_t len = local[split_dim];
  const int64_t j = i / inner % len, k = i % inner;
  const int64_t piece = split_extent / split_parts / tp_size;
  // To the end of this rank's piece along the split dimension (or of its real rows).
  return std::min(piece - j % piece, len - j) * inner - k;
}

const ParamInfo& ParamTable::at(const std::string& name) const {
  auto it = index.find(name);
  if (it == index.end()) throw std::out_of_range("no parameter named " + name);
  return params[it->second];
}

const ParamInfo* ParamTable::find(const std::string& name) const {
  auto it = index.find(name);
  return it == index.end() ? nullptr : &params[it->second];
}

const ParamInfo* ParamTable::tied() const {
  for (const ParamInfo& p : params)
    if (p.tied) return &p;
  return nullptr;
}

int64_t ParamTable::layer_offset(int layer) const {
  for (const ParamInfo& p : params)
    if (p.layer == layer) return p.offset;
  return -1;
}

ParamInfo& ParamTableBuilder::add(std::string name, std::vector<int64_t> shape, ParamKind kind,
                                  int layer, float init_std, Split split, bool pack) {
  if (!pack && !table_.params.empty() && table_.params.back().layer != layer)
    table_.total = (table_.total + unit_multiple_ - 1) / unit_multiple_ * unit_multiple_;
  const int64_t offset = pack && !table_.params.empty() ? end_ : table_.total;
  ParamInfo p{std::move(name), std::move(shape), offset, 0, kind, layer, init_std};
  if (split.dim >= 0) {
    p.split_dim = split.dim;
    p.split_parts = split.parts;
    p.split_extent = split.extent ? split.extent : p.shape[split.dim];
  }
  p.tp_rank = shard_.tp_rank;
  p.tp_size = shard_.tp_size;
  std::vector<int64_t> allocated = p.shape;
  if (split.dim >= 0) allocated[split.dim] = p.split_extent / shard_.tp_size;
  p.numel = 1;
  for (int64_t d : allocated) p.numel *= d;
  end_ = p.offset + p.numel;
  table_.total = (end_ + 15) / 16 * 16;  // 64-byte aligned views for vectorised loops
  table_.index[p.name] = table_.params.size();
  table_.params.push_back(std::move(p));
  return table_.params.back();
}

ParamTable ParamTableBuilder::finish(int64_t total_multiple) {
  table_.total = (table_.total + total_multiple - 1) / total_multiple * total_multiple;
  return std::move(table_);
}

std::vector<GradUnit> grad_units(const ParamTable& table) {
  std::vector<GradUnit> units;
  for (size_t i = 0; i < table.params.size(); i++) {
    const ParamInfo& p = table.params[i];
    // A new unit at each change of block (the embeddings are "block" -1 ahead of the blocks,
    // the final norm and head -1 after them).
    if (i == 0 || table.params[i - 1].layer != p.layer) {
      if (i > 0) units.back().end = p.offset;
      units.push_back({p.offset, table.total, false});
    }
    units.back().held |= p.tied;
  }
  if (!units.empty()) units.front().begin = 0;
  return units;
}

int64_t held_end(const std::vector<GradUnit>& units) {
  int64_t end = 0;
  for (const GradUnit& u : units)
    if (u.held) end = u.end;
  return end;
}

int64_t largest_lent_unit(const std::vector<GradUnit>& units) {
  int64_t n = 0;
  for (const GradUnit& u : units)
    if (!u.held) n = std::max(n, u.elems());
  return n;
}

}  // namespace trainer
