#pragma once
// GPT-2, written once against the kernel interface. Parameters and gradients live in two flat
// buffers described by the parameter table; activations are planned once for the largest
// (B, T) the model will see, so a steady-state step allocates nothing.
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "model/gpt_config.h"
#include "model/param_table.h"

namespace trainer {

class GPT {
 public:
  // max_B x max_T is the largest batch forward() will be given; max_T <= cfg.seq_len.
  GPT(const GPTConfig& cfg, Kernels& kernels, DType dtype, int max_B, int max_T);
  ~GPT();
  GPT(const GPT&) = delete;
  GPT& operator=(const GPT&) = delete;

  const GPTConfig& config() const { return cfg_; }
  const ParamTable& table() const { return table_; }
  DType dtype() const { return dtype_; }
  Kernels& kernels() { return k_; }

  DPtr params() const { return params_; }  // flat (table().total)
  DPtr grads() const { return grads_; }    // flat, same offsets
  DPtr param(const ParamInfo& p) const { return params_ + p.offset; }
  DPtr grad(const ParamInfo& p) const { return grads_ + p.offset; }

  // Initialisation is a pure function of (seed, parameter name, logical index): it does not
  // depend on how the model is split later, nor on the dtype.
  void init_parameters(uint64_t seed);

  // A parameter's logical elements (padding excluded) to and from host fp32 or fp64.
  template <class H>
  std::vector<H> read(const ParamInfo& p, DPtr buffer) const;
  template <class H>
  void write(const ParamInfo& p, DPtr buffer, const std::vector<H>& values);

  // tokens, targets: (B, T) host arrays. With targets, returns the mean loss and keeps the
  // probabilities for backward(); without, returns 0 and leaves the logits in logits().
  double forward(const int32_t* tokens, const int32_t* targets, int B, int T);
  // Accumulates d(loss_scale * mean loss)/dparams into grads(). Needs a forward with targets.
  void backward(float loss_scale = 1.0f);
  void zero_grad();
  DPtr logits() const;  // (B, T, Vp) of the last forward without targets
  DPtr losses() const;  // (B, T) per-token losses of the last forward with targets

 private:
  struct LayerActs;
  LayerActs layer(int l) const;
  // One block's parameters, looked up by name once so that a step builds no strings.
  struct BlockParams {
    const ParamInfo *ln1_w, *ln1_b, *qkv_w, *qkv_b, *proj_w, *proj_b;
    const ParamInfo *ln2_w, *ln2_b, *fc_w, *fc_b, *fcproj_w, *fcproj_b;
  };
  std::array<int64_t, 13> layer_sizes() const;

  GPTConfig cfg_;
  Kernels& k_;
  DType dtype_;
  ParamTable table_;
  std::vector<BlockParams> blocks_;
  const ParamInfo *wte_, *wpe_, *lnf_w_, *lnf_b_;
  int max_B_, max_T_;
  int B_ = 0, T_ = 0;        // shape of the last forward
  bool have_probs_ = false;  // last forward computed probabilities for backward
  std::vector<int32_t> tokens_, targets_;

  DPtr params_, grads_;
  DPtr acts_;  // one slab for all activations and backward scratch
  int64_t acts_elems_ = 0;
  // Offsets into acts_ (elements), per kind; per-layer kinds are strided by their size.
  struct {
    int64_t encoded, layers, layer_stride, lnf, lnf_mean, lnf_rstd, logits, losses;
    int64_t d_res, d_ln, d_qkv, d_att, d_atty, d_fch;
  } off_{};
};

}  // namespace trainer
