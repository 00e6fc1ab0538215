#include "model/param_table.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace trainer {

std::vector<int> pipeline_partition(const GPTConfig& cfg, int stages) {
  const int L = cfg.n_layer;
  if (stages < 1 || stages > L) throw std::invalid_argument("pipeline_partition: bad stages");
  // Relative cost per token: a block's GEMMs (12 C^2 multiply-adds) and attention (about T C
  // for the causal half of QK^T and AV, twice); the last stage also runs the LM head (C V).
  const double C = cfg.d_model, block = 12 * C * C + 2.0 * cfg.seq_len * C;
  const double head = C * cfg.padded_vocab();
  auto stage_cost = [&](int first, int end, bool last) {
    return (end - first) * block + (last ? head : 0.0);
  };
  // best[s][e]: the least possible maximum stage cost for blocks [0, e) on stages [0, s].
  const double inf = 1e300;
  std::vector<std::vector<double>> best(stages, std::vector<double>(L + 1, inf));
  std::vector<std::vector<int>> cut(stages, std::vector<int>(L + 1, 0));
  for (int e = 1; e <= L; e++) best[0][e] = stage_cost(0, e, stages == 1);
  for (int s = 1; s < stages; s++)
    for (int e = s + 1; e <= L; e++)
      for (int b = s; b < e; b++) {  // stage s holds [b, e)
        const double c = std::max(best[s - 1][b], stage_cost(b, e, s == stages - 1));
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

ModelShard ModelShard::make(const GPTConfig& cfg, int tp_rank, int tp_size, int stage, int stages) {
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

ParamTable gpt2_param_table(const GPTConfig& cfg, const ModelShard& shard, int64_t total_multiple) {
  const int64_t C = cfg.d_model, V = cfg.vocab_size, Vp = cfg.padded_vocab(), T = cfg.seq_len;
  const float std_matrix = 0.02f;
  // GPT-2 scales the projections that write into the residual stream by 1/sqrt(2 L).
  const float std_residual = 0.02f / std::sqrt(2.0f * cfg.n_layer);
  ParamTable table;
  struct Split {
    int dim = -1, parts = 1;
    int64_t extent = 0;
  };
  auto add = [&](std::string name, std::vector<int64_t> shape, ParamKind kind, int layer,
                 float init_std, Split split = {}) {
    ParamInfo p{std::move(name), std::move(shape), table.total, 0, kind, layer, init_std};
    if (split.dim >= 0) {
      p.split_dim = split.dim;
      p.split_parts = split.parts;
      p.split_extent = split.extent ? split.extent : p.shape[split.dim];
    }
    p.tp_rank = shard.tp_rank;
    p.tp_size = shard.tp_size;
    std::vector<int64_t> allocated = p.shape;
    if (split.dim >= 0) allocated[split.dim] = p.split_extent / shard.tp_size;
    p.numel = 1;
    for (int64_t d : allocated) p.numel *= d;
    table.total += (p.numel + 15) / 16 * 16;  // 64-byte aligned views for vectorised loops
    table.index[p.name] = table.params.size();
    table.params.push_back(std::move(p));
  };
  const Split rows{0}, cols{1};
  if (shard.first_stage() || shard.last_stage()) {
    add("wte.weight", {V, C}, ParamKind::embedding, -1, std_matrix, {0, 1, Vp});
    table.params.back().tied_copy = !shard.first_stage();
  }
  if (shard.first_stage()) add("wpe.weight", {T, C}, ParamKind::embedding, -1, 0.01f);
  for (int l = shard.first_layer; l < shard.end_layer; l++) {
    const std::string h = "h." + std::to_string(l) + ".";
    add(h + "ln1.weight", {C}, ParamKind::norm, l, 0);
    add(h + "ln1.bias", {C}, ParamKind::bias, l, 0);
    add(h + "attn.qkv.weight", {3 * C, C}, ParamKind::matrix, l, std_matrix, {0, 3});
    add(h + "attn.qkv.bias", {3 * C}, ParamKind::bias, l, 0, {0, 3});
    add(h + "attn.proj.weight", {C, C}, ParamKind::matrix, l, std_residual, cols);
    add(h + "attn.proj.bias", {C}, ParamKind::bias, l, 0);
    add(h + "ln2.weight", {C}, ParamKind::norm, l, 0);
    add(h + "ln2.bias", {C}, ParamKind::bias, l, 0);
    add(h + "mlp.fc.weight", {4 * C, C}, ParamKind::matrix, l, std_matrix, rows);
    add(h + "mlp.fc.bias", {4 * C}, ParamKind::bias, l, 0, rows);
    add(h + "mlp.proj.weight", {C, 4 * C}, ParamKind::matrix, l, std_residual, cols);
    add(h + "mlp.proj.bias", {C}, ParamKind::bias, l, 0);
  }
  if (shard.last_stage()) {
    add("ln_f.weight", {C}, ParamKind::norm, -1, 0);
    add("ln_f.bias", {C}, ParamKind::bias, -1, 0);
  }
  table.total = (table.total + total_multiple - 1) / total_multiple * total_multiple;
  return table;
}

int64_t gpt2_matmul_params(const GPTConfig& cfg) {
  int64_t n = 0;
  for (const auto& p : gpt2_param_table(cfg).params)
    if (p.kind == ParamKind::matrix || p.name == "wte.weight") n += p.logical_numel();
  return n;
}

double gpt2_flops_per_token(const GPTConfig& cfg) {
  return 6.0 * double(gpt2_matmul_params(cfg)) +
         6.0 * cfg.n_layer * cfg.d_model * double(cfg.seq_len);
}

}  // namespace trainer
