#include "model/gpt.h"

#include <algorithm>
#include <array>
#include <stdexcept>

#include "model/init.h"

namespace trainer {

static int64_t round16(int64_t elems) {
  return (elems + 15) / 16 * 16;
}  // 64-byte aligned f32

// Views of one block's saved activations (shapes for the planned max_B x max_T).
struct GPT::LayerActs {
  DPtr ln1, ln1_mean, ln1_rstd;  // (B,T,C), (B,T), (B,T)
  DPtr qkv;                      // (B,T,3C)
  DPtr att;                      // (B,NH,T,T) softmax
  DPtr atty;                     // (B,T,C) attention output before the projection
  DPtr res2;                     // (B,T,C) residual after attention
  DPtr ln2, ln2_mean, ln2_rstd;
  DPtr fch, fch_gelu;  // (B,T,4C)
  DPtr res3;           // (B,T,C) residual after the MLP: the block's output
};

GPT::GPT(const GPTConfig& cfg, Kernels& kernels, DType dtype, int max_B, int max_T)
    : cfg_(cfg),
      k_(kernels),
      dtype_(dtype),
      table_(gpt2_param_table(cfg)),
      max_B_(max_B),
      max_T_(max_T) {
  if (max_T > cfg.seq_len) throw std::invalid_argument("max_T exceeds seq_len");
  auto at = [&](const std::string& name) { return &table_.at(name); };
  wte_ = at("wte.weight");
  wpe_ = at("wpe.weight");
  lnf_w_ = at("ln_f.weight");
  lnf_b_ = at("ln_f.bias");
  for (int l = 0; l < cfg.n_layer; l++) {
    const std::string h = "h." + std::to_string(l) + ".";
    blocks_.push_back({at(h + "ln1.weight"), at(h + "ln1.bias"), at(h + "attn.qkv.weight"),
                       at(h + "attn.qkv.bias"), at(h + "attn.proj.weight"),
                       at(h + "attn.proj.bias"), at(h + "ln2.weight"), at(h + "ln2.bias"),
                       at(h + "mlp.fc.weight"), at(h + "mlp.fc.bias"), at(h + "mlp.proj.weight"),
                       at(h + "mlp.proj.bias")});
  }
  params_ = k_.alloc(table_.total, dtype);
  grads_ = k_.alloc(table_.total, dtype);

  const int64_t BT = int64_t(max_B) * max_T, C = cfg.d_model, NH = cfg.n_head;
  const int64_t att = int64_t(max_B) * NH * max_T * max_T;
  int64_t cursor = 0;
  auto take = [&](int64_t elems) {
    int64_t at = cursor;
    cursor += round16(elems);
    return at;
  };
  off_.encoded = take(BT * C);
  off_.layer_stride = 0;
  for (int64_t elems : layer_sizes()) off_.layer_stride += round16(elems);
  off_.layers = take(off_.layer_stride * cfg.n_layer);
  off_.lnf = take(BT * C);
  off_.lnf_mean = take(BT);
  off_.lnf_rstd = take(BT);
  off_.logits = take(BT * cfg.padded_vocab());
  off_.losses = take(BT);
  off_.d_res = take(BT * C);
  off_.d_ln = take(BT * C);
  off_.d_qkv = take(BT * 3 * C);
  off_.d_att = take(att);
  off_.d_atty = take(BT * C);
  off_.d_fch = take(BT * 4 * C);
  acts_elems_ = cursor;
  acts_ = k_.alloc(acts_elems_, dtype);
  tokens_.resize(BT);
  targets_.resize(BT);
}

GPT::~GPT() {
  k_.free(params_);
  k_.free(grads_);
  k_.free(acts_);
}

// Sizes of LayerActs' fields, in declaration order.
std::array<int64_t, 13> GPT::layer_sizes() const {
  const int64_t BT = int64_t(max_B_) * max_T_, C = cfg_.d_model;
  const int64_t att = int64_t(max_B_) * cfg_.n_head * max_T_ * max_T_;
  return {BT * C, BT, BT, BT * 3 * C, att,        BT * C, BT * C,
          BT * C, BT, BT, BT * 4 * C, BT * 4 * C, BT * C};
}

GPT::LayerActs GPT::layer(int l) const {
  int64_t cursor = off_.layers + l * off_.layer_stride;
  std::array<DPtr, 13> views;
  auto sizes = layer_sizes();
  for (size_t i = 0; i < sizes.size(); i++) {
    views[i] = acts_ + cursor;
    cursor += round16(sizes[i]);
  }
  auto [ln1, ln1_mean, ln1_rstd, qkv, att, atty, res2, ln2, ln2_mean, ln2_rstd, fch, fch_gelu,
        res3] = views;
  return {ln1, ln1_mean, ln1_rstd, qkv, att,      atty, res2,
          ln2, ln2_mean, ln2_rstd, fch, fch_gelu, res3};
}

void GPT::init_parameters(uint64_t seed) {
  for (const auto& p : table_.params) {
    std::vector<double> values(p.logical_numel());
    const uint64_t stream = hash_name(p.name);
    if (p.kind == ParamKind::norm) {
      std::fill(values.begin(), values.end(), 1.0);
    } else if (p.kind != ParamKind::bias) {
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < int64_t(values.size()); i++)
        values[i] = p.init_std * normal_at(seed, stream, i);
    }
    write(p, params_, values);
  }
}

template <class H>
std::vector<H> GPT::read(const ParamInfo& p, DPtr buffer) const {
  const int64_t n = p.logical_numel();
  std::vector<H> out(n);
  if (buffer.dtype == dtype_of<H>()) {
    k_.copy_to_host(out.data(), buffer + p.offset, n);
  } else if (buffer.dtype == DType::f32) {
    std::vector<float> tmp(n);
    k_.copy_to_host(tmp.data(), buffer + p.offset, n);
    std::copy(tmp.begin(), tmp.end(), out.begin());
  } else {
    std::vector<double> tmp(n);
    k_.copy_to_host(tmp.data(), buffer + p.offset, n);
    std::copy(tmp.begin(), tmp.end(), out.begin());
  }
  return out;
}

template <class H>
void GPT::write(const ParamInfo& p, DPtr buffer, const std::vector<H>& values) {
  const int64_t n = p.logical_numel();
  if (int64_t(values.size()) != n) throw std::invalid_argument("size mismatch for " + p.name);
  if (buffer.dtype == dtype_of<H>()) {
    k_.copy_from_host(buffer + p.offset, values.data(), n);
  } else if (buffer.dtype == DType::f32) {
    std::vector<float> tmp(values.begin(), values.end());
    k_.copy_from_host(buffer + p.offset, tmp.data(), n);
  } else {
    std::vector<double> tmp(values.begin(), values.end());
    k_.copy_from_host(buffer + p.offset, tmp.data(), n);
  }
}

template std::vector<float> GPT::read<float>(const ParamInfo&, DPtr) const;
template std::vector<double> GPT::read<double>(const ParamInfo&, DPtr) const;
template void GPT::write<float>(const ParamInfo&, DPtr, const std::vector<float>&);
template void GPT::write<double>(const ParamInfo&, DPtr, const std::vector<double>&);

DPtr GPT::logits() const {
  return acts_ + off_.logits;
}
DPtr GPT::losses() const {
  return acts_ + off_.losses;
}

void GPT::zero_grad() {
  k_.zero(grads_, table_.total);
}

double GPT::forward(const int32_t* tokens, const int32_t* targets, int B, int T) {
  if (B > max_B_ || T > max_T_) throw std::invalid_argument("batch larger than planned");
  B_ = B;
  T_ = T;
  const int64_t BT = int64_t(B) * T;
  const int C = cfg_.d_model, NH = cfg_.n_head, V = cfg_.vocab_size, Vp = cfg_.padded_vocab();
  std::copy(tokens, tokens + BT, tokens_.begin());
  auto P = [&](const ParamInfo* p) { return param(*p); };

  DPtr x = acts_ + off_.encoded;
  k_.encoder_forward(x, tokens_.data(), P(wte_), P(wpe_), B, T, C);
  for (int l = 0; l < cfg_.n_layer; l++) {
    const BlockParams& w = blocks_[l];
    LayerActs a = layer(l);
    k_.layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, P(w.ln1_w), P(w.ln1_b), BT, C);
    k_.matmul_forward(a.qkv, a.ln1, P(w.qkv_w), P(w.qkv_b), BT, C, 3 * C);
    k_.attention_forward(a.atty, a.att, a.qkv, B, T, C, NH);
    k_.matmul_forward(a.res2, a.atty, P(w.proj_w), P(w.proj_b), BT, C, C);
    k_.residual_forward(a.res2, a.res2, x, BT * C);
    k_.layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, P(w.ln2_w), P(w.ln2_b), BT, C);
    k_.matmul_forward(a.fch, a.ln2, P(w.fc_w), P(w.fc_b), BT, C, 4 * C);
    k_.gelu_forward(a.fch_gelu, a.fch, BT * 4 * C);
    k_.matmul_forward(a.res3, a.fch_gelu, P(w.fcproj_w), P(w.fcproj_b), BT, 4 * C, C);
    k_.residual_forward(a.res3, a.res3, a.res2, BT * C);
    x = a.res3;
  }
  DPtr lnf = acts_ + off_.lnf;
  k_.layernorm_forward(lnf, acts_ + off_.lnf_mean, acts_ + off_.lnf_rstd, x, P(lnf_w_), P(lnf_b_),
                       BT, C);
  // LM head tied to the token embedding: logits(BT, Vp) = lnf @ wte^T.
  k_.matmul_forward(logits(), lnf, P(wte_), DPtr{}, BT, C, Vp);
  have_probs_ = targets != nullptr;
  if (!targets) return 0.0;
  std::copy(targets, targets + BT, targets_.begin());
  return k_.softmax_crossentropy_forward(losses(), logits(), targets_.data(), BT, V, Vp);
}

void GPT::backward(float loss_scale) {
  if (!have_probs_) throw std::logic_error("backward() needs a forward() with targets");
  const int B = B_, T = T_, C = cfg_.d_model, NH = cfg_.n_head, Vp = cfg_.padded_vocab();
  const int64_t BT = int64_t(B) * T;
  auto P = [&](const ParamInfo* p) { return param(*p); };
  auto G = [&](const ParamInfo* p) { return grad(*p); };
  DPtr d_res = acts_ + off_.d_res, d_ln = acts_ + off_.d_ln, d_qkv = acts_ + off_.d_qkv;
  DPtr d_att = acts_ + off_.d_att, d_atty = acts_ + off_.d_atty, d_fch = acts_ + off_.d_fch;

  // The mean over B*T tokens: each token's loss has weight loss_scale / (B*T).
  DPtr dlogits = logits();
  k_.softmax_crossentropy_backward(dlogits, targets_.data(), loss_scale / float(BT), BT,
                                   cfg_.vocab_size, Vp);
  have_probs_ = false;  // the probabilities are now gradients
  DPtr lnf = acts_ + off_.lnf;
  k_.matmul_backward(d_ln, G(wte_), DPtr{}, dlogits, lnf, P(wte_), BT, C, Vp);
  const int L = cfg_.n_layer;
  DPtr x_last = L > 0 ? layer(L - 1).res3 : acts_ + off_.encoded;
  k_.zero(d_res, BT * C);
  k_.layernorm_backward(d_res, G(lnf_w_), G(lnf_b_), d_ln, x_last, P(lnf_w_), acts_ + off_.lnf_mean,
                        acts_ + off_.lnf_rstd, BT, C);
  for (int l = L - 1; l >= 0; l--) {
    const BlockParams& w = blocks_[l];
    LayerActs a = layer(l);
    DPtr x = l == 0 ? acts_ + off_.encoded : layer(l - 1).res3;
    // res3 = res2 + proj(gelu(fc(ln2(res2)))): d_res is the gradient w.r.t. res3 and res2.
    k_.matmul_backward(d_fch, G(w.fcproj_w), G(w.fcproj_b), d_res, a.fch_gelu, P(w.fcproj_w), BT,
                       4 * C, C);
    k_.gelu_backward(d_fch, a.fch, d_fch, BT * 4 * C);
    k_.matmul_backward(d_ln, G(w.fc_w), G(w.fc_b), d_fch, a.ln2, P(w.fc_w), BT, C, 4 * C);
    k_.layernorm_backward(d_res, G(w.ln2_w), G(w.ln2_b), d_ln, a.res2, P(w.ln2_w), a.ln2_mean,
                          a.ln2_rstd, BT, C);
    // res2 = x + proj(attention(qkv(ln1(x)))).
    k_.matmul_backward(d_atty, G(w.proj_w), G(w.proj_b), d_res, a.atty, P(w.proj_w), BT, C, C);
    k_.attention_backward(d_qkv, d_att, d_atty, a.qkv, a.att, B, T, C, NH);
    k_.matmul_backward(d_ln, G(w.qkv_w), G(w.qkv_b), d_qkv, a.ln1, P(w.qkv_w), BT, C, 3 * C);
    k_.layernorm_backward(d_res, G(w.ln1_w), G(w.ln1_b), d_ln, x, P(w.ln1_w), a.ln1_mean,
                          a.ln1_rstd, BT, C);
  }
  k_.encoder_backward(G(wte_), G(wpe_), d_res, tokens_.data(), B, T, C);
}

}  // namespace trainer
