// Llama (Touvron et al. 2023; Llama 2 and 3, Mistral, SmolLM and Qwen share the block):
// pre-RMSNorm blocks of causal grouped-query attention with rotary position embeddings and a
// SwiGLU MLP, no biases, no position embedding, an untied LM head by default. Parameter names
// are Meta's (tok_embeddings, layers.N.attention.wq, ..., norm, output), so that checkpoints
// map onto Meta's and torchtitan's state dicts one to one.
//
// wq, wk and wv are packed into one matrix (model/param_table.h), so QKV is one GEMM whose
// output rows are the kernels' qkv layout (NH query heads, NKV key heads, NKV value heads); w1
// and w3 likewise give SwiGLU's [gate | up] rows.
//
// Tensor parallelism (Megatron): wq, wk, wv, w1 and w3 split by output rows (each rank holds
// whole query and key/value heads: tp divides n_kv_head, KV heads are split, never replicated),
// wo and w2 by input columns, the embedding and the head by vocabulary rows; norms replicated.
// With sequence parallelism the norms and residual adds work on this rank's rows of the stream,
// and the norms' weight gradients are summed over the group.
#include <cmath>
#include <numbers>
#include <string>
#include <vector>

#include "model/architectures.h"

namespace trainer {
namespace {

constexpr TpSplit kRows = kSplitRows, kCols = kSplitCols;

class Llama final : public ModelDefinition {
 public:
  Llama(const ModelConfig& cfg, const ModelShard& shard, int64_t total_multiple)
      : ModelDefinition(cfg, shard, llama_param_table(cfg, shard, total_multiple)),
        C_(cfg.d_model),
        hs_(cfg.head_size()),
        NHl_(cfg.n_head / shard.tp_size),
        NKVl_(cfg.kv_heads() / shard.tp_size),
        Fl_(cfg.ffn() / shard.tp_size),
        eps_(float(cfg.norm_eps)) {
    Cl_ = NHl_ * hs_;
    QKVl_ = (NHl_ + 2 * NKVl_) * hs_;
    tok_ = table_.find("tok_embeddings.weight");
    norm_ = table_.find("norm.weight");
    head_ = cfg.tie_embeddings ? tok_ : table_.find("output.weight");
    auto at = [&](const std::string& name) { return &table_.at(name); };
    for (int l = shard.first_layer; l < shard.end_layer; l++) {
      const std::string p = "layers." + std::to_string(l) + ".";
      blocks_.push_back({at(p + "attention_norm.weight"), at(p + "attention.wq.weight"),
                         at(p + "attention.wo.weight"), at(p + "ffn_norm.weight"),
                         at(p + "feed_forward.w1.weight"), at(p + "feed_forward.w2.weight")});
    }
  }

  enum Act { attn_norm, attn_rstd, qkv, lse, atty, res2, ffn_norm, ffn_rstd, gate_up, swi };
  // The norms' outputs are whole (they enter a tensor-parallel region); their statistics and
  // res2 are this rank's rows of the residual stream (stream_rows()).
  std::vector<ActSpec> layer_activations(int64_t B, int64_t T) const override {
    const int64_t BT = B * T, R = stream_rows(B, T);
    return {{BT * C_},
            {R, true},
            {.elems = qkv_rows(B, T) * QKVl_, .kv_cache = true},
            attention_keeps(B, NHl_, T),
            {BT * Cl_},
            {R * C_},
            {BT * C_},
            {R, true},
            {BT * 2 * Fl_},
            {.elems = BT * Fl_, .selective = true}};
  }
  enum HeadAct { final_norm, final_rstd };
  std::vector<ActSpec> head_activations(int64_t B, int64_t T) const override {
    return {{B * T * C_}, {stream_rows(B, T), true}};
  }
  // With sequence parallelism, d_full: a whole (B T, C) gradient gathered from the ranks' rows
  // (or in forward a projection's partial output), and d_local: this rank's rows of a
  // reduce-scattered one.
  // ring: ring attention's six buffers (context parallelism).
  enum Scratch { d_norm, d_qkv, d_atty, d_gate_up, d_swi, d_full, d_local, ring };
  std::vector<ActSpec> backward_scratch(int64_t B, int64_t T) const override {
    const int64_t BT = B * T;
    const bool sp = shard_.sequence_parallel;
    std::vector<ActSpec> v = {{BT * C_},
                              {BT * QKVl_},
                              {BT * Cl_},
                              {BT * 2 * Fl_},
                              {BT * Fl_},
                              {sp ? BT * C_ : 0},
                              {sp ? stream_rows(B, T) * C_ : 0}};
    for (const ActSpec& r : ring_scratch(B, T, QKVl_, Cl_)) v.push_back(r);
    return v;
  }

  // The rotary table: cos and sin of every position x frequency, fp32, on the backend.
  void prepare(Kernels& k, int max_T) override {
    const std::vector<float> table = rope_table(cfg_, max_T);
    rope_ = k.alloc(int64_t(table.size()), DType::f32);
    k.copy_from_host(rope_, table.data(), int64_t(table.size()));
  }
  void release(Kernels& k) override {
    if (rope_) k.free(rope_);
    rope_ = {};
  }

  void embed_forward(const LayerCall& c, DPtr x, const int32_t* tokens) const override {
    const DPtr partial = leave_target(c, x, c.scratch[d_full]);
    c.k.encoder_forward(partial, tokens, P(c, tok_), DPtr{}, c.B, c.T, C_, vocab_);
    leave_forward(c, partial, x, C_);
  }
  void embed_backward(const LayerCall& c, DPtr dx, const int32_t* tokens) const override {
    const DPtr d = leave_backward(c, dx, c.scratch[d_full], C_);
    c.k.encoder_backward(G(c, tok_), DPtr{}, d, tokens, c.B, c.T, C_, vocab_);
  }

  void layer_forward(const LayerCall& c, int l, DPtr x, DPtr out) const override {
    const Block& w = blocks_[l - shard_.first_layer];
    const DPtr *a = c.acts, *s = c.scratch;
    const int64_t BT = int64_t(c.B) * c.T, R = c.rows();
    Kernels& k = c.k;
    // In inference the new tokens' q, k, v go to their positions in the cache.
    const DPtr qkv_rows = c.inference ? a[qkv] + int64_t(c.pos0) * QKVl_ : a[qkv];
    k.rmsnorm_forward(own_rows(c, a[attn_norm], C_), a[attn_rstd], x, P(c, w.attn_norm), R, C_,
                      eps_);
    enter_forward(c, a[attn_norm], C_);
    k.matmul_forward(qkv_rows, a[attn_norm], P(c, w.wqkv), DPtr{}, BT, C_, QKVl_);
    c.tick();  // collectives in flight (ZeRO-3's next unit) progress between kernels
    rope(c, qkv_rows, false);
    attention(c, a[atty], a[lse], a[qkv], Cl_, NHl_, NKVl_, s + ring);
    c.tick();
    const DPtr wo = leave_target(c, a[res2], s[d_full]);
    k.matmul_forward(wo, a[atty], P(c, w.wo), DPtr{}, BT, Cl_, C_);
    leave_forward(c, wo, a[res2], C_);
    k.residual_rmsnorm_forward(a[res2], own_rows(c, a[ffn_norm], C_), a[ffn_rstd], a[res2], x,
                               P(c, w.ffn_norm), R, C_, eps_);
    enter_forward(c, a[ffn_norm], C_);
    k.matmul_forward(a[gate_up], a[ffn_norm], P(c, w.w13), DPtr{}, BT, C_, 2 * Fl_);
    k.swiglu_forward(a[swi], a[gate_up], BT, Fl_);
    c.tick();
    const DPtr w2 = leave_target(c, out, s[d_full]);
    k.matmul_forward(w2, a[swi], P(c, w.w2), DPtr{}, BT, Fl_, C_);
    leave_forward(c, w2, out, C_);
    k.residual_forward(out, out, a[res2], R * C_);
  }

  void layer_recompute(const LayerCall& c, int) const override {
    const DPtr* a = c.acts;
    c.k.swiglu_forward(a[swi], a[gate_up], int64_t(c.B) * c.T, Fl_);
  }

  void layer_backward(const LayerCall& c, int l, DPtr x, DPtr d_res) const override {
    const Block& w = blocks_[l - shard_.first_layer];
    const DPtr *a = c.acts, *s = c.scratch;
    const int64_t BT = int64_t(c.B) * c.T, R = c.rows();
    Kernels& k = c.k;
    // out = res2 + w2(swiglu(w13(ffn_norm(res2)))): d_res (this rank's rows) is the gradient
    // w.r.t. out and res2.
    const DPtr d_out = leave_backward(c, d_res, s[d_full], C_);
    k.matmul_backward(s[d_swi], G(c, w.w2), DPtr{}, d_out, a[swi], P(c, w.w2), BT, Fl_, C_);
    c.tick();
    k.swiglu_backward(s[d_gate_up], s[d_swi], a[gate_up], BT, Fl_);
    k.matmul_backward(s[d_norm], G(c, w.w13), DPtr{}, s[d_gate_up], a[ffn_norm], P(c, w.w13), BT,
                      C_, 2 * Fl_);
    const DPtr d_ffn_norm = enter_backward(c, s[d_norm], s[d_local], C_);
    c.tick();
    k.rmsnorm_backward(d_res, norm_grad(c, w.ffn_norm, 0), d_ffn_norm, a[res2], P(c, w.ffn_norm),
                       a[ffn_rstd], R, C_);
    finish_norm_grads(c, w.ffn_norm, nullptr);
    // res2 = x + wo(attention(rope(wqkv(attention_norm(x))))).
    const DPtr d_res2 = leave_backward(c, d_res, s[d_full], C_);
    k.matmul_backward(s[d_atty], G(c, w.wo), DPtr{}, d_res2, a[atty], P(c, w.wo), BT, Cl_, C_);
    c.tick();
    attention_backward(c, s[d_qkv], s[d_atty], a[qkv], a[atty], a[lse], Cl_, NHl_, NKVl_, s + ring);
    c.tick();
    // The gradient of the rotated q and k, rotated back (qkv holds them rotated).
    rope(c, s[d_qkv], true);
    k.matmul_backward(s[d_norm], G(c, w.wqkv), DPtr{}, s[d_qkv], a[attn_norm], P(c, w.wqkv), BT, C_,
                      QKVl_);
    const DPtr d_attn_norm = enter_backward(c, s[d_norm], s[d_local], C_);
    k.rmsnorm_backward(d_res, norm_grad(c, w.attn_norm, 0), d_attn_norm, x, P(c, w.attn_norm),
                       a[attn_rstd], R, C_);
    finish_norm_grads(c, w.attn_norm, nullptr);
  }

  void head_forward(const LayerCall& c, DPtr x, DPtr logits) const override {
    const DPtr* h = c.acts;
    c.k.rmsnorm_forward(own_rows(c, h[final_norm], C_), h[final_rstd], x, P(c, norm_), c.rows(), C_,
                        eps_);
    lm_head_forward(c, head_, h[final_norm], logits);
  }
  void head_backward(const LayerCall& c, DPtr x, DPtr dlogits, DPtr dx) const override {
    const DPtr *h = c.acts, *s = c.scratch;
    const DPtr d_norm_out =
        lm_head_backward(c, head_, h[final_norm], dlogits, s[d_norm], s[d_local]);
    c.k.zero(dx, c.rows() * C_);
    c.k.rmsnorm_backward(dx, norm_grad(c, norm_, 0), d_norm_out, x, P(c, norm_), h[final_rstd],
                         c.rows(), C_);
    finish_norm_grads(c, norm_, nullptr);
  }

 private:
  // RoPE on (B, T) qkv rows at their positions: from pos0, or with context parallelism each
  // sequence's two chunks at theirs. Backward rotates a gradient back.
  void rope(const LayerCall& c, DPtr rows, bool backward) const {
    auto run = [&](DPtr at, int B, int T, int pos0) {
      if (backward)
        c.k.rope_backward(at, rope_, B, T, NHl_, NKVl_, hs_, pos0);
      else
        c.k.rope_forward(at, rope_, B, T, NHl_, NKVl_, hs_, pos0);
    };
    if (!c.split()) return run(rows, c.B, c.T, c.pos0);
    const TokenChunks ch = c.cp->chunks(c.T);
    for (int b = 0; b < c.B; b++)
      for (int t0 : {0, ch.chunk})
        run(rows + (int64_t(b) * c.T + t0) * QKVl_, 1, ch.chunk, ch.position(t0));
  }

  struct Block {
    const ParamInfo *attn_norm, *wqkv, *wo, *ffn_norm, *w13, *w2;  // wqkv: wq, packed with wk, wv
  };

  int C_, hs_, NHl_, NKVl_, Fl_;  // this rank's heads and MLP width
  int Cl_ = 0, QKVl_ = 0;         // this rank's query width and qkv row width
  float eps_;
  std::vector<Block> blocks_;  // this stage's, by local index
  const ParamInfo *tok_ = nullptr, *norm_ = nullptr, *head_ = nullptr;
  DPtr rope_;
};

}  // namespace

std::vector<double> rope_frequencies(const ModelConfig& cfg) {
  const int half = cfg.head_size() / 2;
  const RopeScaling& s = cfg.rope_scaling;
  std::vector<double> freqs(half);
  for (int i = 0; i < half; i++) {
    double f = 1.0 / std::pow(cfg.rope_theta, 2.0 * i / cfg.head_size());
    if (s.factor > 0) {
      // Llama 3.1: long wavelengths slowed down by `factor`, short ones kept, a smooth blend
      // in between.
      const double wavelen = 2 * std::numbers::pi / f;
      const double low_wavelen = s.original_max_pos / s.low_freq_factor;
      const double high_wavelen = s.original_max_pos / s.high_freq_factor;
      if (wavelen > low_wavelen) {
        f /= s.factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth = (s.original_max_pos / wavelen - s.low_freq_factor) /
                              (s.high_freq_factor - s.low_freq_factor);
        f = (1 - smooth) * f / s.factor + smooth * f;
      }
    }
    freqs[i] = f;
  }
  return freqs;
}

std::vector<float> rope_table(const ModelConfig& cfg, int positions) {
  const std::vector<double> freqs = rope_frequencies(cfg);
  const size_t half = freqs.size();
  std::vector<float> table(size_t(positions) * half * 2);
  for (int t = 0; t < positions; t++)
    for (size_t i = 0; i < half; i++) {
      const double angle = t * freqs[i];
      table[(t * half + i) * 2] = float(std::cos(angle));
      table[(t * half + i) * 2 + 1] = float(std::sin(angle));
    }
  return table;
}

ParamTable llama_param_table(const ModelConfig& cfg, const ModelShard& shard,
                             int64_t total_multiple) {
  const int64_t C = cfg.d_model, V = cfg.vocab_size, Vp = cfg.padded_vocab(), F = cfg.ffn();
  const int64_t kv = int64_t(cfg.kv_heads()) * cfg.head_size();
  const float std_in = float(cfg.init_std);
  // torchtitan: an untied embedding ~ N(0, 1) (RMSNorm follows it); the untied head
  // ~ N(0, C^-1/2); matrices that write into the residual stream (wo, w2) and w3 scaled down
  // with depth, init_std / sqrt(2 (l + 1)). (torchtitan truncates its normals at 3 sigma; these
  // are not truncated.)
  const float std_embed = cfg.tie_embeddings ? std_in : 1.0f;
  const float std_head = float(1.0 / std::sqrt(double(C)));
  ParamTableBuilder b(shard, total_multiple);
  const TpSplit vocab_rows{0, 1, Vp};
  add_token_embedding(b, cfg, shard, "tok_embeddings.weight", std_embed);
  for (int l = shard.first_layer; l < shard.end_layer; l++) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const float std_depth = std_in / std::sqrt(2.0f * float(l + 1));
    b.add(p + "attention_norm.weight", {C}, ParamKind::norm, l, 0);
    b.add(p + "attention.wq.weight", {C, C}, ParamKind::matrix, l, std_in, kRows);
    b.add(p + "attention.wk.weight", {kv, C}, ParamKind::matrix, l, std_in, kRows, true);
    b.add(p + "attention.wv.weight", {kv, C}, ParamKind::matrix, l, std_in, kRows, true);
    b.add(p + "attention.wo.weight", {C, C}, ParamKind::matrix, l, std_depth, kCols);
    b.add(p + "ffn_norm.weight", {C}, ParamKind::norm, l, 0);
    b.add(p + "feed_forward.w1.weight", {F, C}, ParamKind::matrix, l, std_in, kRows);
    b.add(p + "feed_forward.w3.weight", {F, C}, ParamKind::matrix, l, std_depth, kRows, true);
    b.add(p + "feed_forward.w2.weight", {C, F}, ParamKind::matrix, l, std_depth, kCols);
  }
  if (shard.last_stage()) {
    b.add("norm.weight", {C}, ParamKind::norm, -1, 0);
    if (!cfg.tie_embeddings)
      b.add("output.weight", {V, C}, ParamKind::matrix, -1, std_head, vocab_rows);
  }
  return b.finish(total_multiple);
}

std::unique_ptr<ModelDefinition> make_llama(const ModelConfig& cfg, const ModelShard& shard,
                                            int64_t total_multiple) {
  return std::make_unique<Llama>(cfg, shard, total_multiple);
}

}  // namespace trainer
