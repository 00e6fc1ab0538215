#pragma once
// The backend-neutral kernel interface. The model is written once against it; kernels/cpu/
// implements it with OpenBLAS + OpenMP, and the CUDA backend will implement the same calls.
//
// Conventions (as in llm.c): outputs first, then inputs, then dimensions. Shapes are row-major.
// B = batch, T = time, C = channels, NH = heads, V = real vocab, Vp = padded vocab, N = rows.
// Backward calls say for each output whether they overwrite (=) or accumulate (+=): weight
// gradients always accumulate, so that gradient accumulation over micro-batches is free.
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/dtype.h"

namespace trainer {

// The vocabulary rows (embedding) or columns (logits) one rank holds: token ids
// [start, start + width), of which the first `valid` are real tokens and the rest padding. One
// rank holding everything is {0, V, Vp}; with vocab-parallel tensor parallelism each of tp ranks
// holds Vp / tp.
struct VocabSlice {
  int start = 0, valid = 0, width = 0;
  TRAINER_HD bool holds(int32_t token) const { return token >= start && token < start + valid; }
};

// Elements [offset, offset + count) of a buffer.
struct Range {
  int64_t offset = 0, count = 0;
  bool operator==(const Range& o) const { return offset == o.offset && count == o.count; }
};

// Where a rank's tokens of each sequence sit in the whole sequence under context parallelism:
// its T tokens are two chunks of T / 2, the first at positions [start0, start0 + T / 2), the
// second at [start1, ...) (the causal load balancing of Megatron's and torchtitan's context
// parallelism: rank r of cp holds chunks r and 2 cp - 1 - r of the sequence's 2 cp).
struct TokenChunks {
  int chunk = 0, start0 = 0, start1 = 0;
  TRAINER_HD int position(int t) const { return t < chunk ? start0 + t : start1 + (t - chunk); }
};

// One part of ring attention (model/context_parallel.h): this rank's queries against the keys
// and values of one rank of the ring, T tokens of each of B sequences on both sides, at the
// positions `queries` and `keys`; query i sees key j when keys.position(j) <= queries.position(i).
struct AttentionPart {
  int B = 0, T = 0, C = 0, NH = 0, NKV = 0;
  TokenChunks queries, keys;
  bool first = false;  // the first part: forward sets out and lse instead of combining
};

struct AdamWArgs {
  float lr, beta1, beta2, eps, weight_decay;
  int64_t step;      // 1-based, for bias correction
  float grad_scale;  // multiplies every gradient first (clipping, 1/loss-scale)
  // Momentum SGD instead (beta1 the momentum; v untouched): see sgd_element in shared_math.h.
  bool sgd = false;
  // > 0: 1-bit Adam after its warm-up (trainer/adamw.h): the gradient is the momentum,
  // exchanged across the ranks, and v is frozen as update variance_step left it (its bias
  // correction too).
  int64_t variance_step = 0;
};

class Kernels {
 public:
  virtual ~Kernels() = default;
  virtual std::string name() const = 0;

  // --- memory -------------------------------------------------------------------------------
  virtual DPtr alloc(int64_t elems, DType dtype) = 0;  // zero-filled
  virtual void free(DPtr p) = 0;
  virtual void zero(DPtr p, int64_t elems) = 0;
  virtual void copy_to_host(void* dst, DPtr src, int64_t elems) = 0;
  virtual void copy_from_host(DPtr dst, const void* src, int64_t elems) = 0;
  // Host memory the device can copy from and to asynchronously (pinned on a GPU).
  virtual void* alloc_host(int64_t bytes) = 0;
  virtual void free_host(void* p) noexcept = 0;  // a release: errors are not reported
  // Waits until all work enqueued so far has finished (for timing; a no-op on the CPU).
  virtual void synchronize() {}
  // Whether calls return before their work is done (a GPU's stream), so that timing a phase
  // on the host needs a synchronize().
  virtual bool asynchronous() const { return false; }
  // Device memory reserved for the job and the most of it ever in use; zero on the CPU.
  struct MemoryUse {
    int64_t reserved = 0, peak = 0;
  };
  virtual MemoryUse memory() const { return {}; }
  // The MFU denominator: peak dense matrix-multiply FLOP/s in `dtype`, or 0 when unknown. A GPU
  // answers its data sheet's dense peak, or the peak set below. The CPU answers the best rate
  // it has been seen to reach (kernels/flop_meter.h): the higher of its floor (the start-up
  // measurement or the peak set below) and the best matmul or attention call so far, so that
  // the model's FLOP/s can never exceed it.
  virtual double peak_flops(DType) const { return 0; }
  // Called after each operator the backend times (the CPU's matrix multiplies and attention; a
  // GPU's operators, timed by CUDA events, once they have run) with its name, the FLOPs it
  // executed, its start and its end: a profiler's hook (empty: none).
  using OpObserver =
      std::function<void(const char* op, double flops, std::chrono::steady_clock::time_point t0,
                         std::chrono::steady_clock::time_point t1)>;
  virtual void set_op_observer(OpObserver) {}
  // A peak configured or measured elsewhere: replaces a GPU's data sheet; the CPU's floor.
  virtual void set_peak_flops(double /*flops_per_s*/) {}
  // Measures the peak where the backend can (the CPU: the best of several short sgemm bursts),
  // makes it the floor and returns it; 0 where it cannot.
  virtual double measure_peak_flops() { return 0; }
  // The FLOPs executed by matmul and attention calls so far and the seconds they took (the
  // CPU; zeros where calls are not timed, as on an asynchronous GPU).
  struct MatmulTotals {
    double flops = 0, seconds = 0;
  };
  virtual MatmulTotals matmul_totals() const { return {}; }
  // fp32 host values from and to a buffer of any dtype (16-bit and f64 converted on the way).
  void download_f32(float* dst, DPtr src, int64_t elems) {
    if (src.dtype == DType::f32) return copy_to_host(dst, src, elems);
    DPtr tmp = alloc(elems, DType::f32);
    convert(tmp, src, elems, 0);
    copy_to_host(dst, tmp, elems);
    free(tmp);
  }
  void upload_f32(DPtr dst, const float* src, int64_t elems) {
    if (dst.dtype == DType::f32) return copy_from_host(dst, src, elems);
    DPtr tmp = alloc(elems, DType::f32);
    copy_from_host(tmp, src, elems);
    convert(dst, tmp, elems, 0);
    free(tmp);
  }

  // --- encoder: out(B,T,C) = wte[tokens] + wpe[t] -------------------------------------------
  // wte holds the rows of `vocab`; tokens outside it contribute zero (vocab-parallel: the
  // partial embeddings are summed across ranks). wpe may be null (added on one rank only).
  virtual void encoder_forward(DPtr out, const int32_t* tokens, DPtr wte, DPtr wpe, int B, int T,
                               int C, VocabSlice vocab) = 0;
  // dwte += (rows of `vocab` only), dwpe += (skipped when null)
  virtual void encoder_backward(DPtr dwte, DPtr dwpe, DPtr dout, const int32_t* tokens, int B,
                                int T, int C, VocabSlice vocab) = 0;

  // --- layernorm over the last dim: out(N,C), mean(N), rstd(N); bias may be null -------------
  virtual void layernorm_forward(DPtr out, DPtr mean, DPtr rstd, DPtr inp, DPtr weight, DPtr bias,
                                 int64_t N, int C) = 0;
  // dinp += , dweight += , dbias += (skipped when null)
  virtual void layernorm_backward(DPtr dinp, DPtr dweight, DPtr dbias, DPtr dout, DPtr inp,
                                  DPtr weight, DPtr mean, DPtr rstd, int64_t N, int C) = 0;

  // --- RMSNorm over the last dim (Llama): out(N,C) = inp * rstd * weight, rstd(N) ------------
  // rstd = 1 / sqrt(mean(inp^2) + eps), kept in fp32 when activations are 16-bit.
  virtual void rmsnorm_forward(DPtr out, DPtr rstd, DPtr inp, DPtr weight, int64_t N, int C,
                               float eps) = 0;
  // dinp += , dweight +=
  virtual void rmsnorm_backward(DPtr dinp, DPtr dweight, DPtr dout, DPtr inp, DPtr weight,
                                DPtr rstd, int64_t N, int C) = 0;
  // res = a + b (res may be a), out = rmsnorm(res); a backend may fuse them.
  virtual void residual_rmsnorm_forward(DPtr res, DPtr out, DPtr rstd, DPtr a, DPtr b, DPtr weight,
                                        int64_t N, int C, float eps) {
    residual_forward(res, a, b, N * C);
    rmsnorm_forward(out, rstd, res, weight, N, C, eps);
  }

  // --- residual then layernorm: res = a + b (res may be a), out = layernorm(res) -------------
  // The two calls below; a backend may fuse them into one pass over the rows.
  virtual void residual_layernorm_forward(DPtr res, DPtr out, DPtr mean, DPtr rstd, DPtr a, DPtr b,
                                          DPtr weight, DPtr bias, int64_t N, int C) {
    residual_forward(res, a, b, N * C);
    layernorm_forward(out, mean, rstd, res, weight, bias, N, C);
  }

  // --- linear: out(N,OC) = inp(N,IC) @ weight(OC,IC)^T + bias(OC); bias may be null ---------
  virtual void matmul_forward(DPtr out, DPtr inp, DPtr weight, DPtr bias, int64_t N, int IC,
                              int OC) = 0;
  // dinp = (skipped when null), dweight += , dbias += (skipped when null)
  virtual void matmul_backward(DPtr dinp, DPtr dweight, DPtr dbias, DPtr dout, DPtr inp,
                               DPtr weight, int64_t N, int IC, int OC) = 0;
  // A linear layer and the GELU after it: pre = the linear's output, out = gelu(pre). And the
  // backward of a linear layer whose input was gelu(pre): as matmul_backward, with dinp taken
  // through the GELU (dinp = gelu'(pre) * the input gradient). The calls below; a backend may
  // fuse the GELU into the GEMMs.
  virtual void matmul_gelu_forward(DPtr pre, DPtr out, DPtr inp, DPtr weight, DPtr bias, int64_t N,
                                   int IC, int OC) {
    matmul_forward(pre, inp, weight, bias, N, IC, OC);
    gelu_forward(out, pre, N * OC);
  }
  virtual void matmul_backward_gelu(DPtr dinp, DPtr dweight, DPtr dbias, DPtr dout, DPtr inp,
                                    DPtr weight, DPtr pre, int64_t N, int IC, int OC) {
    matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, IC, OC);
    if (dinp) gelu_backward(dinp, pre, dinp, N * IC);
  }

  // --- causal self-attention with grouped-query heads ----------------------------------------
  // qkv(B,T,C + 2 NKV hs) rows hold NH query heads, then NKV key heads, then NKV value heads, of
  // hs = C / NH each; query head h attends with key/value head h / (NH / NKV) (NKV = NH:
  // multi-head attention, NKV = 1: multi-query), without repeating K and V in memory.
  // out(B,T,C). No T x T matrix is kept: the forward keeps each row's log-sum-exp lse(B,NH,T)
  // (the statistics' dtype: fp32 for 16-bit activations), and the backward recomputes the
  // probabilities block by block from it, as FlashAttention does (kernels/blocked_attention.h on
  // the GPU, kernels/cpu/attention.cpp on the CPU).
  virtual void attention_forward(DPtr out, DPtr lse, DPtr qkv, int B, int T, int C, int NH,
                                 int NKV) = 0;
  // dqkv = the gradient of qkv from out's gradient dout (overwritten, where the parts below add
  // theirs); out and lse are the forward's
  virtual void attention_backward(DPtr dqkv, DPtr dout, DPtr qkv, DPtr out, DPtr lse, int B, int T,
                                  int C, int NH, int NKV) = 0;
  // Multi-head attention (GPT-2): qkv(B,T,3C).
  void attention_forward(DPtr out, DPtr lse, DPtr qkv, int B, int T, int C, int NH) {
    attention_forward(out, lse, qkv, B, T, C, NH, NH);
  }
  void attention_backward(DPtr dqkv, DPtr dout, DPtr qkv, DPtr out, DPtr lse, int B, int T, int C,
                          int NH) {
    attention_backward(dqkv, dout, qkv, out, lse, B, T, C, NH, NH);
  }
  // Inference over a key/value cache, one sequence: qkv(T, C + 2 NKV hs) holds positions
  // [0, T); the queries of rows [q0, T) attend causally to keys [0, their position].
  // out(T - q0, C). Keeps nothing.
  virtual void attention_inference(DPtr out, DPtr qkv, int T, int q0, int C, int NH, int NKV) = 0;

  // --- attention by parts, for ring attention (context parallelism) ---------------------------
  // q and kv are (B, T, C + 2 NKV hs) rows as qkv above; a part reads q's query heads and kv's
  // key and value heads. Forward folds the part into out(B, T, C) and each row's log-sum-exp
  // lse(B, NH, T) (the statistics' dtype) by the online softmax: the first part sets them, a
  // later one rescales and adds (a row that sees no key of the part is left as it is). Backward,
  // from the whole attention's out, lse and dout: dq's query columns += the part's gradient,
  // dkv's key and value columns += (the other columns untouched). A backend without them throws.
  virtual void attention_part_forward(DPtr /*out*/, DPtr /*lse*/, DPtr /*q*/, DPtr /*kv*/,
                                      const AttentionPart&) {
    throw std::logic_error(name() + " has no ring-attention kernels (context parallelism)");
  }
  virtual void attention_part_backward(DPtr /*dq*/, DPtr /*dkv*/, DPtr /*dout*/, DPtr /*q*/,
                                       DPtr /*kv*/, DPtr /*out*/, DPtr /*lse*/,
                                       const AttentionPart&) {
    throw std::logic_error(name() + " has no ring-attention kernels (context parallelism)");
  }

  // --- rotary position embedding (RoPE), in place on the query and key heads of qkv ----------
  // qkv(B,T,(NH + 2 NKV) hs) as above; token t of each sequence is at position pos0 + t.
  // cos_sin(max_pos, hs/2, 2) fp32 holds cos and sin of position x frequency i; each pair
  // (x[2i], x[2i+1]) of a head is rotated by that angle (Meta's Llama layout: interleaved
  // pairs). Value heads are untouched. Backward rotates the gradient by the opposite angle.
  virtual void rope_forward(DPtr qkv, DPtr cos_sin, int B, int T, int NH, int NKV, int hs,
                            int pos0) = 0;
  virtual void rope_backward(DPtr dqkv, DPtr cos_sin, int B, int T, int NH, int NKV, int hs,
                             int pos0) = 0;

  // --- SwiGLU: out(N,F) = silu(gate) * up, from gate_up(N,2F) rows [gate(F) | up(F)] ---------
  virtual void swiglu_forward(DPtr out, DPtr gate_up, int64_t N, int F) = 0;
  // d_gate_up(N,2F) =
  virtual void swiglu_backward(DPtr d_gate_up, DPtr dout, DPtr gate_up, int64_t N, int F) = 0;

  // --- dropout, counter-based: x(n) *= keep(seed, index) / (1 - p), in place ---------------
  // keep is a function of (seed, index) alone, the same on every backend, so backward applies
  // the same call to the gradient and nothing is stored; element `index` of x is numbered
  // offset + index.
  virtual void dropout(DPtr x, int64_t n, float p, uint64_t seed, int64_t offset) = 0;

  // --- GELU (tanh approximation) -------------------------------------------------------------
  virtual void gelu_forward(DPtr out, DPtr inp, int64_t n) = 0;
  virtual void gelu_backward(DPtr dinp, DPtr inp, DPtr dout, int64_t n) = 0;  // dinp =

  // --- residual: out = a + b ------------------------------------------------------------------
  virtual void residual_forward(DPtr out, DPtr a, DPtr b, int64_t n) = 0;

  // --- softmax + cross-entropy over a slice of the vocabulary --------------------------------
  // logits(N, width) hold this rank's columns and stay logits until the backward: the forward
  // reads them from memory once and keeps three numbers a row, the backward turns them into
  // their gradients in one pass (no probabilities are stored: four passes over the N x vocab
  // matrix in memory became two; the CPU's forward reads each row twice, the second from L2).
  // Ranks that share the vocabulary combine only the per-row statistics, never the logits. A
  // training step on one rank holding the whole vocabulary runs both at once (below), and its
  // logits are gradients after the forward.
  // 1. rowmax(N) = the max over the slice's real columns (lowest float when it has none);
  //    sumexp(N) = the sum of exp(logit - rowmax) over them; target_logit(N) = the target's
  //    logit if this slice holds it, else 0.
  virtual void crossentropy_stats(DPtr rowmax, DPtr sumexp, DPtr target_logit, DPtr logits,
                                  const int32_t* targets, int64_t N, VocabSlice vocab) = 0;
  // 2. (ranks sharing the vocabulary, between a max and a sum over the group) With the group's
  //    max: sumexp *= exp(rowmax - group_max), rowmax = group_max.
  virtual void crossentropy_rebase(DPtr rowmax, DPtr sumexp, DPtr group_max, int64_t N) = 0;
  // 3. losses(N) = log(sumexp) + rowmax - target_logit. Returns the mean loss over the N rows,
  //    accumulated in double.
  virtual double crossentropy_loss(DPtr losses, DPtr rowmax, DPtr sumexp, DPtr target_logit,
                                   int64_t N) = 0;
  // logits(N, width) are replaced by dlogits = (softmax - onehot(target)) * dloss, the softmax
  // exp(logit - rowmax) / sumexp from the (combined) statistics; padding columns become 0.
  virtual void crossentropy_backward(DPtr logits, DPtr rowmax, DPtr sumexp, const int32_t* targets,
                                     float dloss, int64_t N, VocabSlice vocab) = 0;
  // 1 and the backward at once, where no group combines the statistics in between (one rank
  // holds the whole vocabulary, and a backward follows): the same statistics and gradients, the
  // logits gone afterwards, for statistics in fp32 or fp64 (16-bit ones would be rounded between
  // the two passes, not in one). A backend may do both in one pass over each row, while it is in
  // cache (the CPU's); this one runs the two (the CUDA backend's).
  virtual void crossentropy_stats_and_backward(DPtr rowmax, DPtr sumexp, DPtr target_logit,
                                               DPtr logits, const int32_t* targets, float dloss,
                                               int64_t N, VocabSlice vocab) {
    crossentropy_stats(rowmax, sumexp, target_logit, logits, targets, N, vocab);
    crossentropy_backward(logits, rowmax, sumexp, targets, dloss, N, vocab);
  }

  // --- precision -----------------------------------------------------------------------------
  // dst(n) = src(n) converted to dst's dtype (fp32 -> bf16/fp16 rounds to nearest even). A
  // non-zero stochastic_seed rounds fp32 -> bf16 stochastically instead, with random bits that
  // are a function of (seed, index).
  virtual void convert(DPtr dst, DPtr src, int64_t n, uint64_t stochastic_seed) = 0;

  // --- optimizer -----------------------------------------------------------------------------
  // Sum of squares of x in double, in a fixed reduction order (deterministic).
  virtual double sum_squares(DPtr x, int64_t n) = 0;
  // The same over several ranges of x, in one pass: on a GPU one launch and one wait however
  // many ranges there are (a sharded or tensor-parallel model's gradient norm sums hundreds).
  // Deterministic; on the CPU bitwise the per-range sums added in order.
  virtual double sum_squares(DPtr x, const std::vector<Range>& ranges) = 0;
  // AdamW with decoupled weight decay: param -= lr * (mhat / (sqrt(vhat) + eps) + wd * param)
  // (momentum SGD when args.sgd, which neither reads nor writes v: it may be null then).
  virtual void adamw_update(DPtr param, DPtr grad, DPtr m, DPtr v, int64_t n,
                            const AdamWArgs& args) = 0;
};

// The CPU backend (OpenBLAS + OpenMP). Computes in the dtype of its arguments (f32 or f64).
std::unique_ptr<Kernels> make_cpu_kernels();

// The CUDA backend, on one GPU of this node; see kernels/cuda/cuda_kernels.h.
struct CudaOptions {
  int device = 0;
  // Of the GPU's memory, the share reserved at start-up (one cudaMalloc) for this process (at
  // most what is free then, less headroom for NCCL and the CUDA runtime); ranks sharing one GPU
  // split it.
  double memory_fraction = 0.9;
};
// Whether this trainer was built with the CUDA backend, and how many GPUs this process sees (0
// without a driver or a device; never throws).
bool cuda_built();
int cuda_device_count();
// The identity of a GPU this process sees (its UUID: the same for every process on the
// physical device, whatever CUDA_VISIBLE_DEVICES numbering each has); throws when there is none.
std::array<std::byte, 16> cuda_device_uuid(int device);
// Throws std::runtime_error when built without CUDA.
std::unique_ptr<Kernels> make_cuda_kernels(const CudaOptions& options);

}  // namespace trainer
