#include "model/model_definition.h"

#include <algorithm>
#include <stdexcept>

#include "model/architectures.h"
#include "model/init.h"

namespace trainer {

ModelDefinition::ModelDefinition(const ModelConfig& cfg, const ModelShard& shard, ParamTable table)
    : cfg_(cfg), shard_(shard), table_(std::move(table)) {
  const int tp = shard.tp_size, Vp = cfg.padded_vocab();
  if (cfg.n_head % tp || cfg.kv_heads() % tp || Vp % tp)
    throw std::invalid_argument("tp must divide n_head, n_kv_head and the padded vocabulary");
  const int width = Vp / tp, start = shard.tp_rank * width;
  vocab_ = {start, std::clamp(cfg.vocab_size - start, 0, width), width};
}

void ModelDefinition::attention(const LayerCall& c, DPtr out, DPtr att, DPtr qkv, int C, int NH,
                                int NKV) {
  if (c.inference)
    c.k.attention_inference(out, qkv, c.pos0 + c.T, c.pos0, C, NH, NKV);
  else
    c.k.attention_forward(out, att, qkv, c.B, c.T, C, NH, NKV);
}

ActSpec ModelDefinition::attention_keeps(int64_t B, int NH, int64_t T, bool keeps_probs) {
  return keeps_probs ? ActSpec{.elems = B * NH * T * T, .selective = true}
                     : ActSpec{.elems = B * NH * T, .stats = true};
}

void ModelDefinition::recompute_attention(const LayerCall& c, DPtr out, DPtr att, DPtr qkv, int C,
                                          int NH, int NKV) {
  if (c.k.attention_keeps_probabilities()) attention(c, out, att, qkv, C, NH, NKV);
}

void ModelDefinition::lm_head_forward(const LayerCall& c, const ParamInfo* w, DPtr x,
                                      DPtr logits) const {
  const int64_t BT = int64_t(c.B) * c.T;
  enter_forward(c, x, cfg_.d_model);
  c.k.matmul_forward(logits, x, P(c, w), DPtr{}, BT, cfg_.d_model, vocab_.width);
}

DPtr ModelDefinition::lm_head_backward(const LayerCall& c, const ParamInfo* w, DPtr x, DPtr dlogits,
                                       DPtr d_x, DPtr local) const {
  const int64_t BT = int64_t(c.B) * c.T;
  c.k.matmul_backward(d_x, G(c, w), DPtr{}, dlogits, x, P(c, w), BT, cfg_.d_model, vocab_.width);
  return enter_backward(c, d_x, local, cfg_.d_model);
}

void add_token_embedding(ParamTableBuilder& b, const ModelConfig& cfg, const ModelShard& shard,
                         const std::string& name, float init_std) {
  if (!shard.first_stage() && !(shard.last_stage() && cfg.tie_embeddings)) return;
  const TpSplit vocab_rows{0, 1, cfg.padded_vocab()};
  ParamInfo& p =
      b.add(name, {cfg.vocab_size, cfg.d_model}, ParamKind::embedding, -1, init_std, vocab_rows);
  p.tied = cfg.tie_embeddings;
  p.tied_copy = !shard.first_stage();
}

void ModelDefinition::dropout(const LayerCall& c, DPtr x, int64_t n, uint64_t site, int64_t first) {
  if (c.dropout > 0) c.k.dropout(x, n, c.dropout, mix64(c.dropout_key ^ mix64(site)), first);
}

void ModelDefinition::enter_forward(const LayerCall& c, DPtr full, int C) {
  if (c.sp)
    c.tp.gather_rows(own_rows(c, full, C), full, c.rows() * C);
  else
    c.tp.copy_forward(full, c.rows() * C);
}

DPtr ModelDefinition::enter_backward(const LayerCall& c, DPtr dfull, DPtr local, int C) {
  if (!c.sp) {
    c.tp.copy_backward(dfull, c.rows() * C);
    return dfull;
  }
  c.tp.scatter_rows(dfull, local, c.rows() * C);
  return local;
}

void ModelDefinition::leave_forward(const LayerCall& c, DPtr target, DPtr local, int C) {
  if (c.sp)
    c.tp.scatter_rows(target, local, c.rows() * C);
  else
    c.tp.reduce_forward(local, c.rows() * C);
}

DPtr ModelDefinition::leave_backward(const LayerCall& c, DPtr dlocal, DPtr dfull, int C) {
  if (!c.sp) {
    c.tp.reduce_backward(dlocal, c.rows() * C);
    return dlocal;
  }
  c.tp.gather_rows(dlocal, dfull, c.rows() * C);
  return dfull;
}

DPtr ModelDefinition::norm_grad(const LayerCall& c, const ParamInfo* p, int slot) const {
  if (!p) return {};
  if (!c.sp) return G(c, p);
  const DPtr part = c.norm_grad_scratch + int64_t(slot) * cfg_.d_model;
  c.k.zero(part, cfg_.d_model);
  return part;
}

void ModelDefinition::finish_norm_grads(const LayerCall& c, const ParamInfo* weight,
                                        const ParamInfo* bias) const {
  if (!c.sp) return;
  const int64_t C = cfg_.d_model;
  c.tp.sum_norm_grads(c.norm_grad_scratch, bias ? 2 * C : C);  // one reduction for both
  c.k.residual_forward(G(c, weight), G(c, weight), c.norm_grad_scratch, C);
  if (bias) c.k.residual_forward(G(c, bias), G(c, bias), c.norm_grad_scratch + C, C);
}

std::unique_ptr<ModelDefinition> make_model_definition(const ModelConfig& cfg,
                                                       const ModelShard& shard,
                                                       int64_t total_multiple) {
  if (cfg.arch == Arch::llama) return make_llama(cfg, shard, total_multiple);
  return make_gpt2(cfg, shard, total_multiple);
}

ParamTable param_table(const ModelConfig& cfg, const ModelShard& shard, int64_t total_multiple) {
  if (cfg.arch == Arch::llama) return llama_param_table(cfg, shard, total_multiple);
  return gpt2_param_table(cfg, shard, total_multiple);
}

int64_t matmul_params(const ModelConfig& cfg) {
  // The blocks' matrices and the LM head (the tied embedding, or the untied head).
  int64_t n = 0;
  for (const auto& p : param_table(cfg).params)
    if (p.kind == ParamKind::matrix || p.tied) n += p.logical_numel();
  return n;
}

double flops_per_token(const ModelConfig& cfg) {
  return 6.0 * double(matmul_params(cfg)) + 6.0 * cfg.n_layer * cfg.d_model * double(cfg.seq_len);
}

}  // namespace trainer
