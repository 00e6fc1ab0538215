#pragma once
// The stage executor: runs one shard of any model (model/model_definition.h) for training and
// inference. It owns the parameters and gradients (two flat buffers described by the parameter
// table), the activations of every micro-batch in flight (planned once for the largest (B, T),
// so a steady-state step allocates nothing), the layer loop, the vocab-parallel loss, and hooks
// before and after each layer's forward and backward: the data-parallel reducer's gradient-ready
// hook is one; activation recomputation and parameter gathering will be others. The trainer,
// the pipeline, the optimizer, checkpoints and the sampler see an executor and its table, never
// an architecture.
//
// A shard is the blocks of one pipeline stage and one tensor-parallel rank's slice of them.
// Pipeline parallelism is left to the caller: a stage reads its input from input(slot) and
// leaves its output in output(slot); backward reads the output's gradient from grad_io() and
// leaves the input's gradient there. Each of `slots` micro-batches in flight has its own
// activations.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "model/context_parallel.h"
#include "model/grad_units.h"
#include "model/model_config.h"
#include "model/model_definition.h"
#include "model/param_table.h"
#include "model/tensor_parallel.h"

namespace trainer {

// Activation recomputation (Chen et al. 2016; Korthikanti et al. 2022, Megatron's "selective"):
// memory traded for compute, per block. none: every activation is kept from forward to
// backward. selective: the MLP's activation (ActSpec::selective: GELU's or SwiGLU's output) is not
// kept but remade from the block's kept activations just before its backward (attention keeps no
// T x T probabilities on any backend: only each row's log-sum-exp, see Kernels). full: only
// the block's input is kept (the previous block's output), and the whole block is run forward
// again just before its backward. Blocks under recomputation share one set of buffers for what
// they do not keep, so a stage of L such blocks holds one block's worth instead of L. Full
// recomputation runs the forward's kernels on the forward's inputs (with the same dropout masks
// and tensor-parallel collectives), selective the same kernels where the backend has them
// unfused: on the CPU the gradients are bitwise those of none; on a GPU whose forward fuses the
// GELU into its GEMM, selective remakes the GELU from the stored 16-bit pre-activation, equal to
// rounding. The recomputation runs inside the block's backward hooks and drives the collectives
// in flight as the backward does; MFU counts model FLOPs, so it does not count recomputation.
enum class Recompute { none, selective, full };
Recompute parse_recompute(const std::string& name);  // "none" | "selective" | "full"
const char* recompute_name(Recompute r);

struct StageOptions {
  std::optional<ModelShard> shard;  // default: the whole model
  // The tensor-parallel group's reduction (default: one rank). The caller adapts its
  // communicator, so that model code depends on no communication library.
  TensorParallel tp;
  // The context-parallel group (default: one rank): each sequence's tokens split over it, the
  // shard's cp_size set from it (model/context_parallel.h).
  ContextParallel cp;
  int slots = 1;  // micro-batches whose activations are kept at once
  int64_t total_multiple = 16;
  // Gradients' storage; default: the model's dtype. (Mixed precision: bf16/fp16 weights and
  // activations with fp32 gradients, say.)
  std::optional<DType> grad_dtype;
  Recompute recompute = Recompute::none;
  int recompute_layers = 0;  // recomputation applies to the stage's first N blocks; 0 = all
  // ZeRO-2: no flat gradient buffer; each backward writes its gradient units into windows
  // (model/grad_units.h) lent by set_gradient_windows(), and grads() holds only the units held
  // for the whole step. The table's units should be aligned (total_multiple) to the shards.
  bool windowed_grads = false;
  // ZeRO-3 (with windowed_grads): no flat parameter buffer either; each unit's parameters are
  // borrowed, gathered, from set_param_windows() just before the unit runs, and params() holds
  // only the held units'.
  bool windowed_params = false;
};

class StageExecutor {
 public:
  // What a shard allocates, in bytes, known before anything is: parameters, gradients,
  // activations with the backward scratch, and per-row statistics.
  struct Memory {
    int64_t params = 0, grads = 0, activations = 0, stats = 0;
    int64_t total() const { return params + grads + activations + stats; }
  };
  static Memory memory_needed(const ModelConfig& cfg, DType dtype, int max_B, int max_T,
                              const StageOptions& options);

  // max_B x max_T is the largest batch forward() will be given; max_T <= cfg.seq_len. With
  // context parallelism every T here is a whole sequence's (a multiple of 2 cp): forward() takes
  // whole sequences and runs this rank's chunks of them.
  StageExecutor(const ModelConfig& cfg, Kernels& kernels, DType dtype, int max_B, int max_T,
                const StageOptions& options = {});
  ~StageExecutor();
  StageExecutor(const StageExecutor&) = delete;
  StageExecutor& operator=(const StageExecutor&) = delete;

  const ModelConfig& config() const { return def_->config(); }
  const ModelDefinition& definition() const { return *def_; }
  const ModelShard& shard() const { return def_->shard(); }
  const ParamTable& table() const { return def_->table(); }
  DType dtype() const { return dtype_; }
  Kernels& kernels() const { return k_; }
  VocabSlice vocab() const { return def_->vocab(); }  // the vocabulary rows this rank holds

  // Flat (table().total); with windowed parameters only the held units' (as grads()).
  DPtr params() const { return params_; }
  int64_t params_elems() const { return params_elems_; }
  bool windowed_params() const { return windowed_params_; }
  // Flat, same offsets; with windowed gradients only the held units' (from offset 0 to the
  // end of the last held unit; null when none is held).
  DPtr grads() const { return grads_; }
  int64_t grads_elems() const { return grads_elems_; }
  DType grad_dtype() const { return grad_dtype_; }
  // The gradient units of the shard's table (model/grad_units.h), and who lends their windows
  // (windowed gradients only; before the first backward).
  const std::vector<GradUnit>& grad_units() const { return units_; }
  void set_gradient_windows(GradientWindows* windows) { windows_ = windows; }
  // Who gathers the parameters into windows (windowed parameters only; before the first
  // forward).
  void set_param_windows(ParamWindows* windows) { param_windows_ = windows; }
  // A parameter in params(): with windowed parameters, of a held unit only.
  DPtr param(const ParamInfo& p) const {
    if (p.offset + p.numel > params_elems_)
      throw std::logic_error(p.name + ": it is gathered into a window, not in params()");
    return params_ + p.offset;
  }
  // A parameter's gradient in grads(): with windowed gradients, of a held unit only.
  DPtr grad(const ParamInfo& p) const {
    if (p.offset + p.numel > grads_elems_)
      throw std::logic_error(p.name + ": its gradient is in a window, not in grads()");
    return grads_ + p.offset;
  }

  // Initialisation is a pure function of (seed, parameter name, logical index): it does not
  // depend on how the model is split, nor on the dtype.
  void init_parameters(uint64_t seed) { init_parameters(seed, params_); }
  // The same values into another buffer laid out like params() (fp32 master weights, say).
  void init_parameters(uint64_t seed, DPtr into);
  // This rank's initial values of one parameter's local elements [begin, end) (local order).
  std::vector<double> initial_values(uint64_t seed, const ParamInfo& p, int64_t begin,
                                     int64_t end) const;

  // This rank's real elements of a parameter (padding excluded, ParamInfo::local_shape) to and
  // from host fp32 or fp64.
  template <class H>
  std::vector<H> read(const ParamInfo& p, DPtr buffer) const;
  template <class H>
  void write(const ParamInfo& p, DPtr buffer, const std::vector<H>& values);
  // Initial values are made and written this many elements at a time.
  static constexpr int64_t kInitChunk = 1 << 20;

  // The whole model (one stage, slot 0): tokens, targets are (B, T) host arrays. With targets,
  // returns the mean loss and keeps the logits and the loss's per-row statistics, which
  // backward() turns into the logits' gradients; without, returns 0 and leaves the logits in
  // logits().
  double forward(const int32_t* tokens, const int32_t* targets, int B, int T) {
    return forward(0, tokens, targets, B, T);
  }
  // One stage on micro-batch `slot`: the first stage embeds `tokens`, the others start from
  // input(slot); the last stage computes the loss when targets are given (else the logits),
  // the others leave their output in output(slot). Returns the mean loss (last stage).
  double forward(int slot, const int32_t* tokens, const int32_t* targets, int B, int T) {
    return run_forward(slot, tokens, targets, B, T, std::nullopt);
  }
  // forward() with targets for the backward(slot, loss_scale) that follows it. Where one rank
  // holds the whole vocabulary (no tensor-parallel group combines the loss's statistics first),
  // the last stage turns each row of logits into its gradient at once (on the CPU while the row
  // is in cache: one pass over the B x T x vocab logits where forward() and backward() make two;
  // the CUDA backend runs its two kernels), and logits(slot) holds gradients afterwards. The
  // loss and gradients are forward()'s and backward()'s, bit for bit; the time of the logits'
  // gradients is the forward's.
  double training_forward(int slot, const int32_t* tokens, const int32_t* targets, int B, int T,
                          float loss_scale) {
    return run_forward(slot, tokens, targets, B, T, loss_scale);
  }
  // Inference with a key/value cache, one sequence (slot 0): the T tokens at positions
  // [pos0, pos0 + T) (the first stage embeds them, the others start from input(0)), attending
  // to every earlier position of the previous infer() calls since one with pos0 = 0. The last
  // stage leaves the T rows' logits in logits(), the others their output in output(0).
  void infer(const int32_t* tokens, int T, int pos0);
  // Accumulates d(loss_scale * mean loss)/dparams into grads(). The last stage starts from its
  // loss; the others from the output gradient in grad_io(). Afterwards grad_io() holds the
  // input's gradient (on all but the first stage).
  void backward(int slot, float loss_scale);
  void backward(float loss_scale = 1.0f) { backward(0, loss_scale); }
  void zero_grad();

  // Dropout (a model with dropout > 0) acts between train_mode() and eval_mode() (the default),
  // in forwards with targets and their backwards. The n-th such forward since train_mode() is
  // micro-batch first + n x stride of the step, and its masks are a function of (step_key, that
  // index) alone: with the step's key from (seed, step), and first = dp rank, stride = dp, every
  // layout draws the same masks for the same sample, and a resumed run those of the
  // uninterrupted one. (stride 0: every forward the same masks, for finite differences.)
  void train_mode(uint64_t step_key, int first, int stride);
  void eval_mode() { training_ = false; }

  // What a stage receives and sends for a (B, T) micro-batch: its rows of the residual stream
  // (all B T, or this rank's share of them with sequence or context parallelism), times d_model.
  int64_t io_elems(int B, int T) const {
    return def_->stream_rows(B, T / cp_.size()) * config().d_model;
  }
  // The tokens of each sequence this rank runs (context parallelism: T / cp of them).
  int local_T(int T) const { return T / cp_.size(); }
  // The most tokens one infer() call takes: the rows the stream buffers hold (a longer prompt
  // goes in chunks, each attending to the ones before through the key/value cache).
  int inference_rows() const {
    return int(std::min<int64_t>(def_->stream_rows(max_B_, local_T(max_T_)), max_T_));
  }
  // The residual stream, (B, T, C) (with sequence parallelism this rank's rows: io_elems()):
  DPtr input(int slot) const;       // where a later stage receives its input
  DPtr output(int slot) const;      // what a stage sends on
  DPtr grad_io() const;             // the gradient received from the next / sent back
  DPtr logits(int slot = 0) const;  // (B, T, vocab().width)
  // (B, T) per-token losses of the last forward with targets (context parallelism: (B, T / cp),
  // this rank's chunks of each sequence).
  DPtr losses(int slot = 0) const;
  const ContextParallel& context_parallel() const { return cp_; }

  // Called during backward with an offset into the flat gradient buffer, every gradient at or
  // above which is final for this backward, and the number of this stage's layers whose
  // backward has not started yet (the data-parallel reducer starts buckets while backward goes
  // on, and records how early).
  using GradsReadyHook = std::function<void(int64_t frontier, int layers_left)>;
  void set_grads_ready_hook(GradsReadyHook hook) { grads_ready_ = std::move(hook); }

  // Called around each layer's forward and backward with the micro-batch slot and the layer's
  // global index; any of them may be empty.
  struct LayerHooks {
    std::function<void(int slot, int layer)> before_forward, after_forward, before_backward,
        after_backward;
  };
  void add_layer_hooks(LayerHooks hooks) { layer_hooks_.push_back(std::move(hooks)); }

 private:
  // Host values into dst (any dtype), through a temporary in H's dtype.
  template <class H>
  void write_values(DPtr dst, const std::vector<H>& values);
  // Where every activation of a shard goes, in elements of the two slabs: the activation dtype
  // and the statistics (fp32 with 16-bit activations). Planned from shapes alone, by the
  // constructor and by memory_needed().
  struct Plan;
  static Plan plan(const ModelDefinition& def, int max_B, int max_T, const StageOptions& o);
  LayerCall call(int slot, int B, int T, const DPtr* acts) const;
  // Unit u's parameters from a window (windowed parameters, unit not held), the next unit in
  // the direction of travel (+1 forward, -1 backward) prefetched: `c` with them;
  // close_params() hands the window back.
  LayerCall open_params(LayerCall c, int u, int direction) const;
  void close_params(int u) const;
  // Unit u's gradients of this backward go to a window (windowed gradients, unit not held):
  // `c` with them, and close_unit() hands the window back.
  LayerCall open_unit(LayerCall c, int u) const;
  void close_unit(int u, int layers_left) const;
  // The unit of the stage's local block `local`.
  int block_unit(int local) const { return first_block_unit_ + local; }
  bool recomputed(int local_layer) const { return local_layer < recompute_layers_; }
  // Remakes what block `local` did not keep of the forward of the micro-batch `c` is for.
  void recompute(const LayerCall& c, int local, DPtr x);
  double run_forward(int slot, const int32_t* tokens, const int32_t* targets, int B, int T,
                     std::optional<float> backward_loss_scale);
  double cross_entropy(int slot, int64_t BT, std::optional<float> backward_loss_scale);
  // This rank's tokens of B whole sequences of T (all of them, or its chunks).
  void take_chunks(const int32_t* whole, int32_t* mine, int B, int T) const;
  void run_layers_forward(int slot, int B, int T, bool inference, int pos0);

  std::unique_ptr<ModelDefinition> def_;
  Kernels& k_;
  DType dtype_, grad_dtype_;
  // Per-row statistics (norm statistics, losses, the softmax's max and sum) stay in fp32 when
  // the activations are 16-bit, as on GPUs.
  DType stats_dtype_;
  Recompute recompute_;
  int recompute_layers_;  // local blocks [0, recompute_layers_) are recomputed
  TensorParallel tp_;
  ContextParallel cp_;
  bool sp_ = false;         // sequence parallelism: the residual stream holds this rank's rows
  DPtr norm_grad_scratch_;  // sp_: a norm's parameter gradients before the group's sum
  int slots_, layers_;
  int max_B_, max_T_;  // max_T_: whole sequences
  int B_ = 0, T_ = 0;  // shape of the last forward (T_: this rank's tokens of each sequence)
  bool inference_ = false, last_inference_ = false;
  int pos0_ = 0;
  // Per slot, what the last forward left in the logits for backward: nothing (no targets, or
  // backward ran), the loss's statistics beside them, or their gradients, made with `scale`.
  struct LossState {
    enum Left : char { nothing, stats, gradients } left = nothing;
    float scale = 0;
  };
  std::vector<LossState> loss_state_;
  bool training_ = false;  // dropout on (train_mode)
  uint64_t step_key_ = 0;
  int64_t next_micro_ = 0;
  int micro_stride_ = 0;
  std::vector<uint64_t> dropout_keys_;  // per slot: its forward's key, 0 = no dropout
  std::vector<std::vector<int32_t>> tokens_, targets_;  // per slot
  GradsReadyHook grads_ready_;
  std::vector<int64_t> layer_frontier_;  // by local layer: its first parameter's offset
  int64_t head_frontier_ = 0;            // the first parameter after the blocks
  std::vector<LayerHooks> layer_hooks_;

  DPtr params_, grads_;
  int64_t params_elems_ = 0, grads_elems_ = 0;
  bool windowed_ = false, windowed_params_ = false;
  std::vector<GradUnit> units_;
  int first_block_unit_ = 0;  // after the embeddings' unit on the first stage, or the tied copy's
  GradientWindows* windows_ = nullptr;
  ParamWindows* param_windows_ = nullptr;
  // Drives the parameter gathers in flight between the kernels of a forward.
  std::function<void()> forward_progress_;
  DPtr acts_;   // one slab for all activations and backward scratch
  DPtr stats_;  // one slab for the per-row statistics
  // Views into the slabs, by slot: the stage's input, each layer's output and activations, the
  // head's activations, the logits and the loss's statistics (losses; rowmax: this rank's, then
  // with tp > 1 the group's; the exp-sums followed by the target logits: 2 BT, so that
  // one all-reduce carries both).
  struct SlotViews {
    DPtr input, logits, losses, rowmax, sumexp;
    std::vector<DPtr> outputs;              // by local layer
    std::vector<std::vector<DPtr>> layers;  // by local layer, in declared order
    std::vector<DPtr> head;
  };
  std::vector<SlotViews> views_;
  DPtr d_res_;
  std::vector<DPtr> scratch_;
  DPtr recompute_out_;  // where full recomputation writes a block's output again (discarded)
  // The activations infer() gives each block: slot 0's, and under full recomputation the
  // block's own key/value cache (planned with the rest) in place of the shared buffer.
  std::vector<std::vector<DPtr>> inference_layers_;
};

}  // namespace trainer
