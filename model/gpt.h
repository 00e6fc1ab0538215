#pragma once
// GPT-2, written once against the kernel interface. Parameters and gradients live in two flat
// buffers described by the parameter table; activations are planned once for the largest
// (B, T) the model will see, so a steady-state step allocates nothing.
//
// A GPT object is one shard of the model (see ModelShard): the blocks of one pipeline stage
// and one tensor-parallel rank's slice of them. Tensor parallelism communicates inside
// forward() and backward() through the tp communicator (Megatron's f and g: an all-reduce after
// each row-parallel projection in forward, after each column-parallel one in backward, and of
// the per-row softmax statistics of the vocab-parallel loss). Pipeline parallelism is left to
// the caller: a stage reads its input from input(slot) and leaves its output in output(slot);
// backward reads the output's gradient from grad_io() and leaves the input's gradient there.
// Each of `slots` micro-batches in flight has its own activations.
#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "kernels/kernels.h"
#include "model/gpt_config.h"
#include "model/param_table.h"

namespace trainer {

struct GPTOptions {
  std::optional<ModelShard> shard;  // default: the whole model
  Communicator* tp = nullptr;       // the tensor-parallel group (null: tp_size 1)
  int slots = 1;                    // micro-batches whose activations are kept at once
  int64_t total_multiple = 16;
  // Gradients' storage; default: the model's dtype. (Mixed precision: bf16/fp16 weights and
  // activations with fp32 gradients, say.)
  std::optional<DType> grad_dtype;
};

class GPT {
 public:
  // What a shard allocates, in bytes, known before anything is: parameters, gradients,
  // activations with the backward scratch, and per-row statistics. keeps_probs: the backend's
  // Kernels::attention_keeps_probabilities().
  struct Memory {
    int64_t params = 0, grads = 0, activations = 0, stats = 0;
    int64_t total() const { return params + grads + activations + stats; }
  };
  static Memory memory_needed(const GPTConfig& cfg, DType dtype, int max_B, int max_T,
                              const GPTOptions& options, bool keeps_probs);

  // max_B x max_T is the largest batch forward() will be given; max_T <= cfg.seq_len.
  GPT(const GPTConfig& cfg, Kernels& kernels, DType dtype, int max_B, int max_T,
      const GPTOptions& options = {});
  ~GPT();
  GPT(const GPT&) = delete;
  GPT& operator=(const GPT&) = delete;

  const GPTConfig& config() const { return cfg_; }
  const ModelShard& shard() const { return shard_; }
  const ParamTable& table() const { return table_; }
  DType dtype() const { return dtype_; }
  Kernels& kernels() const { return k_; }
  VocabSlice vocab() const { return vocab_; }  // the vocabulary rows this rank holds

  DPtr params() const { return params_; }  // flat (table().total)
  DPtr grads() const { return grads_; }    // flat, same offsets
  DPtr param(const ParamInfo& p) const { return params_ + p.offset; }
  DPtr grad(const ParamInfo& p) const { return grads_ + p.offset; }

  // Initialisation is a pure function of (seed, parameter name, logical index): it does not
  // depend on how the model is split, nor on the dtype.
  void init_parameters(uint64_t seed) { init_parameters(seed, params_); }
  // The same values into another buffer laid out like params() (fp32 master weights, say).
  void init_parameters(uint64_t seed, DPtr into);

  // This rank's real elements of a parameter (padding excluded, ParamInfo::local_shape) to and
  // from host fp32 or fp64.
  template <class H>
  std::vector<H> read(const ParamInfo& p, DPtr buffer) const;
  template <class H>
  void write(const ParamInfo& p, DPtr buffer, const std::vector<H>& values);

  // The whole model (one stage, slot 0): tokens, targets are (B, T) host arrays. With targets,
  // returns the mean loss and keeps the probabilities for backward(); without, returns 0 and
  // leaves the logits in logits().
  double forward(const int32_t* tokens, const int32_t* targets, int B, int T) {
    return forward(0, tokens, targets, B, T);
  }
  // One stage on micro-batch `slot`: the first stage embeds `tokens`, the others start from
  // input(slot); the last stage computes the loss when targets are given (else the logits),
  // the others leave their output in output(slot). Returns the mean loss (last stage).
  double forward(int slot, const int32_t* tokens, const int32_t* targets, int B, int T);
  // Accumulates d(loss_scale * mean loss)/dparams into grads(). The last stage starts from its
  // loss; the others from the output gradient in grad_io(). Afterwards grad_io() holds the
  // input's gradient (on all but the first stage).
  void backward(int slot, float loss_scale);
  void backward(float loss_scale = 1.0f) { backward(0, loss_scale); }
  void zero_grad();

  DPtr input(int slot) const;       // (B, T, C): where a later stage receives its input
  DPtr output(int slot) const;      // (B, T, C): what a stage sends on
  DPtr grad_io() const;             // (B, T, C): gradient received from the next / sent back
  DPtr logits(int slot = 0) const;  // (B, T, vocab().width)
  DPtr losses(int slot = 0) const;  // (B, T) per-token losses of the last forward with targets

  // Called during backward with an offset into the flat gradient buffer, every gradient at or
  // above which is final for this backward, and the number of this stage's layers whose
  // backward has not started yet (the data-parallel reducer starts buckets while backward goes
  // on, and records how early).
  using GradsReadyHook = std::function<void(int64_t frontier, int layers_left)>;
  void set_grads_ready_hook(GradsReadyHook hook) { grads_ready_ = std::move(hook); }

 private:
  struct LayerActs;
  struct SlotActs;
  LayerActs layer(int slot, int l) const;  // l: global block index
  SlotActs slot_acts(int slot) const;
  // One block's parameters, looked up by name once so that a step builds no strings.
  struct BlockParams {
    const ParamInfo *ln1_w, *ln1_b, *qkv_w, *qkv_b, *proj_w, *proj_b;
    const ParamInfo *ln2_w, *ln2_b, *fc_w, *fc_b, *fcproj_w, *fcproj_b;
  };
  // Offsets into acts_ (elements). Per-slot kinds are strided by slot_stride, per-layer kinds
  // by layer_stride inside a slot.
  struct ActOffsets {
    int64_t slot_stride, encoded, layers, layer_stride, lnf, logits;
    int64_t d_res, d_ln, d_qkv, d_att, d_atty, d_fch;
  };
  // Offsets into stats_: per slot, the blocks' (ln1 mean, rstd, ln2 mean, rstd), then ln_f's
  // mean and rstd, the losses and the three softmax statistics, each (B, T).
  struct StatOffsets {
    int64_t slot_stride, layer_stride, lnf;
  };
  // Where every activation and statistic of a shard goes, and the slabs' sizes (elements):
  // planned from the shapes alone, by the constructor and by memory_needed().
  struct Plan {
    ActOffsets off{};
    StatOffsets stats_off{};
    int64_t acts = 0, stats = 0;
  };
  static Plan plan(const GPTConfig& cfg, const ModelShard& shard, int max_B, int max_T, int slots,
                   bool keeps_probs);
  // Sizes of LayerActs' activation fields (the statistics aside), in declaration order.
  static std::array<int64_t, 9> layer_sizes(const GPTConfig& cfg, const ModelShard& shard,
                                            int max_B, int max_T, bool keeps_probs);
  std::array<int64_t, 9> layer_sizes() const {
    return layer_sizes(cfg_, shard_, max_B_, max_T_, keeps_probs_);
  }
  void tp_sum(DPtr buf, int64_t n);
  double cross_entropy(int slot, int64_t BT);

  GPTConfig cfg_;
  Kernels& k_;
  DType dtype_, grad_dtype_;
  // Per-row statistics (norm means and inverse deviations, losses, the softmax's max and sum)
  // stay in fp32 when the activations are 16-bit, as on GPUs.
  DType stats_dtype_;
  bool keeps_probs_;  // the backend's attention keeps probabilities (else log-sum-exps)
  ModelShard shard_;
  Communicator* tp_;
  int slots_;
  ParamTable table_;
  VocabSlice vocab_;
  int C_local_, NH_local_;           // tensor-parallel slices of d_model and the heads
  std::vector<BlockParams> blocks_;  // this stage's, by local index
  const ParamInfo *wte_ = nullptr, *wpe_ = nullptr, *lnf_w_ = nullptr, *lnf_b_ = nullptr;
  int max_B_, max_T_;
  int B_ = 0, T_ = 0;             // shape of the last forward
  std::vector<char> have_probs_;  // per slot: forward computed probabilities for backward
  std::vector<std::vector<int32_t>> tokens_, targets_;  // per slot
  GradsReadyHook grads_ready_;

  DPtr params_, grads_;
  DPtr acts_;   // one slab for all activations and backward scratch
  DPtr stats_;  // one slab for the per-row statistics
  ActOffsets off_{};
  StatOffsets stats_off_{};
};

}  // namespace trainer
