#pragma once
// A model definition: one architecture (GPT-2, Llama) on one shard. It describes its parameters
// (logical names, full shapes, the tensor-parallel split of each: the parameter table) and
// supplies the forward and backward of its embedding, its blocks and its head over the kernel
// interface, and nothing else: the stage executor (model/stage_executor.h) owns the layer loop,
// the activation memory of every micro-batch in flight, the loss and the hooks around each layer.
// Tensor-parallel communication goes through the conjugate pairs of model/tensor_parallel.h.
//
// Shapes below: B sequences of T tokens, C = d_model; a layer's input and output are the
// residual stream, (B, T, C) and replicated over the tensor-parallel group, or with sequence
// parallelism this rank's rows() of it.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "model/context_parallel.h"
#include "model/model_config.h"
#include "model/param_table.h"
#include "model/tensor_parallel.h"

namespace trainer {

// One activation a definition keeps (or scratch it uses), in elements. Per-row statistics (norm
// statistics, attention's log-sum-exps) are kept in fp32 when activations are 16-bit.
struct ActSpec {
  int64_t elems = 0;
  bool stats = false;
  // Cheap to remake from the block's other activations (the MLP's activation: GELU's or
  // SwiGLU's output): under selective recomputation it is not kept, and layer_recompute() remakes
  // it before the block's backward (Megatron's selective recomputation).
  bool selective = false;
  // Holds the keys and values of every position in inference (the key/value cache): kept per
  // block for infer() whatever the recomputation.
  bool kv_cache = false;
};

// Where the parameters or gradients of a range of flat offsets live: `at` holds [begin, end).
struct FlatSpan {
  DPtr at;
  int64_t begin = 0, end = 0;
  bool holds(int64_t offset) const { return offset >= begin && offset < end; }
  // The element at `offset` of whichever of `a` and `b` holds it (`what` names it otherwise).
  static DPtr find(const FlatSpan& a, const FlatSpan& b, int64_t offset, const char* what) {
    const FlatSpan& s = b.holds(offset) ? b : a;
    if (!s.holds(offset)) throw std::logic_error(what);
    return s.at + (offset - s.begin);
  }
};

// What one call of a definition sees.
struct LayerCall {
  Kernels& k;
  const TensorParallel& tp;
  // Where the parameters are (parameter table offsets): the shard's flat buffer, or under
  // ZeRO-3 the window the unit being run was gathered into (model/grad_units.h) and the
  // parameters held for the whole step.
  FlatSpan params, held_params;
  DPtr param(int64_t offset) const {
    return FlatSpan::find(params, held_params, offset, "a parameter read outside its unit");
  }
  // Where parameter gradients accumulate: the flat gradient buffer, or under ZeRO-2 and -3 the
  // window of the unit being run and the gradients held for the whole step.
  FlatSpan grads, held;
  DPtr grad(int64_t offset) const {
    return FlatSpan::find(grads, held, offset, "a gradient written outside its unit's window");
  }
  int B = 0, T = 0;
  // Sequence parallelism in this call (model/tensor_parallel.h; forwards with or without
  // targets and backwards, never inference): the residual stream between the tensor-parallel
  // regions holds this rank's rows() of the B x T, from row0(); and a buffer (in the gradients'
  // dtype) for a norm's parameter gradients from them, before they are summed over the group.
  bool sp = false;
  DPtr norm_grad_scratch = {};
  int64_t rows() const { return int64_t(B) * T / (sp ? tp.size() : 1); }
  int64_t row0() const { return sp ? rows() * tp.rank() : 0; }
  // Context parallelism in this call (training forwards and their backwards; null otherwise):
  // the T tokens of each sequence are this rank's two chunks of the whole (cp->chunks(T)).
  const ContextParallel* cp = nullptr;
  bool split() const { return cp && cp->splits(); }
  // Inference with a key/value cache (one sequence): the T tokens are at positions
  // [pos0, pos0 + T), and every earlier position's keys and values are in the layers' attention
  // activations from earlier calls. Nothing is kept for a backward.
  bool inference = false;
  int pos0 = 0;
  // Dropout of this micro-batch (training forwards and their backwards only; 0 otherwise): the
  // probability, and the key its masks are a function of (with each site's number).
  float dropout = 0;
  uint64_t dropout_key = 0;
  const DPtr* acts = nullptr;     // the layer's (or the head's) activations, in declared order
  const DPtr* scratch = nullptr;  // backward scratch shared by all layers, in declared order
  // Blocks call it between kernels, so that collectives already in flight (the data-parallel
  // reducer's buckets in backward, ZeRO-3's next unit's parameters) make progress meanwhile.
  const std::function<void()>* progress = nullptr;
  void tick() const {
    if (progress && *progress) (*progress)();
  }
};

class ModelDefinition {
 public:
  ModelDefinition(const ModelConfig& cfg, const ModelShard& shard, ParamTable table);
  virtual ~ModelDefinition() = default;
  ModelDefinition(const ModelDefinition&) = delete;
  ModelDefinition& operator=(const ModelDefinition&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const ModelShard& shard() const { return shard_; }
  const ParamTable& table() const { return table_; }
  VocabSlice vocab() const { return vocab_; }  // the vocabulary rows this rank holds
  // The rows of the residual stream a buffer holds for a (B, T) batch: all B T, or with sequence
  // parallelism this rank's share. (Inference, which does not split rows, runs a long prompt in
  // chunks of at most that many tokens.)
  int64_t stream_rows(int64_t B, int64_t T) const {
    return shard_.sequence_parallel ? B * T / shard_.tp_size : B * T;
  }

  // --- the plan, from shapes alone ------------------------------------------------------------
  // What one block keeps from its forward for its backward (its output aside: the executor's).
  virtual std::vector<ActSpec> layer_activations(int64_t B, int64_t T) const = 0;
  // The same for the head (the final norm's output and statistics; the logits are the
  // executor's).
  virtual std::vector<ActSpec> head_activations(int64_t B, int64_t T) const = 0;
  // Backward's working memory, shared by the layers and the head (the residual stream's
  // gradient aside: the executor's).
  virtual std::vector<ActSpec> backward_scratch(int64_t B, int64_t T) const = 0;

  // Constant tables (RoPE's angles), made once per backend and freed with it.
  virtual void prepare(Kernels&, int /*max_T*/) {}
  virtual void release(Kernels&) {}

  // --- compute ---------------------------------------------------------------------------------
  // x = the embedding of tokens (B, T) (first stage).
  virtual void embed_forward(const LayerCall& c, DPtr x, const int32_t* tokens) const = 0;
  // Accumulates the embedding's gradients from dx.
  virtual void embed_backward(const LayerCall& c, DPtr dx, const int32_t* tokens) const = 0;
  // out = block l (its global index) applied to x.
  virtual void layer_forward(const LayerCall& c, int l, DPtr x, DPtr out) const = 0;
  // Remakes block l's `selective` activations from its kept ones, with the kernels
  // layer_forward() made them with (a fused forward, such as a GEMM with a GELU epilogue, is
  // remade unfused), so that they are the forward's: bitwise on the CPU.
  virtual void layer_recompute(const LayerCall& c, int l) const = 0;
  // d holds the gradient of the block's output and is replaced by that of its input x;
  // parameter gradients accumulate.
  virtual void layer_backward(const LayerCall& c, int l, DPtr x, DPtr d) const = 0;
  // logits (B, T, vocab().width) from the last block's output x: the final norm and the LM head
  // (last stage).
  virtual void head_forward(const LayerCall& c, DPtr x, DPtr logits) const = 0;
  // dx = the gradient of x, from dlogits; parameter gradients accumulate.
  virtual void head_backward(const LayerCall& c, DPtr x, DPtr dlogits, DPtr dx) const = 0;

 protected:
  DPtr P(const LayerCall& c, const ParamInfo* p) const { return p ? c.param(p->offset) : DPtr{}; }
  DPtr G(const LayerCall& c, const ParamInfo* p) const { return p ? c.grad(p->offset) : DPtr{}; }
  // Causal self-attention of a block, for training or (c.inference) over the key/value cache
  // that `qkv`, the layer's full-length activation, holds: the new tokens' q, k and v are
  // expected at rows [pos0, pos0 + T) then.
  // With context parallelism, ring attention over the group (model/context_parallel.h), `ring`
  // being the six buffers of ring_scratch() in the definition's backward scratch.
  static void attention(const LayerCall& c, DPtr out, DPtr lse, DPtr qkv, int C, int NH, int NKV,
                        const DPtr* ring);
  // dqkv = the gradient of qkv, from out's gradient dout.
  static void attention_backward(const LayerCall& c, DPtr dqkv, DPtr dout, DPtr qkv, DPtr out,
                                 DPtr lse, int C, int NH, int NKV, const DPtr* ring);
  // What attention keeps for its backward besides its output (`lse` above): each row's
  // log-sum-exp (B, NH, T), in the statistics' dtype.
  static ActSpec attention_keeps(int64_t B, int NH, int64_t T);
  // The rows of the qkv activation, which is also inference's key/value cache: B T, and with
  // context parallelism at least a whole sequence (inference does not split it).
  int64_t qkv_rows(int64_t B, int64_t T) const {
    return std::max(B * T, int64_t(shard_.cp_size) * T);
  }
  // Ring attention's buffers (none without context parallelism): the keys and values received,
  // two as qkv rows of `width`; and in the statistics' dtype (fp32 with 16-bit activations, so
  // that the parts are summed unrounded) their gradients, two likewise, the output being
  // combined (B T, C) and the query gradients being summed (B T, width).
  std::vector<ActSpec> ring_scratch(int64_t B, int64_t T, int64_t width, int64_t C) const;
  // Token embeddings (and GPT-2's position embedding wpe, else null) of the B x T tokens into
  // out, and their backward: at each token's position (LayerCall::position()).
  static void embed_tokens(const LayerCall& c, DPtr out, const int32_t* tokens, DPtr wte, DPtr wpe,
                           int C, VocabSlice vocab);
  static void embed_tokens_backward(const LayerCall& c, DPtr dwte, DPtr dwpe, DPtr dout,
                                    const int32_t* tokens, int C, VocabSlice vocab);
  // The vocab-parallel LM head w (this rank's vocabulary rows; the token embedding when tied):
  // logits(BT, vocab().width) = x @ w^T, x (B T, C: the final norm's output, this rank's rows
  // written) entering the tensor-parallel region. Backward: d_x (B T, C) = this rank's part of
  // x's gradient; returns the summed gradient of this rank's rows (enter_backward(), `local`
  // with SP); w's gradient accumulates.
  void lm_head_forward(const LayerCall& c, const ParamInfo* w, DPtr x, DPtr logits) const;
  DPtr lm_head_backward(const LayerCall& c, const ParamInfo* w, DPtr x, DPtr dlogits, DPtr d_x,
                        DPtr local) const;
  // x(n) through dropout at `site` (a number unique within the model), x's first element being
  // element `first` of the (B T, C) tensor (a sequence-parallel rank's rows): counter-based, so
  // the backward applies the same call to the gradient; with context parallelism numbered by
  // each token's place in the whole sequence. Nothing when c.dropout is 0.
  void dropout(const LayerCall& c, DPtr x, int64_t n, uint64_t site, int64_t first = 0) const;

  // --- the residual stream in and out of the tensor-parallel regions --------------------------
  // Without sequence parallelism these are Megatron's plain pairs (model/tensor_parallel.h) on
  // whole (B T, C) buffers; with it, on this rank's rows of them.
  // Where a norm writes this rank's rows of a region's input `full` (B T, C).
  static DPtr own_rows(const LayerCall& c, DPtr full, int C) { return full + c.row0() * C; }
  // Entering a column-parallel region with `full`, whose own rows are written: SP all-gathers the
  // others (else nothing).
  static void enter_forward(const LayerCall& c, DPtr full, int C);
  // Its backward: `dfull` holds this rank's partial gradient of the region's input. Returns the
  // summed gradient of this rank's rows: SP reduce-scatters it into `local`; else all-reduces
  // dfull in place and returns it.
  static DPtr enter_backward(const LayerCall& c, DPtr dfull, DPtr local, int C);
  // Where a row-parallel GEMM leaving a region writes its partial output: this rank's rows'
  // buffer `local` itself (all-reduced in place), or with SP the (B T, C) `partial`.
  static DPtr leave_target(const LayerCall& c, DPtr local, DPtr partial) {
    return c.sp ? partial : local;
  }
  // Sums leave_target()'s partial outputs into this rank's rows, `local`.
  static void leave_forward(const LayerCall& c, DPtr target, DPtr local, int C);
  // Its backward: the gradient of the region's output, every row: SP all-gathers this rank's
  // rows `dlocal` into `dfull`; else dlocal is all of it.
  static DPtr leave_backward(const LayerCall& c, DPtr dlocal, DPtr dfull, int C);
  // Where a norm's parameter gradient (`slot` 0: its weight, 1: its bias) accumulates: with SP a
  // zeroed part of c.norm_grad_scratch (this rank's rows give a part of the sum), else the
  // gradient itself. finish_norm_grads() sums the parts over the group into the gradients.
  DPtr norm_grad(const LayerCall& c, const ParamInfo* p, int slot) const;
  void finish_norm_grads(const LayerCall& c, const ParamInfo* weight, const ParamInfo* bias) const;

  ModelConfig cfg_;
  ModelShard shard_;
  ParamTable table_;
  VocabSlice vocab_;
};

// Adds the token embedding (V, C), split by vocabulary rows, to a table: on the first stage, and
// with a tied head on the last stage too (the copy).
void add_token_embedding(ParamTableBuilder& b, const ModelConfig& cfg, const ModelShard& shard,
                         const std::string& name, float init_std);

// The definition of cfg.arch on one shard; the table's flat length, and where each block and the
// parameters after the blocks start, are multiples of total_multiple elements (16 for aligned
// views, 16 x dp for even ZeRO shards that no gradient unit straddles).
std::unique_ptr<ModelDefinition> make_model_definition(const ModelConfig& cfg,
                                                       const ModelShard& shard,
                                                       int64_t total_multiple = 16);

// The parameter table of cfg.arch on one shard (the whole model by default), in forward order.
ParamTable param_table(const ModelConfig& cfg, const ModelShard& shard,
                       int64_t total_multiple = 16);
inline ParamTable param_table(const ModelConfig& cfg) {
  return param_table(cfg, ModelShard::whole(cfg));
}

// The weights that take part in matrix multiplies (the blocks' matrices and the LM head, its
// vocab unpadded): 2 FLOPs each per token forward, 4 backward.
int64_t matmul_params(const ModelConfig& cfg);

// Model FLOPs per token trained (forward and backward), the MFU numerator: 6 per matmul weight
// and 6 L C T for causal attention (QK^T and AV over the lower triangle; PaLM and nanoGPT count
// the full square, 12 L C T, which no causal kernel executes). Every FLOP counted here is
// executed by a matmul or attention call, which is what bounds MFU by 100% on the CPU
// (kernels/flop_meter.h).
double flops_per_token(const ModelConfig& cfg);
// The same with attention counted as PaLM counts it, over the full T x T square (12 L C T): the
// yardstick the benchmark's targets are stated in (bench/trainer_bench.cpp's mfu_palm).
double palm_flops_per_token(const ModelConfig& cfg);

}  // namespace trainer
