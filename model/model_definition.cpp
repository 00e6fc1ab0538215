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

namespace {
// Ring attention's messages: keys and values, and their gradients (model/context_parallel.h).
constexpr int kKeysValues = 0, kKeyValueGrads = 1;
}  // namespace

void ModelDefinition::attention(const LayerCall& c, DPtr out, DPtr lse, DPtr qkv, int C, int NH,
                                int NKV, const DPtr* ring) {
  if (c.inference) return c.k.attention_inference(out, qkv, c.pos0 + c.T, c.pos0, C, NH, NKV);
  if (!c.split()) return c.k.attention_forward(out, lse, qkv, c.B, c.T, C, NH, NKV);
  // Ring attention. At step s this rank holds the keys and values of
  // rank holder(s), and passes them on to the next while it attends to them. The parts are
  // combined in ring[4] (fp32 with 16-bit activations: one rounding at the end).
  const ContextParallel& cp = *c.cp;
  const int64_t n = int64_t(c.B) * c.T * (C + 2 * int64_t(NKV) * (C / NH));
  const DPtr combined = ring[4].dtype == out.dtype ? out : ring[4];
  AttentionPart part{c.B, c.T, C, NH, NKV, cp.chunks(c.T), {}, true};
  DPtr held = qkv;
  for (int s = 0; s < cp.size(); s++) {
    const DPtr next = ring[s % 2];
    std::function<void()> wait;
    if (s + 1 < cp.size()) wait = cp.exchange(held, next, n, kKeysValues);
    part.keys = cp.chunks_of(cp.holder(s), c.T);
    part.first = s == 0;
    c.k.attention_part_forward(combined, lse, qkv, held, part);
    c.tick();
    if (wait) wait();
    held = next;
  }
  if (combined.p != out.p) c.k.convert(out, combined, int64_t(c.B) * c.T * C, 0);
}

void ModelDefinition::attention_backward(const LayerCall& c, DPtr dqkv, DPtr dout, DPtr qkv,
                                         DPtr out, DPtr lse, int C, int NH, int NKV,
                                         const DPtr* ring) {
  if (!c.split()) return c.k.attention_backward(dqkv, dout, qkv, out, lse, c.B, c.T, C, NH, NKV);
  // The keys and values go round again, each with its gradient so far (ring[2] and ring[3] in
  // turn); after the last step every rank has received its own keys' and values' gradient. The
  // query gradients are summed in ring[5] (fp32 with 16-bit activations, as the travelling ones).
  const ContextParallel& cp = *c.cp;
  const int64_t n = int64_t(c.B) * c.T * (C + 2 * int64_t(NKV) * (C / NH));
  const DPtr dq = ring[5].dtype == dqkv.dtype ? dqkv : ring[5];
  AttentionPart part{c.B, c.T, C, NH, NKV, cp.chunks(c.T), {}, false};
  c.k.zero(dq, n);
  DPtr held = qkv;
  c.k.zero(ring[2], n);
  for (int s = 0; s < cp.size(); s++) {
    const DPtr next = ring[s % 2];
    std::function<void()> wait;
    if (s + 1 < cp.size()) wait = cp.exchange(held, next, n, kKeysValues);
    part.keys = cp.chunks_of(cp.holder(s), c.T);
    const DPtr grad = ring[2 + s % 2], arrived = ring[2 + (s + 1) % 2];
    c.k.attention_part_backward(dq, grad, dout, qkv, held, out, lse, part);
    c.tick();
    cp.exchange(grad, arrived, n, kKeyValueGrads)();
    if (wait) wait();
    held = next;
  }
  c.k.residual_forward(dq, dq, ring[2 + cp.size() % 2], n);  // its query columns are zero
  if (dq.p != dqkv.p) c.k.convert(dqkv, dq, n, 0);
}

ActSpec ModelDefinition::attention_keeps(int64_t B, int NH, int64_t T) {
  return {.elems = B * NH * T, .stats = true};
}

std::vector<ActSpec> ModelDefinition::ring_scratch(int64_t B, int64_t T, int64_t width,
                                                   int64_t C) const {
  const int64_t rows = shard_.cp_size > 1 ? B * T : 0;
  return {{rows * width},
          {rows * width},
          {.elems = rows * width, .stats = true},
          {.elems = rows * width, .stats = true},
          {.elems = rows * C, .stats = true},
          {.elems = rows * width, .stats = true}};
}

// With context parallelism the tokens embed in one call and each sequence's two chunks then add
// their rows of the position embedding (the same one addition as the unsplit kernel's).
void ModelDefinition::embed_tokens(const LayerCall& c, DPtr out, const int32_t* tokens, DPtr wte,
                                   DPtr wpe, int C, VocabSlice vocab) {
  if (!c.split())
    return c.k.encoder_forward(out, tokens, wte, wpe ? wpe + int64_t(c.pos0) * C : DPtr{}, c.B, c.T,
                               C, vocab);
  c.k.encoder_forward(out, tokens, wte, DPtr{}, c.B, c.T, C, vocab);
  if (!wpe) return;
  const TokenChunks ch = c.cp->chunks(c.T);
  for (int b = 0; b < c.B; b++)
    for (int t0 : {0, ch.chunk}) {
      const DPtr rows = out + (int64_t(b) * c.T + t0) * C;
      c.k.residual_forward(rows, rows, wpe + int64_t(ch.position(t0)) * C, int64_t(ch.chunk) * C);
    }
}

void ModelDefinition::embed_tokens_backward(const LayerCall& c, DPtr dwte, DPtr dwpe, DPtr dout,
                                            const int32_t* tokens, int C, VocabSlice vocab) {
  if (!c.split()) return c.k.encoder_backward(dwte, dwpe, dout, tokens, c.B, c.T, C, vocab);
  c.k.encoder_backward(dwte, DPtr{}, dout, tokens, c.B, c.T, C, vocab);
  if (!dwpe) return;
  const TokenChunks ch = c.cp->chunks(c.T);
  for (int b = 0; b < c.B; b++)
    for (int t0 : {0, ch.chunk}) {
      const DPtr at = dwpe + int64_t(ch.position(t0)) * C;
      c.k.residual_forward(at, at, dout + (int64_t(b) * c.T + t0) * C, int64_t(ch.chunk) * C);
    }
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

void ModelDefinition::dropout(const LayerCall& c, DPtr x, int64_t n, uint64_t site,
                              int64_t first) const {
  if (c.dropout <= 0) return;
  const uint64_t key = mix64(c.dropout_key ^ mix64(site));
  if (!c.split()) return c.k.dropout(x, n, c.dropout, key, first);
  // Element e = (b T + t) C + i here is (b T cp + position(t)) C + i of the whole batch: each run
  // of one chunk's rows is numbered on from its first element's place.
  const int64_t C = cfg_.d_model, T_whole = int64_t(c.T) * c.cp->size();
  const TokenChunks ch = c.cp->chunks(c.T);
  for (int64_t e = first; e < first + n;) {
    const int64_t row = e / C, b = row / c.T;
    const int t = int(row % c.T);
    const int64_t end = std::min(first + n, (b * c.T + (t < ch.chunk ? ch.chunk : c.T)) * C);
    c.k.dropout(x + (e - first), end - e, c.dropout, key,
                (b * T_whole + ch.position(t)) * C + e % C);
    e = end;
  }
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

// QK^T and AV over the lower triangle, forward and backward: 6 L C T a token.
static double causal_attention_flops_per_token(const ModelConfig& cfg) {
  return 6.0 * cfg.n_layer * cfg.d_model * double(cfg.seq_len);
}

double flops_per_token(const ModelConfig& cfg) {
  return 6.0 * double(matmul_params(cfg)) + causal_attention_flops_per_token(cfg);
}

double palm_flops_per_token(const ModelConfig& cfg) {
  return 6.0 * double(matmul_params(cfg)) + 2 * causal_attention_flops_per_token(cfg);
}

}  // namespace trainer
