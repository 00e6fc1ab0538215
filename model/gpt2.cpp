// GPT-2 (Radford et al. 2019, as nanoGPT and llm.c write it): learned position embeddings,
// pre-LayerNorm blocks of causal multi-head attention and a GELU MLP, biases everywhere, the LM
// head tied to the token embedding (or, tie_embeddings = false, its own lm_head.weight); without
// biases (bias = false) as nanoGPT offers, and with nanoGPT's dropout of the embedding and of
// the two projections into the residual stream (counter-based: the masks are recomputed in
// backward, nothing is stored).
//
// Tensor parallelism (Megatron): QKV and the MLP's up-projection split by output rows (each rank
// holds whole heads), the two projections back into the residual stream by input columns, the
// embedding by vocabulary rows; norms and the biases added after a reduction are replicated.
// With sequence parallelism the norms, dropout and residual adds work on this rank's rows of the
// stream, and the norms' parameter gradients are summed over the group.
#include <cmath>
#include <string>

#include "model/architectures.h"

namespace trainer {
namespace {

constexpr TpSplit kRows = kSplitRows, kCols = kSplitCols;

class Gpt2 final : public ModelDefinition {
 public:
  Gpt2(const ModelConfig& cfg, const ModelShard& shard, int64_t total_multiple)
      : ModelDefinition(cfg, shard, gpt2_param_table(cfg, shard, total_multiple)),
        C_(cfg.d_model),
        Cl_(cfg.d_model / shard.tp_size),
        NHl_(cfg.n_head / shard.tp_size) {
    wte_ = table_.find("wte.weight");
    wpe_ = table_.find("wpe.weight");
    lnf_w_ = table_.find("ln_f.weight");
    lnf_b_ = table_.find("ln_f.bias");
    head_ = cfg.tie_embeddings ? wte_ : table_.find("lm_head.weight");
    auto at = [&](const std::string& name) { return &table_.at(name); };
    // Biases are absent with bias = false: a null view, which the kernels skip.
    auto bias = [&](const std::string& name) { return table_.find(name); };
    for (int l = shard.first_layer; l < shard.end_layer; l++) {
      const std::string h = "h." + std::to_string(l) + ".";
      blocks_.push_back({at(h + "ln1.weight"), bias(h + "ln1.bias"), at(h + "attn.qkv.weight"),
                         bias(h + "attn.qkv.bias"), at(h + "attn.proj.weight"),
                         bias(h + "attn.proj.bias"), at(h + "ln2.weight"), bias(h + "ln2.bias"),
                         at(h + "mlp.fc.weight"), bias(h + "mlp.fc.bias"),
                         at(h + "mlp.proj.weight"), bias(h + "mlp.proj.bias")});
    }
  }

  // ln1, ln1 mean and rstd, qkv, attention's log-sum-exps, its output, res2, ln2, ln2 mean and
  // rstd, fch, gelu(fch).
  enum Act {
    ln1,
    ln1_mean,
    ln1_rstd,
    qkv,
    lse,
    atty,
    res2,
    ln2,
    ln2_mean,
    ln2_rstd,
    fch,
    fch_gelu
  };
  // The norms' outputs are whole (they enter a tensor-parallel region); their statistics and
  // res2 are this rank's rows of the residual stream (stream_rows()).
  std::vector<ActSpec> layer_activations(int64_t B, int64_t T) const override {
    const int64_t BT = B * T, R = stream_rows(B, T);
    return {{BT * C_},
            {R, true},
            {R, true},
            {.elems = qkv_rows(B, T) * 3 * Cl_, .kv_cache = true},
            attention_keeps(B, NHl_, T),
            {BT * Cl_},
            {R * C_},
            {BT * C_},
            {R, true},
            {R, true},
            {BT * 4 * Cl_},
            {.elems = BT * 4 * Cl_, .selective = true}};
  }
  enum HeadAct { lnf, lnf_mean, lnf_rstd };
  std::vector<ActSpec> head_activations(int64_t B, int64_t T) const override {
    const int64_t R = stream_rows(B, T);
    return {{B * T * C_}, {R, true}, {R, true}};
  }
  // d_drop: the gradient of a dropped projection output (with dropout only). With sequence
  // parallelism, d_full: a whole (B T, C) gradient gathered from the ranks' rows (or in forward
  // a projection's partial output), and d_local: this rank's rows of a reduce-scattered one.
  // ring: ring attention's six buffers (context parallelism).
  enum Scratch { d_ln, d_qkv, d_atty, d_fch, d_drop, d_full, d_local, ring };
  std::vector<ActSpec> backward_scratch(int64_t B, int64_t T) const override {
    const int64_t BT = B * T;
    const bool sp = shard_.sequence_parallel;
    std::vector<ActSpec> v = {{BT * C_},
                              {BT * 3 * Cl_},
                              {BT * Cl_},
                              {BT * 4 * Cl_},
                              {cfg_.dropout > 0 ? BT * C_ : 0},
                              {sp ? BT * C_ : 0},
                              {sp ? stream_rows(B, T) * C_ : 0}};
    for (const ActSpec& r : ring_scratch(B, T, 3 * Cl_, Cl_)) v.push_back(r);
    return v;
  }

  void embed_forward(const LayerCall& c, DPtr x, const int32_t* tokens) const override {
    // The position embedding is added on one tensor-parallel rank: the sum adds it once.
    const DPtr wpe = c.tp.rank() == 0 ? P(c, wpe_) : DPtr{};
    const DPtr partial = leave_target(c, x, c.scratch[d_full]);
    embed_tokens(c, partial, tokens, P(c, wte_), wpe, C_, vocab_);
    leave_forward(c, partial, x, C_);
    dropout(c, x, c.rows() * C_, kEmbedSite, c.row0() * C_);
  }
  void embed_backward(const LayerCall& c, DPtr dx, const int32_t* tokens) const override {
    dropout(c, dx, c.rows() * C_, kEmbedSite, c.row0() * C_);
    const DPtr d = leave_backward(c, dx, c.scratch[d_full], C_);
    embed_tokens_backward(c, G(c, wte_), G(c, wpe_), d, tokens, C_, vocab_);
  }

  void layer_forward(const LayerCall& c, int l, DPtr x, DPtr out) const override {
    const Block& w = blocks_[l - shard_.first_layer];
    const DPtr *a = c.acts, *s = c.scratch;
    const int64_t BT = int64_t(c.B) * c.T, R = c.rows(), first = c.row0() * C_;
    Kernels& k = c.k;
    // In inference the new tokens' q, k, v go to their positions in the cache.
    const DPtr qkv_rows = c.inference ? a[qkv] + int64_t(c.pos0) * 3 * Cl_ : a[qkv];
    k.layernorm_forward(own_rows(c, a[ln1], C_), a[ln1_mean], a[ln1_rstd], x, P(c, w.ln1_w),
                        P(c, w.ln1_b), R, C_);
    enter_forward(c, a[ln1], C_);
    k.matmul_forward(qkv_rows, a[ln1], P(c, w.qkv_w), P(c, w.qkv_b), BT, C_, 3 * Cl_);
    c.tick();  // collectives in flight (ZeRO-3's next unit) progress between kernels
    attention(c, a[atty], a[lse], a[qkv], Cl_, NHl_, NHl_, s + ring);
    c.tick();
    const DPtr proj = leave_target(c, a[res2], s[d_full]);
    k.matmul_forward(proj, a[atty], P(c, w.proj_w), row_bias(c, w.proj_b), BT, Cl_, C_);
    leave_forward(c, proj, a[res2], C_);
    dropout(c, a[res2], R * C_, attn_site(l), first);
    k.residual_layernorm_forward(a[res2], own_rows(c, a[ln2], C_), a[ln2_mean], a[ln2_rstd],
                                 a[res2], x, P(c, w.ln2_w), P(c, w.ln2_b), R, C_);
    enter_forward(c, a[ln2], C_);
    k.matmul_gelu_forward(a[fch], a[fch_gelu], a[ln2], P(c, w.fc_w), P(c, w.fc_b), BT, C_, 4 * Cl_);
    c.tick();
    const DPtr mlp = leave_target(c, out, s[d_full]);
    k.matmul_forward(mlp, a[fch_gelu], P(c, w.fcproj_w), row_bias(c, w.fcproj_b), BT, 4 * Cl_, C_);
    leave_forward(c, mlp, out, C_);
    dropout(c, out, R * C_, mlp_site(l), first);
    k.residual_forward(out, out, a[res2], R * C_);
  }

  void layer_recompute(const LayerCall& c, int) const override {
    const DPtr* a = c.acts;
    c.k.gelu_forward(a[fch_gelu], a[fch], int64_t(c.B) * c.T * 4 * Cl_);
  }

  void layer_backward(const LayerCall& c, int l, DPtr x, DPtr d_res) const override {
    const Block& w = blocks_[l - shard_.first_layer];
    const DPtr *a = c.acts, *s = c.scratch;
    const int64_t BT = int64_t(c.B) * c.T, R = c.rows();
    Kernels& k = c.k;
    // out = res2 + dropout(proj(gelu(fc(ln2(res2))))): d_res (this rank's rows) is the gradient
    // w.r.t. out and res2.
    const DPtr d_out = leave_backward(c, d_res, s[d_full], C_);
    const DPtr d_mlp = dropped_grad(c, d_out, s[d_drop], BT * C_, mlp_site(l));
    k.matmul_backward_gelu(s[d_fch], G(c, w.fcproj_w), G(c, w.fcproj_b), d_mlp, a[fch_gelu],
                           P(c, w.fcproj_w), a[fch], BT, 4 * Cl_, C_);
    c.tick();
    k.matmul_backward(s[d_ln], G(c, w.fc_w), G(c, w.fc_b), s[d_fch], a[ln2], P(c, w.fc_w), BT, C_,
                      4 * Cl_);
    const DPtr d_ln2 = enter_backward(c, s[d_ln], s[d_local], C_);
    c.tick();
    k.layernorm_backward(d_res, norm_grad(c, w.ln2_w, 0), norm_grad(c, w.ln2_b, 1), d_ln2, a[res2],
                         P(c, w.ln2_w), a[ln2_mean], a[ln2_rstd], R, C_);
    finish_norm_grads(c, w.ln2_w, w.ln2_b);
    // res2 = x + dropout(proj(attention(qkv(ln1(x))))).
    const DPtr d_res2 = leave_backward(c, d_res, s[d_full], C_);
    const DPtr d_attn = dropped_grad(c, d_res2, s[d_drop], BT * C_, attn_site(l));
    k.matmul_backward(s[d_atty], G(c, w.proj_w), G(c, w.proj_b), d_attn, a[atty], P(c, w.proj_w),
                      BT, Cl_, C_);
    c.tick();
    attention_backward(c, s[d_qkv], s[d_atty], a[qkv], a[atty], a[lse], Cl_, NHl_, NHl_, s + ring);
    c.tick();
    k.matmul_backward(s[d_ln], G(c, w.qkv_w), G(c, w.qkv_b), s[d_qkv], a[ln1], P(c, w.qkv_w), BT,
                      C_, 3 * Cl_);
    const DPtr d_ln1 = enter_backward(c, s[d_ln], s[d_local], C_);
    k.layernorm_backward(d_res, norm_grad(c, w.ln1_w, 0), norm_grad(c, w.ln1_b, 1), d_ln1, x,
                         P(c, w.ln1_w), a[ln1_mean], a[ln1_rstd], R, C_);
    finish_norm_grads(c, w.ln1_w, w.ln1_b);
  }

  void head_forward(const LayerCall& c, DPtr x, DPtr logits) const override {
    const DPtr* h = c.acts;
    c.k.layernorm_forward(own_rows(c, h[lnf], C_), h[lnf_mean], h[lnf_rstd], x, P(c, lnf_w_),
                          P(c, lnf_b_), c.rows(), C_);
    lm_head_forward(c, head_, h[lnf], logits);
  }
  void head_backward(const LayerCall& c, DPtr x, DPtr dlogits, DPtr dx) const override {
    const DPtr *h = c.acts, *s = c.scratch;
    const DPtr d_lnf = lm_head_backward(c, head_, h[lnf], dlogits, s[d_ln], s[d_local]);
    c.k.zero(dx, c.rows() * C_);
    c.k.layernorm_backward(dx, norm_grad(c, lnf_w_, 0), norm_grad(c, lnf_b_, 1), d_lnf, x,
                           P(c, lnf_w_), h[lnf_mean], h[lnf_rstd], c.rows(), C_);
    finish_norm_grads(c, lnf_w_, lnf_b_);
  }

 private:
  struct Block {
    const ParamInfo *ln1_w, *ln1_b, *qkv_w, *qkv_b, *proj_w, *proj_b;
    const ParamInfo *ln2_w, *ln2_b, *fc_w, *fc_b, *fcproj_w, *fcproj_b;
  };
  // Dropout sites: the embedding, then each block's two projections.
  static constexpr uint64_t kEmbedSite = 0;
  static uint64_t attn_site(int l) { return 1 + 2 * uint64_t(l); }
  static uint64_t mlp_site(int l) { return 2 + 2 * uint64_t(l); }
  // The gradient of a dropped output whose result's gradient is d (which flows on unchanged
  // through the residual): d itself without dropout, else d dropped into `scratch`.
  DPtr dropped_grad(const LayerCall& c, DPtr d, DPtr scratch, int64_t n, uint64_t site) const {
    if (c.dropout <= 0) return d;
    c.k.convert(scratch, d, n, 0);
    dropout(c, scratch, n, site);
    return scratch;
  }
  // Row-parallel projections: partial sums are all-reduced, so the bias is added on one rank.
  DPtr row_bias(const LayerCall& c, const ParamInfo* p) const {
    return c.tp.rank() == 0 ? P(c, p) : DPtr{};
  }

  int C_, Cl_, NHl_;           // d_model, and this rank's slices of it and of the heads
  std::vector<Block> blocks_;  // this stage's, by local index
  const ParamInfo *wte_ = nullptr, *wpe_ = nullptr, *lnf_w_ = nullptr, *lnf_b_ = nullptr;
  const ParamInfo* head_ = nullptr;  // the LM head: wte_ when tied
};

}  // namespace

ParamTable gpt2_param_table(const ModelConfig& cfg, const ModelShard& shard,
                            int64_t total_multiple) {
  const int64_t C = cfg.d_model, V = cfg.vocab_size, Vp = cfg.padded_vocab(), T = cfg.seq_len;
  const float std_matrix = float(cfg.init_std);
  // GPT-2 scales the projections that write into the residual stream by 1/sqrt(2 L).
  const float std_residual = std_matrix / std::sqrt(2.0f * cfg.n_layer);
  ParamTableBuilder b(shard, total_multiple);
  const TpSplit vocab_rows{0, 1, Vp};
  add_token_embedding(b, cfg, shard, "wte.weight", std_matrix);
  if (shard.first_stage()) b.add("wpe.weight", {T, C}, ParamKind::embedding, -1, 0.01f);
  auto bias = [&](const std::string& name, int64_t n, int layer, TpSplit split = {}) {
    if (cfg.bias) b.add(name, {n}, ParamKind::bias, layer, 0, split);
  };
  for (int l = shard.first_layer; l < shard.end_layer; l++) {
    const std::string h = "h." + std::to_string(l) + ".";
    b.add(h + "ln1.weight", {C}, ParamKind::norm, l, 0);
    bias(h + "ln1.bias", C, l);
    b.add(h + "attn.qkv.weight", {3 * C, C}, ParamKind::matrix, l, std_matrix, {0, 3});
    bias(h + "attn.qkv.bias", 3 * C, l, {0, 3});
    b.add(h + "attn.proj.weight", {C, C}, ParamKind::matrix, l, std_residual, kCols);
    bias(h + "attn.proj.bias", C, l);
    b.add(h + "ln2.weight", {C}, ParamKind::norm, l, 0);
    bias(h + "ln2.bias", C, l);
    b.add(h + "mlp.fc.weight", {4 * C, C}, ParamKind::matrix, l, std_matrix, kRows);
    bias(h + "mlp.fc.bias", 4 * C, l, kRows);
    b.add(h + "mlp.proj.weight", {C, 4 * C}, ParamKind::matrix, l, std_residual, kCols);
    bias(h + "mlp.proj.bias", C, l);
  }
  if (shard.last_stage()) {
    b.add("ln_f.weight", {C}, ParamKind::norm, -1, 0);
    bias("ln_f.bias", C, -1);
    if (!cfg.tie_embeddings)
      b.add("lm_head.weight", {V, C}, ParamKind::matrix, -1, std_matrix, vocab_rows);
  }
  return b.finish(total_multiple);
}

std::unique_ptr<ModelDefinition> make_gpt2(const ModelConfig& cfg, const ModelShard& shard,
                                           int64_t total_multiple) {
  return std::make_unique<Gpt2>(cfg, shard, total_multiple);
}

}  // namespace trainer
