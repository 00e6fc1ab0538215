// Causal grouped-query attention through GEMMs. Forward splits work over (batch, query head)
// pairs across threads (OpenBLAS runs single-threaded inside a parallel region), and each head
// is processed in blocks of rows so that the GEMMs skip the masked upper triangle beyond each
// block. Backward splits over (batch, key/value head): the thread owning a key/value head runs
// all the query heads of its group and accumulates their dK and dV, so no two threads write one
// gradient.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/fast_math.h"

namespace trainer::cpu {
namespace {

constexpr int kBlock = 64;

// Where the heads sit in a row of qkv: NH query heads, then NKV key heads, then NKV value heads.
struct QkvLayout {
  int hs, group;                // head size; query heads per key/value head
  int64_t width, keys, values;  // row length; columns where the key and value heads start
  QkvLayout(int C, int NH, int NKV)
      : hs(C / NH),
        group(NH / NKV),
        width(C + 2 * int64_t(NKV) * (C / NH)),
        keys(C),
        values(C + int64_t(NKV) * (C / NH)) {}
  int64_t query_column(int h) const { return int64_t(h) * hs; }
  int64_t key_column(int h) const { return keys + int64_t(h / group) * hs; }
  int64_t value_column(int h) const { return values + int64_t(h / group) * hs; }
};

}  // namespace

template <class T>
void attention_forward(T* out, T* att, const T* qkv, int B, int T_, int C, int NH, int NKV) {
  const QkvLayout l(C, NH, NKV);
  const int hs = l.hs;
  const int64_t W = l.width;
  const T scale = T(1) / std::sqrt(T(hs));
#pragma omp parallel for schedule(static)
  for (int bh = 0; bh < B * NH; bh++) {
    const int b = bh / NH, h = bh % NH;
    const T* row0 = qkv + int64_t(b) * T_ * W;
    const T *Q = row0 + l.query_column(h), *K = row0 + l.key_column(h),
            *V = row0 + l.value_column(h);
    T* A = att + int64_t(bh) * T_ * T_;
    T* O = out + int64_t(b) * T_ * C + int64_t(h) * hs;
    for (int r0 = 0; r0 < T_; r0 += kBlock) {
      const int r1 = std::min(T_, r0 + kBlock);
      gemm<T>(false, true, r1 - r0, r1, hs, scale, Q + r0 * W, W, K, W, T(0), A + int64_t(r0) * T_,
              T_);
      for (int i = r0; i < r1; i++) {
        T* row = A + int64_t(i) * T_;
        T mx = row[0];
#pragma omp simd reduction(max : mx)
        for (int j = 1; j <= i; j++) mx = std::max(mx, row[j]);
        T sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j <= i; j++) {
          row[j] = fast_exp(row[j] - mx);
          sum += row[j];
        }
        const T inv = T(1) / sum;
#pragma omp simd
        for (int j = 0; j <= i; j++) row[j] *= inv;
        std::fill(row + i + 1, row + T_, T(0));
      }
      gemm<T>(false, false, r1 - r0, hs, r1, T(1), A + int64_t(r0) * T_, T_, V, W, T(0),
              O + int64_t(r0) * C, C);
    }
  }
}

template <class T>
void attention_backward(T* dqkv, T* datt, const T* dout, const T* qkv, const T* att, int B, int T_,
                        int C, int NH, int NKV) {
  const QkvLayout l(C, NH, NKV);
  const int hs = l.hs;
  const int64_t W = l.width;
  const T scale = T(1) / std::sqrt(T(hs));
#pragma omp parallel for schedule(static)
  for (int bkv = 0; bkv < B * NKV; bkv++) {
    const int b = bkv / NKV, kv = bkv % NKV;
    const int64_t row0 = int64_t(b) * T_ * W;
    const T *K = qkv + row0 + l.keys + int64_t(kv) * hs,
            *V = qkv + row0 + l.values + int64_t(kv) * hs;
    T *dK = dqkv + row0 + l.keys + int64_t(kv) * hs,
      *dV = dqkv + row0 + l.values + int64_t(kv) * hs;
    for (int g = 0; g < l.group; g++) {
      const int h = kv * l.group + g;
      const int64_t bh = int64_t(b) * NH + h;
      const T* Q = qkv + row0 + l.query_column(h);
      T* dQ = dqkv + row0 + l.query_column(h);
      const T* A = att + bh * T_ * T_;
      T* dA = datt + bh * T_ * T_;
      const T* dO = dout + int64_t(b) * T_ * C + int64_t(h) * hs;
      // The group's first query head overwrites dK and dV, the others add to them.
      const T accumulate = g == 0 ? T(0) : T(1);

      for (int r0 = 0; r0 < T_; r0 += kBlock) {
        const int r1 = std::min(T_, r0 + kBlock);
        // datt = dout @ V^T for this row block; then softmax backward in place. Entries above
        // the diagonal inside the block are zeroed because the GEMMs below read them.
        gemm<T>(false, true, r1 - r0, r1, hs, T(1), dO + int64_t(r0) * C, C, V, W, T(0),
                dA + int64_t(r0) * T_, T_);
        for (int i = r0; i < r1; i++) {
          const T* a = A + int64_t(i) * T_;
          T* d = dA + int64_t(i) * T_;
          T dot = 0;
#pragma omp simd reduction(+ : dot)
          for (int j = 0; j <= i; j++) dot += a[j] * d[j];
#pragma omp simd
          for (int j = 0; j <= i; j++) d[j] = a[j] * (d[j] - dot);
          std::fill(d + i + 1, d + r1, T(0));
        }
        // dQ = scale * dpre @ K over the causal prefix.
        gemm<T>(false, false, r1 - r0, hs, r1, scale, dA + int64_t(r0) * T_, T_, K, W, T(0),
                dQ + r0 * W, W);
      }
      for (int c0 = 0; c0 < T_; c0 += kBlock) {
        const int c1 = std::min(T_, c0 + kBlock);
        // Key/value j only receives gradient from queries i >= j.
        gemm<T>(true, false, c1 - c0, hs, T_ - c0, scale, dA + int64_t(c0) * T_ + c0, T_,
                Q + c0 * W, W, accumulate, dK + c0 * W, W);
        gemm<T>(true, false, c1 - c0, hs, T_ - c0, T(1), A + int64_t(c0) * T_ + c0, T_,
                dO + int64_t(c0) * C, C, accumulate, dV + c0 * W, W);
      }
    }
  }
}

// Straight loops, one (query, head) pair at a time: generation runs one new query per step,
// where GEMM blocking gains nothing.
template <class T>
void attention_inference(T* out, const T* qkv, int T_, int q0, int C, int NH, int NKV) {
  const QkvLayout l(C, NH, NKV);
  const int hs = l.hs;
  const int64_t W = l.width;
  const T scale = T(1) / std::sqrt(T(hs));
  const int queries = T_ - q0;
#pragma omp parallel
  {
    std::vector<T> p(size_t(std::max(T_, 1)));  // one query's scores, then probabilities
#pragma omp for schedule(static)
    for (int64_t ih = 0; ih < int64_t(queries) * NH; ih++) {
      const int i = q0 + int(ih / NH), h = int(ih % NH);
      const T* q = qkv + int64_t(i) * W + l.query_column(h);
      T mx = -INFINITY;
      for (int j = 0; j <= i; j++) {
        const T* k = qkv + int64_t(j) * W + l.key_column(h);
        T dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int e = 0; e < hs; e++) dot += q[e] * k[e];
        p[j] = dot * scale;
        mx = std::max(mx, p[j]);
      }
      T sum = 0;
      for (int j = 0; j <= i; j++) sum += (p[j] = fast_exp(p[j] - mx));
      T* o = out + int64_t(i - q0) * C + int64_t(h) * hs;
      std::fill(o, o + hs, T(0));
      for (int j = 0; j <= i; j++) {
        const T* v = qkv + int64_t(j) * W + l.value_column(h);
        const T w = p[j] / sum;
#pragma omp simd
        for (int e = 0; e < hs; e++) o[e] += w * v[e];
      }
    }
  }
}

#define INSTANTIATE(T)                                                                          \
  template void attention_forward<T>(T*, T*, const T*, int, int, int, int, int);                \
  template void attention_backward<T>(T*, T*, const T*, const T*, const T*, int, int, int, int, \
                                      int);                                                     \
  template void attention_inference<T>(T*, const T*, int, int, int, int, int);
INSTANTIATE(float)
INSTANTIATE(double)

}  // namespace trainer::cpu
