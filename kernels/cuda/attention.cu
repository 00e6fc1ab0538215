// The row and layout kernels of the blocked attention (kernels/blocked_attention.h; its GEMMs
// are cuBLASLt's), and attention over a key/value cache for generation. Rows are one warp each;
// reductions have a fixed order.
#include <cfloat>
#include <stdexcept>
#include <string>

#include "kernels/blocked_attention.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_types.cuh"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

// A head-major tensor's layout, (B, NK, T, group, hs), from a token-major (B, T, width) one.
struct Layout {
  int T, hs, NK, group;
  int64_t width, column0;
};

// Element e of the head-major tensor to (kToHeads) or from its place in the token-major one.
template <bool kToHeads, class D, class S>
__global__ void relayout_kernel(D* dst, const S* src, int64_t n, Layout l) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = token_major_index(e, l.T, l.hs, l.NK, l.group, l.width, l.column0);
    if (kToHeads)
      dst[e] = store<D>(load(src[t]));
    else
      dst[t] = store<D>(load(src[e]));
  }
}

// One warp per row of the block: its log-sum-exp over the visible keys, then the probabilities.
template <class P>
__global__ void softmax_rows_kernel(P* p, float* lse, const float* s, int64_t rows, QueryBlock blk,
                                    int T) {
  const int64_t r = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const int i = query_of_row(r, blk), L = blk.keys();
  const int64_t row = r * blk.stride();
  const float* x = s + row;
  float mx = -FLT_MAX;
  for (int j = lane; j <= i; j += 32) mx = fmaxf(mx, x[j]);
  mx = warp_max(mx);
  float sum = 0;
  for (int j = lane; j <= i; j += 32) sum += expf(x[j] - mx);
  const float l = mx + logf(warp_sum(sum));
  if (lane == 0) lse[head_of_row(r, blk) * T + i] = l;
  for (int j = lane; j < L; j += 32) p[row + j] = store<P>(j <= i ? expf(x[j] - l) : 0.0f);
}

// Elementwise over the block's rows x L entries of p (rows stride() apart), from x (same layout)
// and a per-row statistic: the probabilities again from the kept lse (x the scores), or, with
// kGrad, P becoming dS = P (dP - D_i) (x holding dP). 0 where j > i.
template <bool kGrad, class P>
__global__ void block_entries_kernel(P* p, const float* x, const float* row_stat, int64_t n,
                                     QueryBlock blk, int T) {
  const int L = blk.keys();
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / L, at = r * blk.stride() + e % L;
    const int j = int(e % L), i = query_of_row(r, blk);
    const float stat = row_stat[head_of_row(r, blk) * T + i];
    const float v = kGrad ? load(p[at]) * (x[at] - stat) : expf(x[at] - stat);
    p[at] = store<P>(j <= i ? v : 0.0f);
  }
}

// One warp per (b, h, t): the dot product of dout and out over the head's columns.
template <class X>
__global__ void row_dots_kernel(float* D, const X* dout, const X* out, int64_t rows, Layout l) {
  const int64_t r = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const int64_t at = token_major_index(r * l.hs, l.T, l.hs, l.NK, l.group, l.width, 0);
  float sum = 0;
  for (int d = lane; d < l.hs; d += 32) sum += load(dout[at + d]) * load(out[at + d]);
  sum = warp_sum(sum);
  if (lane == 0) D[r] = sum;
}

// Attention over a key/value cache: one warp per (query, head), walking the keys in order with
// an online softmax (running maximum m, normaliser l, and the output rescaled when m grows), so
// nothing of size T is stored. Lane `lane` holds output columns lane, lane + 32, ... of the head.
constexpr int kMaxColumnsPerLane = 8;  // head sizes up to 256

template <class X>
__global__ void attention_inference_kernel(X* out, const X* qkv, int T, int q0, int C, int NH,
                                           int NKV) {
  const int64_t r = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= int64_t(T - q0) * NH) return;
  const int i = q0 + int(r / NH), h = int(r % NH);
  const int hs = C / NH;
  const int64_t width = C + 2 * int64_t(NKV) * hs;
  const int64_t key = C + int64_t(h / (NH / NKV)) * hs, value = key + int64_t(NKV) * hs;
  const float scale = rsqrtf(float(hs));
  float q[kMaxColumnsPerLane], o[kMaxColumnsPerLane];
  for (int c = 0; c < kMaxColumnsPerLane; c++) {
    const int d = lane + 32 * c;
    q[c] = d < hs ? load(qkv[int64_t(i) * width + int64_t(h) * hs + d]) : 0.0f;
    o[c] = 0.0f;
  }
  float m = -FLT_MAX, l = 0.0f;
  for (int j = 0; j <= i; j++) {
    const X* k = qkv + int64_t(j) * width + key;
    float dot = 0.0f;
    for (int c = 0; c < kMaxColumnsPerLane; c++) {
      const int d = lane + 32 * c;
      if (d < hs) dot += q[c] * load(k[d]);
    }
    const float s = warp_sum(dot) * scale;  // every lane gets the same sum
    const float m_new = fmaxf(m, s);
    const float rescale = expf(m - m_new), p = expf(s - m_new);
    l = l * rescale + p;
    const X* v = qkv + int64_t(j) * width + value;
    for (int c = 0; c < kMaxColumnsPerLane; c++) {
      const int d = lane + 32 * c;
      o[c] = o[c] * rescale + (d < hs ? p * load(v[d]) : 0.0f);
    }
    m = m_new;
  }
  X* dst = out + int64_t(i - q0) * C + int64_t(h) * hs;
  for (int c = 0; c < kMaxColumnsPerLane; c++) {
    const int d = lane + 32 * c;
    if (d < hs) dst[d] = store<X>(o[c] / l);
  }
}

Layout layout(const AttentionShape& s, HeadSide side, int64_t width, int64_t column0) {
  const int group = side == HeadSide::queries ? s.group() : 1;
  return {s.T, s.hs(), s.NKV, group, width, column0};
}
unsigned row_blocks(int64_t rows) {
  return unsigned((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

template <bool kGrad>
void block_entries(cudaStream_t st, DPtr p, DPtr x, DPtr row_stat, QueryBlock blk,
                   const AttentionShape& sh) {
  const int64_t n = sh.heads() * blk.nq * blk.keys();
  if (n == 0) return;
  dispatch(p.dtype, [&](auto tag) {
    using P = decltype(tag);
    block_entries_kernel<kGrad, P><<<blocks_for(n, kThreads), kThreads, 0, st>>>(
        typed<P>(p), f32(x), f32(row_stat), n, blk, sh.T);
  });
  CUDA_CHECK_LAUNCH(kGrad ? "attention_dsoftmax_rows" : "attention_probs_rows");
}

template <bool kToHeads>
void relayout(cudaStream_t st, DPtr dst, DPtr src, HeadSide side, int64_t width, int64_t column0,
              const AttentionShape& s) {
  const int64_t n = side == HeadSide::queries ? s.elems() : s.kv_elems();
  if (n == 0) return;
  dispatch(dst.dtype, [&](auto d) {
    dispatch(src.dtype, [&](auto x) {
      using D = decltype(d);
      using S = decltype(x);
      relayout_kernel<kToHeads, D, S><<<blocks_for(n, kThreads), kThreads, 0, st>>>(
          typed<D>(dst), typed<S>(src), n, layout(s, side, width, column0));
    });
  });
  CUDA_CHECK_LAUNCH(kToHeads ? "attention_to_heads" : "attention_from_heads");
}

}  // namespace

void attention_to_heads(cudaStream_t st, DPtr dst, HeadSide side, DPtr src, int64_t width,
                        int64_t column0, const AttentionShape& s) {
  relayout<true>(st, dst, src, side, width, column0, s);
}

void attention_from_heads(cudaStream_t st, DPtr dst, int64_t width, int64_t column0, DPtr src,
                          HeadSide side, const AttentionShape& s) {
  relayout<false>(st, dst, src, side, width, column0, s);
}

void attention_softmax_rows(cudaStream_t st, DPtr p, DPtr lse, DPtr s, QueryBlock blk,
                            const AttentionShape& sh) {
  const int64_t rows = sh.heads() * blk.nq;
  if (rows == 0) return;
  dispatch(p.dtype, [&](auto tag) {
    using P = decltype(tag);
    softmax_rows_kernel<P>
        <<<row_blocks(rows), kThreads, 0, st>>>(typed<P>(p), f32(lse), f32(s), rows, blk, sh.T);
  });
  CUDA_CHECK_LAUNCH("attention_softmax_rows");
}

void attention_probs_rows(cudaStream_t st, DPtr p, DPtr s, DPtr lse, QueryBlock blk,
                          const AttentionShape& sh) {
  block_entries<false>(st, p, s, lse, blk, sh);
}

void attention_dsoftmax_rows(cudaStream_t st, DPtr p, DPtr dp, DPtr D, QueryBlock blk,
                             const AttentionShape& sh) {
  block_entries<true>(st, p, dp, D, blk, sh);
}

void attention_row_dots(cudaStream_t st, DPtr D, DPtr dout, DPtr out, const AttentionShape& s) {
  const int64_t rows = s.heads() * s.T;
  if (rows == 0) return;
  if (dout.dtype != out.dtype)
    throw std::invalid_argument("attention_row_dots: dout and out must have one dtype");
  dispatch(dout.dtype, [&](auto tag) {
    using X = decltype(tag);
    row_dots_kernel<X><<<row_blocks(rows), kThreads, 0, st>>>(
        f32(D), typed<X>(dout), typed<X>(out), rows, Layout{s.T, s.hs(), s.NH, 1, s.C, 0});
  });
  CUDA_CHECK_LAUNCH("attention_row_dots");
}

void attention_inference(cudaStream_t st, DPtr out, DPtr qkv, int T, int q0, int C, int NH,
                         int NKV) {
  const int64_t rows = int64_t(T - q0) * NH;
  if (rows <= 0) return;
  if (C / NH > 32 * kMaxColumnsPerLane)
    throw std::invalid_argument("attention_inference: head size above " +
                                std::to_string(32 * kMaxColumnsPerLane));
  dispatch(out.dtype, [&](auto tag) {
    using X = decltype(tag);
    attention_inference_kernel<X>
        <<<row_blocks(rows), kThreads, 0, st>>>(typed<X>(out), typed<X>(qkv), T, q0, C, NH, NKV);
  });
  CUDA_CHECK_LAUNCH("attention_inference");
}

}  // namespace trainer::cuda
