#pragma once
// The CPU implementations of the kernel interface, templated on the element type (float for
// training, double for finite-difference reference checks). Semantics as in kernels/kernels.h.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/kernels.h"

namespace trainer::cpu {

// Writes `bytes` zero bytes at p: a large buffer in slices across the threads.
void zero_bytes(void* p, size_t bytes);

// Row-major GEMM, C(M,N) = alpha * op(A)(M,K) @ op(B)(K,N) + beta * C [+ bias(N) on every row]
// (kernels/cpu/gemm.cpp says whose).
template <class T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
          int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc, const T* bias = nullptr);

template <class T>
void encoder_forward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int B, int T_,
                     int C, VocabSlice v);
template <class T>
void encoder_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int B, int T_, int C,
                      VocabSlice v);

// `scratch` holds per-thread partial sums for the parameter gradients.
template <class T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* w, const T* b, int64_t N,
                       int C);
template <class T>
void layernorm_backward(T* dinp, T* dw, T* db, const T* dout, const T* inp, const T* w,
                        const T* mean, const T* rstd, int64_t N, int C,
                        std::vector<double>& scratch);

// RMSNorm: rstd in T; `scratch` as for layernorm_backward.
template <class T>
void rmsnorm_forward(T* out, T* rstd, const T* inp, const T* w, int64_t N, int C, float eps);
template <class T>
void rmsnorm_backward(T* dinp, T* dw, const T* dout, const T* inp, const T* w, const T* rstd,
                      int64_t N, int C, std::vector<double>& scratch);

template <class T>
void matmul_forward(T* out, const T* inp, const T* w, const T* bias, int64_t N, int IC, int OC);
template <class T>
void matmul_backward(T* dinp, T* dw, T* dbias, const T* dout, const T* inp, const T* w, int64_t N,
                     int IC, int OC);

// Causal grouped-query attention (NKV = NH: multi-head): out and each row's log-sum-exp lse
// (B, NH, T) forward; dqkv (overwritten) from them backward.
template <class T>
void attention_forward(T* out, T* lse, const T* qkv, int B, int T_, int C, int NH, int NKV);
template <class T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const T* lse, int B,
                        int T_, int C, int NH, int NKV);
// Ring attention's parts (kernels/kernels.h, AttentionPart).
template <class T>
void attention_part_forward(T* out, T* lse, const T* q, const T* kv, const AttentionPart& p);
template <class T>
void attention_part_backward(T* dq, T* dkv, const T* dout, const T* q, const T* kv, const T* out,
                             const T* lse, const AttentionPart& p);
// How many slices of each key/value head's group of query heads the backward splits its work
// into (a divisor of group): 1, unless the kv_tasks = B x NKV key/value heads leave some of the
// threads idle and slicing keeps more of them busy (each slice then sums its own dK and dV).
int attention_backward_split(int kv_tasks, int group, int threads);
// The query-key pairs of a part that are visible (each costs 2 hs multiply-adds a head forward).
int64_t attention_part_pairs(const AttentionPart& p);
template <class T>
void attention_inference(T* out, const T* qkv, int T_, int q0, int C, int NH, int NKV);

// RoPE in place; `inverse` rotates by minus the angle (the backward).
template <class T>
void rope(T* qkv, const float* cos_sin, int B, int T_, int NH, int NKV, int hs, int pos0,
          bool inverse);
template <class T>
void swiglu_forward(T* out, const T* gate_up, int64_t N, int F);
template <class T>
void swiglu_backward(T* d_gate_up, const T* dout, const T* gate_up, int64_t N, int F);
template <class T>
void dropout(T* x, int64_t n, float p, uint64_t seed, int64_t offset);

template <class T>
void gelu_forward(T* out, const T* inp, int64_t n);
template <class T>
void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n);
template <class T>
void residual_forward(T* out, const T* a, const T* b, int64_t n);

template <class T>
void crossentropy_stats(T* rowmax, T* sumexp, T* target_logit, const T* logits,
                        const int32_t* targets, int64_t N, VocabSlice v);
template <class T>
void crossentropy_rebase(T* rowmax, T* sumexp, const T* group_max, int64_t N);
template <class T>
double crossentropy_loss(T* losses, const T* rowmax, const T* sumexp, const T* target_logit,
                         int64_t N);
template <class T>
void crossentropy_backward(T* logits, const T* rowmax, const T* sumexp, const int32_t* targets,
                           float dloss, int64_t N, VocabSlice v);
template <class T>
void crossentropy_stats_and_backward(T* rowmax, T* sumexp, T* target_logit, T* logits,
                                     const int32_t* targets, float dloss, int64_t N, VocabSlice v);

template <class T>
double sum_squares(const T* x, int64_t n);
template <class T>
void adamw_update(T* param, const T* grad, T* m, T* v, int64_t n, const AdamWArgs& args);

}  // namespace trainer::cpu
