#include "model/gpt.h"

#include <algorithm>
#include <array>
#include <stdexcept>

#include "model/init.h"

namespace trainer {

static int64_t round16(int64_t elems) {
  return (elems + 15) / 16 * 16;
}  // 64-byte aligned f32

// Views of one block's saved activations (shapes for the planned max_B x max_T; Cl and NHl are
// this rank's slices of C and NH).
struct GPT::LayerActs {
  DPtr ln1, ln1_mean, ln1_rstd;  // (B,T,C), (B,T), (B,T)
  DPtr qkv;                      // (B,T,3Cl)
  DPtr att;   // (B,NHl,T,T) softmax, or (B,NHl,T) log-sum-exp (Kernels::attention_forward)
  DPtr atty;  // (B,T,Cl) attention output before the projection
  DPtr res2;  // (B,T,C) residual after attention
  DPtr ln2, ln2_mean, ln2_rstd;
  DPtr fch, fch_gelu;  // (B,T,4Cl)
  DPtr res3;           // (B,T,C) residual after the MLP: the block's output
};

// One micro-batch's activations outside the blocks.
struct GPT::SlotActs {
  DPtr encoded;  // (B,T,C): the embedding, or the input received from the previous stage
  DPtr lnf, lnf_mean, lnf_rstd, logits, losses;
  DPtr rowmax, sumexp;  // the loss's per-row statistics: (B,T), and 2 x (B,T) for the sums
                        // followed by the target logits
};

GPT::GPT(const GPTConfig& cfg, Kernels& kernels, DType dtype, int max_B, int max_T,
         const GPTOptions& o)
    : cfg_(cfg),
      k_(kernels),
      dtype_(dtype),
      grad_dtype_(o.grad_dtype ? *o.grad_dtype : dtype),
      stats_dtype_(is_half(dtype) ? DType::f32 : dtype),
      keeps_probs_(kernels.attention_keeps_probabilities()),
      shard_(o.shard ? *o.shard : ModelShard::whole(cfg)),
      tp_(o.tp),
      slots_(o.slots),
      table_(gpt2_param_table(cfg, shard_, o.total_multiple)),
      max_B_(max_B),
      max_T_(max_T) {
  if (max_T > cfg.seq_len) throw std::invalid_argument("max_T exceeds seq_len");
  if ((tp_ ? tp_->size() : 1) != shard_.tp_size)
    throw std::invalid_argument("the tp communicator does not match the shard");
  const int tp = shard_.tp_size, Vp = cfg.padded_vocab();
  if (cfg.n_head % tp || Vp % tp) throw std::invalid_argument("tp must divide n_head and Vp");
  C_local_ = cfg.d_model / tp;
  NH_local_ = cfg.n_head / tp;
  const int width = Vp / tp, start = shard_.tp_rank * width;
  vocab_ = {start, std::clamp(cfg.vocab_size - start, 0, width), width};

  wte_ = table_.find("wte.weight");
  wpe_ = table_.find("wpe.weight");
  lnf_w_ = table_.find("ln_f.weight");
  lnf_b_ = table_.find("ln_f.bias");
  auto at = [&](const std::string& name) { return &table_.at(name); };
  for (int l = shard_.first_layer; l < shard_.end_layer; l++) {
    const std::string h = "h." + std::to_string(l) + ".";
    blocks_.push_back({at(h + "ln1.weight"), at(h + "ln1.bias"), at(h + "attn.qkv.weight"),
                       at(h + "attn.qkv.bias"), at(h + "attn.proj.weight"),
                       at(h + "attn.proj.bias"), at(h + "ln2.weight"), at(h + "ln2.bias"),
                       at(h + "mlp.fc.weight"), at(h + "mlp.fc.bias"), at(h + "mlp.proj.weight"),
                       at(h + "mlp.proj.bias")});
  }
  params_ = k_.alloc(table_.total, dtype);
  grads_ = k_.alloc(table_.total, grad_dtype_);
  const Plan p = plan(cfg, shard_, max_B, max_T, slots_, keeps_probs_);
  off_ = p.off;
  stats_off_ = p.stats_off;
  acts_ = k_.alloc(p.acts, dtype);
  stats_ = k_.alloc(p.stats, stats_dtype_);
  have_probs_.assign(slots_, 0);
  tokens_.assign(slots_, std::vector<int32_t>(size_t(max_B) * max_T));
  targets_.assign(slots_, std::vector<int32_t>(size_t(max_B) * max_T));
}

GPT::~GPT() {
  k_.free(params_);
  k_.free(grads_);
  k_.free(acts_);
  k_.free(stats_);
}

std::array<int64_t, 9> GPT::layer_sizes(const GPTConfig& cfg, const ModelShard& shard, int max_B,
                                        int max_T, bool keeps_probs) {
  const int64_t BT = int64_t(max_B) * max_T, C = cfg.d_model, Cl = C / shard.tp_size;
  const int64_t att =
      keeps_probs ? int64_t(max_B) * (cfg.n_head / shard.tp_size) * max_T * max_T : 0;
  return {BT * C, BT * 3 * Cl, att, BT * Cl, BT * C, BT * C, BT * 4 * Cl, BT * 4 * Cl, BT * C};
}

GPT::Plan GPT::plan(const GPTConfig& cfg, const ModelShard& shard, int max_B, int max_T, int slots,
                    bool keeps_probs) {
  const int64_t BT = int64_t(max_B) * max_T, C = cfg.d_model, Cl = C / shard.tp_size;
  const int64_t NHl = cfg.n_head / shard.tp_size, width = cfg.padded_vocab() / shard.tp_size;
  const int64_t att = keeps_probs ? int64_t(max_B) * NHl * max_T * max_T : 0;
  const int64_t blocks = shard.end_layer - shard.first_layer;
  const bool last = shard.last_stage();
  Plan p;
  ActOffsets& off = p.off;
  int64_t cursor = 0;
  auto take = [&](int64_t elems) {
    int64_t at = cursor;
    cursor += round16(elems);
    return at;
  };
  // Per slot: offsets relative to the slot's start.
  off.encoded = take(BT * C);
  off.layer_stride = 0;
  for (int64_t elems : layer_sizes(cfg, shard, max_B, max_T, keeps_probs))
    off.layer_stride += round16(elems);
  off.layers = take(off.layer_stride * blocks);
  off.lnf = take(last ? BT * C : 0);
  off.logits = take(last ? BT * width : 0);
  off.slot_stride = cursor;
  cursor = off.slot_stride * slots;
  // Backward scratch, shared by the slots.
  off.d_res = take(BT * C);
  off.d_ln = take(BT * C);
  off.d_qkv = take(BT * 3 * Cl);
  off.d_att = take(att);
  off.d_atty = take(BT * Cl);
  off.d_fch = take(BT * 4 * Cl);
  p.acts = cursor;
  // Per layer: ln1 and ln2 means and rstds, and the attention's log-sum-exps where kept.
  StatOffsets& st = p.stats_off;
  st.layer_stride = 4 * round16(BT) + (keeps_probs ? 0 : round16(BT * NHl));
  st.lnf = st.layer_stride * blocks;
  st.slot_stride = st.lnf + (last ? 6 * round16(BT) : 0);
  p.stats = st.slot_stride * slots;
  return p;
}

GPT::Memory GPT::memory_needed(const GPTConfig& cfg, DType dtype, int max_B, int max_T,
                               const GPTOptions& o, bool keeps_probs) {
  const ModelShard shard = o.shard ? *o.shard : ModelShard::whole(cfg);
  const int64_t total = gpt2_param_table(cfg, shard, o.total_multiple).total;
  const Plan p = plan(cfg, shard, max_B, max_T, o.slots, keeps_probs);
  const int64_t stats_bytes = dtype_size(is_half(dtype) ? DType::f32 : dtype);
  return {total * int64_t(dtype_size(dtype)),
          total * int64_t(dtype_size(o.grad_dtype ? *o.grad_dtype : dtype)),
          p.acts * int64_t(dtype_size(dtype)), p.stats * stats_bytes};
}

GPT::LayerActs GPT::layer(int slot, int l) const {
  const int local = l - shard_.first_layer;
  int64_t cursor = slot * off_.slot_stride + off_.layers + local * off_.layer_stride;
  std::array<DPtr, 9> views;
  auto sizes = layer_sizes();
  for (size_t i = 0; i < sizes.size(); i++) {
    views[i] = acts_ + cursor;
    cursor += round16(sizes[i]);
  }
  const int64_t row = round16(int64_t(max_B_) * max_T_);
  DPtr st = stats_ + slot * stats_off_.slot_stride + local * stats_off_.layer_stride;
  auto [ln1, qkv, att, atty, res2, ln2, fch, fch_gelu, res3] = views;
  if (!keeps_probs_) att = st + 4 * row;
  return {ln1, st,           st + row,     qkv, att,      atty, res2,
          ln2, st + 2 * row, st + 3 * row, fch, fch_gelu, res3};
}

GPT::SlotActs GPT::slot_acts(int slot) const {
  if (slot < 0 || slot >= slots_) throw std::out_of_range("activation slot out of range");
  DPtr base = acts_ + slot * off_.slot_stride;
  const int64_t row = round16(int64_t(max_B_) * max_T_);
  DPtr st = stats_ + slot * stats_off_.slot_stride + stats_off_.lnf;
  return {base + off_.encoded, base + off_.lnf, st,           st + row,
          base + off_.logits,  st + 2 * row,    st + 3 * row, st + 4 * row};
}

void GPT::init_parameters(uint64_t seed, DPtr into) {
  for (const auto& p : table_.params) {
    std::vector<double> values(p.local_numel());
    const uint64_t stream = hash_name(p.name);
    if (p.kind == ParamKind::norm) {
      std::fill(values.begin(), values.end(), 1.0);
    } else if (p.kind != ParamKind::bias) {
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < int64_t(values.size()); i++)
        values[i] = p.init_std * normal_at(seed, stream, p.logical_index(i));
    }
    write(p, into, values);
  }
}

// Host values in H to and from a buffer of any dtype, through a temporary in H's dtype.
template <class H>
std::vector<H> GPT::read(const ParamInfo& p, DPtr buffer) const {
  const int64_t n = p.local_numel();
  std::vector<H> out(n);
  if (buffer.dtype == dtype_of<H>()) {
    k_.copy_to_host(out.data(), buffer + p.offset, n);
    return out;
  }
  DPtr tmp = k_.alloc(n, dtype_of<H>());
  k_.convert(tmp, buffer + p.offset, n, 0);
  k_.copy_to_host(out.data(), tmp, n);
  k_.free(tmp);
  return out;
}

template <class H>
void GPT::write(const ParamInfo& p, DPtr buffer, const std::vector<H>& values) {
  const int64_t n = p.local_numel();
  if (int64_t(values.size()) != n) throw std::invalid_argument("size mismatch for " + p.name);
  if (buffer.dtype == dtype_of<H>()) {
    k_.copy_from_host(buffer + p.offset, values.data(), n);
    return;
  }
  DPtr tmp = k_.alloc(n, dtype_of<H>());
  k_.copy_from_host(tmp, values.data(), n);
  k_.convert(buffer + p.offset, tmp, n, 0);
  k_.free(tmp);
}

template std::vector<float> GPT::read<float>(const ParamInfo&, DPtr) const;
template std::vector<double> GPT::read<double>(const ParamInfo&, DPtr) const;
template void GPT::write<float>(const ParamInfo&, DPtr, const std::vector<float>&);
template void GPT::write<double>(const ParamInfo&, DPtr, const std::vector<double>&);

DPtr GPT::input(int slot) const {
  return slot_acts(slot).encoded;
}
DPtr GPT::output(int slot) const {
  return layer(slot, shard_.end_layer - 1).res3;
}
DPtr GPT::grad_io() const {
  return acts_ + off_.d_res;
}
DPtr GPT::logits(int slot) const {
  return slot_acts(slot).logits;
}
DPtr GPT::losses(int slot) const {
  return slot_acts(slot).losses;
}

void GPT::zero_grad() {
  k_.zero(grads_, table_.total);
}

void GPT::tp_sum(DPtr buf, int64_t n) {
  if (tp_ && tp_->size() > 1) tp_->all_reduce(buf, n, ReduceOp::sum);
}

// Vocab-parallel softmax + cross-entropy: only the per-row max, exp-sum and target logit cross
// the tensor-parallel group, never the logits.
double GPT::cross_entropy(int slot, int64_t BT) {
  const SlotActs s = slot_acts(slot);
  const int32_t* targets = targets_[slot].data();
  // The target logits right after the BT sums, so that one all-reduce carries both.
  const DPtr target_logit = s.sumexp + BT;
  k_.crossentropy_max(s.rowmax, s.logits, BT, vocab_);
  const bool tp = tp_ && tp_->size() > 1;
  if (tp) tp_->all_reduce(s.rowmax, BT, ReduceOp::max);
  k_.crossentropy_sumexp(s.sumexp, target_logit, s.logits, s.rowmax, targets, BT, vocab_);
  if (tp) tp_->all_reduce(s.sumexp, 2 * BT, ReduceOp::sum);
  return k_.crossentropy_finish(s.losses, s.logits, s.rowmax, s.sumexp, target_logit, BT, vocab_);
}

double GPT::forward(int slot, const int32_t* tokens, const int32_t* targets, int B, int T) {
  if (B > max_B_ || T > max_T_) throw std::invalid_argument("batch larger than planned");
  B_ = B;
  T_ = T;
  const int64_t BT = int64_t(B) * T;
  const int C = cfg_.d_model, Cl = C_local_, NHl = NH_local_;
  const SlotActs s = slot_acts(slot);
  auto P = [&](const ParamInfo* p) { return param(*p); };
  // Row-parallel projections: partial sums are all-reduced; the bias is added once.
  const bool bias_here = shard_.tp_rank == 0;
  auto row_bias = [&](const ParamInfo* p) { return bias_here ? P(p) : DPtr{}; };

  DPtr x = s.encoded;
  if (shard_.first_stage()) {
    std::copy(tokens, tokens + BT, tokens_[slot].begin());
    k_.encoder_forward(x, tokens_[slot].data(), P(wte_), bias_here ? P(wpe_) : DPtr{}, B, T, C,
                       vocab_);
    tp_sum(x, BT * C);
  }
  for (int l = shard_.first_layer; l < shard_.end_layer; l++) {
    const BlockParams& w = blocks_[l - shard_.first_layer];
    LayerActs a = layer(slot, l);
    k_.layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, P(w.ln1_w), P(w.ln1_b), BT, C);
    k_.matmul_forward(a.qkv, a.ln1, P(w.qkv_w), P(w.qkv_b), BT, C, 3 * Cl);
    k_.attention_forward(a.atty, a.att, a.qkv, B, T, Cl, NHl);
    k_.matmul_forward(a.res2, a.atty, P(w.proj_w), row_bias(w.proj_b), BT, Cl, C);
    tp_sum(a.res2, BT * C);
    k_.residual_layernorm_forward(a.res2, a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, x, P(w.ln2_w),
                                  P(w.ln2_b), BT, C);
    k_.matmul_gelu_forward(a.fch, a.fch_gelu, a.ln2, P(w.fc_w), P(w.fc_b), BT, C, 4 * Cl);
    k_.matmul_forward(a.res3, a.fch_gelu, P(w.fcproj_w), row_bias(w.fcproj_b), BT, 4 * Cl, C);
    tp_sum(a.res3, BT * C);
    k_.residual_forward(a.res3, a.res3, a.res2, BT * C);
    x = a.res3;
  }
  have_probs_[slot] = false;
  if (!shard_.last_stage()) return 0.0;
  k_.layernorm_forward(s.lnf, s.lnf_mean, s.lnf_rstd, x, P(lnf_w_), P(lnf_b_), BT, C);
  // LM head tied to the token embedding: logits(BT, width) = lnf @ wte_slice^T.
  k_.matmul_forward(s.logits, s.lnf, P(wte_), DPtr{}, BT, C, vocab_.width);
  if (!targets) return 0.0;
  have_probs_[slot] = true;
  std::copy(targets, targets + BT, targets_[slot].begin());
  return cross_entropy(slot, BT);
}

void GPT::backward(int slot, float loss_scale) {
  const int B = B_, T = T_, C = cfg_.d_model, Cl = C_local_, NHl = NH_local_;
  const int64_t BT = int64_t(B) * T;
  const SlotActs s = slot_acts(slot);
  auto P = [&](const ParamInfo* p) { return param(*p); };
  auto G = [&](const ParamInfo* p) { return grad(*p); };
  DPtr d_res = acts_ + off_.d_res, d_ln = acts_ + off_.d_ln, d_qkv = acts_ + off_.d_qkv;
  DPtr d_att = acts_ + off_.d_att, d_atty = acts_ + off_.d_atty, d_fch = acts_ + off_.d_fch;
  // Reports the gradients finished so far; called between kernels as well (with the same
  // frontier) so that collectives already in flight are driven on while backward runs.
  const int first = shard_.first_layer, end = shard_.end_layer;
  int64_t frontier = table_.total;
  int layers_left = end - first;
  auto ready = [&](const ParamInfo* first_final = nullptr) {
    if (first_final) frontier = first_final->offset;
    if (grads_ready_) grads_ready_(frontier, layers_left);
  };

  DPtr x_last = end > first ? layer(slot, end - 1).res3 : s.encoded;
  if (shard_.last_stage()) {
    if (!have_probs_[slot]) throw std::logic_error("backward() needs a forward() with targets");
    have_probs_[slot] = false;  // the probabilities become gradients
    // The mean over B*T tokens: each token's loss has weight loss_scale / (B*T).
    k_.crossentropy_backward(s.logits, targets_[slot].data(), loss_scale / float(BT), BT, vocab_);
    k_.matmul_backward(d_ln, G(wte_), DPtr{}, s.logits, s.lnf, P(wte_), BT, C, vocab_.width);
    tp_sum(d_ln, BT * C);
    k_.zero(d_res, BT * C);
    k_.layernorm_backward(d_res, G(lnf_w_), G(lnf_b_), d_ln, x_last, P(lnf_w_), s.lnf_mean,
                          s.lnf_rstd, BT, C);
    ready(lnf_w_);
  }  // else d_res holds the output's gradient, received from the next stage
  for (int l = end - 1; l >= first; l--) {
    layers_left = l - first;  // this one has started
    const BlockParams& w = blocks_[l - first];
    LayerActs a = layer(slot, l);
    DPtr x = l == first ? s.encoded : layer(slot, l - 1).res3;
    // res3 = res2 + proj(gelu(fc(ln2(res2)))): d_res is the gradient w.r.t. res3 and res2.
    k_.matmul_backward_gelu(d_fch, G(w.fcproj_w), G(w.fcproj_b), d_res, a.fch_gelu, P(w.fcproj_w),
                            a.fch, BT, 4 * Cl, C);
    ready();
    k_.matmul_backward(d_ln, G(w.fc_w), G(w.fc_b), d_fch, a.ln2, P(w.fc_w), BT, C, 4 * Cl);
    tp_sum(d_ln, BT * C);
    ready();
    k_.layernorm_backward(d_res, G(w.ln2_w), G(w.ln2_b), d_ln, a.res2, P(w.ln2_w), a.ln2_mean,
                          a.ln2_rstd, BT, C);
    // res2 = x + proj(attention(qkv(ln1(x)))).
    k_.matmul_backward(d_atty, G(w.proj_w), G(w.proj_b), d_res, a.atty, P(w.proj_w), BT, Cl, C);
    ready();
    k_.attention_backward(d_qkv, d_att, d_atty, a.qkv, a.atty, a.att, B, T, Cl, NHl);
    ready();
    k_.matmul_backward(d_ln, G(w.qkv_w), G(w.qkv_b), d_qkv, a.ln1, P(w.qkv_w), BT, C, 3 * Cl);
    tp_sum(d_ln, BT * C);
    k_.layernorm_backward(d_res, G(w.ln1_w), G(w.ln1_b), d_ln, x, P(w.ln1_w), a.ln1_mean,
                          a.ln1_rstd, BT, C);
    ready(w.ln1_w);
  }
  if (shard_.first_stage())
    k_.encoder_backward(G(wte_), G(wpe_), d_res, tokens_[slot].data(), B, T, C, vocab_);
}

}  // namespace trainer
