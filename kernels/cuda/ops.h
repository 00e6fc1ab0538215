#pragma once
// The CUDA backend's kernel launchers, one per operation of kernels/kernels.h (semantics there),
// all enqueued on the given stream. Host code calls these; the .cu files implement them and
// dispatch on the dtypes of their DPtr arguments (f32, bf16, f16; per-row statistics are f32).
// Token ids are device copies (see CudaKernels' token ring).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/blocked_attention.h"
#include "kernels/kernels.h"

namespace trainer::cuda {

// Fixed numbers of partial sums, so that every reduction adds in one order whatever the size:
// results are bitwise reproducible run to run.
constexpr int kColumnChunks = 64;  // row chunks of the column (parameter-gradient) reductions
constexpr int kSumBlocks = 256;    // blocks of the sum-of-squares and the mean loss

void encoder_forward(cudaStream_t s, DPtr out, const int32_t* tokens, DPtr wte, DPtr wpe, int B,
                     int T, int C, VocabSlice v);
// `index`: a TokenIndex's data (kernels/token_index.h) with U distinct ids, on the device. Each
// row of dwte is summed by one block in sequence order, as on the CPU, without atomics.
void encoder_backward(cudaStream_t s, DPtr dwte, DPtr dwpe, DPtr dout, const int32_t* index, int U,
                      int B, int T, int C, VocabSlice v);

void gelu_forward(cudaStream_t s, DPtr out, DPtr inp, int64_t n);
void gelu_backward(cudaStream_t s, DPtr dinp, DPtr inp, DPtr dout, int64_t n);
void residual_forward(cudaStream_t s, DPtr out, DPtr a, DPtr b, int64_t n);
// RoPE in place on qkv's query and key heads; `inverse` rotates by minus the angle (backward).
// cos_sin is fp32.
void rope(cudaStream_t s, DPtr qkv, DPtr cos_sin, int B, int T, int NH, int NKV, int hs, int pos0,
          bool inverse);
void swiglu_forward(cudaStream_t s, DPtr out, DPtr gate_up, int64_t N, int F);
void swiglu_backward(cudaStream_t s, DPtr d_gate_up, DPtr dout, DPtr gate_up, int64_t N, int F);
void dropout(cudaStream_t s, DPtr x, int64_t n, float p, uint64_t seed, int64_t offset);
void convert(cudaStream_t s, DPtr dst, DPtr src, int64_t n, uint64_t stochastic_seed);

// bias and dbias may be null. `partials` is scratch for 2 * kColumnChunks * C floats.
void layernorm_forward(cudaStream_t s, DPtr out, DPtr mean, DPtr rstd, DPtr inp, DPtr weight,
                       DPtr bias, int64_t N, int C);
void layernorm_backward(cudaStream_t s, DPtr dinp, DPtr dweight, DPtr dbias, DPtr dout, DPtr inp,
                        DPtr weight, DPtr mean, DPtr rstd, int64_t N, int C, float* partials);
// res = a + b (rounded as stored; res may be a), then layernorm of res: one pass per row.
void residual_layernorm_forward(cudaStream_t s, DPtr res, DPtr out, DPtr mean, DPtr rstd, DPtr a,
                                DPtr b, DPtr weight, DPtr bias, int64_t N, int C);
// rstd (N) fp32. `partials` is scratch for 2 * kColumnChunks * C floats.
void rmsnorm_forward(cudaStream_t s, DPtr out, DPtr rstd, DPtr inp, DPtr weight, int64_t N, int C,
                     float eps);
void rmsnorm_backward(cudaStream_t s, DPtr dinp, DPtr dweight, DPtr dout, DPtr inp, DPtr weight,
                      DPtr rstd, int64_t N, int C, float* partials);
// dbias(OC) += column sums of dout(N, OC); `partials`: kColumnChunks * OC floats.
void bias_backward(cudaStream_t s, DPtr dbias, DPtr dout, int64_t N, int OC, float* partials);

// The blocked attention's steps (AttentionSteps in kernels/blocked_attention.h says what each
// computes); scores, dP, lse and D are fp32.
void attention_to_heads(cudaStream_t s, DPtr dst, HeadSide side, DPtr src, int64_t width,
                        int64_t column0, const AttentionShape& shape);
void attention_from_heads(cudaStream_t s, DPtr dst, int64_t width, int64_t column0, DPtr src,
                          HeadSide side, const AttentionShape& shape);
void attention_softmax_rows(cudaStream_t s, DPtr p, DPtr lse, DPtr scores, QueryBlock blk,
                            const AttentionShape& shape);
void attention_probs_rows(cudaStream_t s, DPtr p, DPtr scores, DPtr lse, QueryBlock blk,
                          const AttentionShape& shape);
void attention_dsoftmax_rows(cudaStream_t s, DPtr p, DPtr dp, DPtr D, QueryBlock blk,
                             const AttentionShape& shape);
void attention_row_dots(cudaStream_t s, DPtr D, DPtr dout, DPtr out, const AttentionShape& shape);
// Attention over a key/value cache (Kernels::attention_inference): one warp per query and head;
// head sizes up to 256.
void attention_inference(cudaStream_t s, DPtr out, DPtr qkv, int T, int q0, int C, int NH, int NKV);

void crossentropy_stats(cudaStream_t s, DPtr rowmax, DPtr sumexp, DPtr target_logit, DPtr logits,
                        const int32_t* targets, int64_t N, VocabSlice v);
void crossentropy_rebase(cudaStream_t s, DPtr rowmax, DPtr sumexp, DPtr group_max, int64_t N);
// Also the mean loss into *mean (device), through kSumBlocks partials in `partials`.
void crossentropy_loss(cudaStream_t s, DPtr losses, DPtr rowmax, DPtr sumexp, DPtr target_logit,
                       int64_t N, double* partials, double* mean);
void crossentropy_backward(cudaStream_t s, DPtr logits, DPtr rowmax, DPtr sumexp,
                           const int32_t* targets, float dloss, int64_t N, VocabSlice v);

// *result (device) = scale * the sum of x (or of x^2) in double, through kSumBlocks partials.
void sum_values(cudaStream_t s, DPtr x, int64_t n, double* partials, double* result, double scale,
                bool squares = false);
// *result (device) = the sum of the squares of x over `count` ranges (a device array), through
// kSumBlocks partials: each block takes a fixed share of every range, ranges in order.
void sum_squares_ranges(cudaStream_t s, DPtr x, const Range* ranges, int count, double* partials,
                        double* result);
void adamw_update(cudaStream_t s, DPtr param, DPtr grad, DPtr m, DPtr v, int64_t n,
                  const AdamWArgs& args);

}  // namespace trainer::cuda
