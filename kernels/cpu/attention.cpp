// Causal multi-head attention through GEMMs. Work is split over (batch, head) pairs across
// threads (OpenBLAS runs single-threaded inside a parallel region), and each head is processed
// in blocks of rows so that the GEMMs skip the masked upper triangle beyond each block.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/fast_math.h"

namespace trainer::cpu {

constexpr int kBlock = 64;

template <class T>
void attention_forward(T* out, T* att, const T* qkv, int B, int T_, int C, int NH) {
  const int hs = C / NH;
  const int64_t C3 = 3 * int64_t(C);
  const T scale = T(1) / std::sqrt(T(hs));
#pragma omp parallel for schedule(static)
  for (int bh = 0; bh < B * NH; bh++) {
    const int b = bh / NH, h = bh % NH;
    const T* Q = qkv + int64_t(b) * T_ * C3 + int64_t(h) * hs;
    const T* K = Q + C;
    const T* V = Q + 2 * int64_t(C);
    T* A = att + int64_t(bh) * T_ * T_;
    T* O = out + int64_t(b) * T_ * C + int64_t(h) * hs;
    for (int r0 = 0; r0 < T_; r0 += kBlock) {
      const int r1 = std::min(T_, r0 + kBlock);
      gemm<T>(false, true, r1 - r0, r1, hs, scale, Q + r0 * C3, C3, K, C3, T(0),
              A + int64_t(r0) * T_, T_);
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
      gemm<T>(false, false, r1 - r0, hs, r1, T(1), A + int64_t(r0) * T_, T_, V, C3, T(0),
              O + int64_t(r0) * C, C);
    }
  }
}

template <class T>
void attention_backward(T* dqkv, T* datt, const T* dout, const T* qkv, const T* att, int B, int T_,
                        int C, int NH) {
  const int hs = C / NH;
  const int64_t C3 = 3 * int64_t(C);
  const T scale = T(1) / std::sqrt(T(hs));
#pragma omp parallel for schedule(static)
  for (int bh = 0; bh < B * NH; bh++) {
    const int b = bh / NH, h = bh % NH;
    const int64_t off = int64_t(b) * T_ * C3 + int64_t(h) * hs;
    const T *Q = qkv + off, *K = Q + C, *V = Q + 2 * int64_t(C);
    T *dQ = dqkv + off, *dK = dQ + C, *dV = dQ + 2 * int64_t(C);
    const T* A = att + int64_t(bh) * T_ * T_;
    T* dA = datt + int64_t(bh) * T_ * T_;
    const T* dO = dout + int64_t(b) * T_ * C + int64_t(h) * hs;

    for (int r0 = 0; r0 < T_; r0 += kBlock) {
      const int r1 = std::min(T_, r0 + kBlock);
      // datt = dout @ V^T for this row block; then softmax backward in place. Entries above
      // the diagonal inside the block are zeroed because the GEMMs below read them.
      gemm<T>(false, true, r1 - r0, r1, hs, T(1), dO + int64_t(r0) * C, C, V, C3, T(0),
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
      gemm<T>(false, false, r1 - r0, hs, r1, scale, dA + int64_t(r0) * T_, T_, K, C3, T(0),
              dQ + r0 * C3, C3);
    }
    for (int c0 = 0; c0 < T_; c0 += kBlock) {
      const int c1 = std::min(T_, c0 + kBlock);
      // Key/value j only receives gradient from queries i >= j.
      gemm<T>(true, false, c1 - c0, hs, T_ - c0, scale, dA + int64_t(c0) * T_ + c0, T_, Q + c0 * C3,
              C3, T(0), dK + c0 * C3, C3);
      gemm<T>(true, false, c1 - c0, hs, T_ - c0, T(1), A + int64_t(c0) * T_ + c0, T_,
              dO + int64_t(c0) * C, C, T(0), dV + c0 * C3, C3);
    }
  }
}

template void attention_forward<float>(float*, float*, const float*, int, int, int, int);
template void attention_forward<double>(double*, double*, const double*, int, int, int, int);
template void attention_backward<float>(float*, float*, const float*, const float*, const float*,
                                        int, int, int, int);
template void attention_backward<double>(double*, double*, const double*, const double*,
                                         const double*, int, int, int, int);

}  // namespace trainer::cpu
