#include "model/param_table.h"

#include <cmath>
#include <stdexcept>

namespace trainer {

int64_t ParamInfo::logical_numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const ParamInfo& ParamTable::at(const std::string& name) const {
  auto it = index.find(name);
  if (it == index.end()) throw std::out_of_range("no parameter named " + name);
  return params[it->second];
}

ParamTable gpt2_param_table(const GPTConfig& cfg) {
  const int64_t C = cfg.d_model, V = cfg.vocab_size, Vp = cfg.padded_vocab(), T = cfg.seq_len;
  const float std_matrix = 0.02f;
  // GPT-2 scales the projections that write into the residual stream by 1/sqrt(2 L).
  const float std_residual = 0.02f / std::sqrt(2.0f * cfg.n_layer);
  ParamTable table;
  auto add = [&](std::string name, std::vector<int64_t> shape, ParamKind kind, int layer,
                 float init_std, int64_t numel = 0) {
    ParamInfo p{std::move(name), std::move(shape), table.total, 0, kind, layer, init_std};
    p.numel = numel ? numel : p.logical_numel();
    table.total += (p.numel + 15) / 16 * 16;  // 64-byte aligned views for vectorised loops
    table.index[p.name] = table.params.size();
    table.params.push_back(std::move(p));
  };
  add("wte.weight", {V, C}, ParamKind::embedding, -1, std_matrix, Vp * C);
  add("wpe.weight", {T, C}, ParamKind::embedding, -1, 0.01f);
  for (int l = 0; l < cfg.n_layer; l++) {
    const std::string h = "h." + std::to_string(l) + ".";
    add(h + "ln1.weight", {C}, ParamKind::norm, l, 0);
    add(h + "ln1.bias", {C}, ParamKind::bias, l, 0);
    add(h + "attn.qkv.weight", {3 * C, C}, ParamKind::matrix, l, std_matrix);
    add(h + "attn.qkv.bias", {3 * C}, ParamKind::bias, l, 0);
    add(h + "attn.proj.weight", {C, C}, ParamKind::matrix, l, std_residual);
    add(h + "attn.proj.bias", {C}, ParamKind::bias, l, 0);
    add(h + "ln2.weight", {C}, ParamKind::norm, l, 0);
    add(h + "ln2.bias", {C}, ParamKind::bias, l, 0);
    add(h + "mlp.fc.weight", {4 * C, C}, ParamKind::matrix, l, std_matrix);
    add(h + "mlp.fc.bias", {4 * C}, ParamKind::bias, l, 0);
    add(h + "mlp.proj.weight", {C, 4 * C}, ParamKind::matrix, l, std_residual);
    add(h + "mlp.proj.bias", {C}, ParamKind::bias, l, 0);
  }
  add("ln_f.weight", {C}, ParamKind::norm, -1, 0);
  add("ln_f.bias", {C}, ParamKind::bias, -1, 0);
  return table;
}

int64_t gpt2_flop_params(const GPTConfig& cfg) {
  int64_t n = 0;
  for (const auto& p : gpt2_param_table(cfg).params)
    if (p.name != "wpe.weight") n += p.logical_numel();
  return n;
}

}  // namespace trainer
