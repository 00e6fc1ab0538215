#pragma once
// exp and tanh for the CPU kernels' hot loops. libm's expf/tanhf are scalar calls that the
// compiler cannot vectorise; these are branch-free so that `omp simd` loops become AVX-512
// code. float: Cephes' expf polynomial (relative error ~2e-7, i.e. a few ulp); double: libm,
// so that the f64 finite-difference checks keep full precision.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/simd.h"

namespace trainer::cpu {
inline namespace TRAINER_SIMD_NAMESPACE {  // see simd.h

// exp(x) / 2^n for n = round(x / ln2): Cephes' expf polynomial in r = x - n ln2 (ln2 split in
// two for precision), for a float or a vector of floats (F{} + c is c in every lane).
template <class F>
[[gnu::always_inline]] inline F exp_over_power_of_two(F x, F n) {
  const F r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// Always inlined: a call left in a loop (GCC's size heuristics did so once a helper wrapped the
// loop) keeps the loop scalar, and W-L's attention took twice as long.
[[gnu::always_inline]] inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  // n = round(x / ln2) by the 1.5 * 2^23 trick (vectorisable, no libm call).
  const float shifter = 12582912.0f;
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  const float er = exp_over_power_of_two(x, n);
  const float two_n = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return er * two_n;
}
inline double fast_exp(double x) {
  return std::exp(x);
}

// tanh(u) = 1 - 2 / (exp(2u) + 1): saturates correctly at both ends.
inline float fast_tanh(float u) {
  return 1.0f - 2.0f / (fast_exp(2.0f * u) + 1.0f);
}
inline double fast_tanh(double u) {
  return std::tanh(u);
}

// fast_exp of every lane of a vector of floats, the same bits (tested), written in vector code
// for the softmaxes' rows (below): `omp simd` over fast_exp had GCC blend each lane's clamps
// through masks (1024-wide rows: 0.38 ns an element against 0.24 here).
[[gnu::always_inline]] inline Simd<float>::Vec exp_lanes(Simd<float>::Vec x) {
  using V = Simd<float>::Vec;
  x = x < -87.0f ? V{} - 87.0f : x;
  x = x > 88.0f ? V{} + 88.0f : x;
  const float shifter = 12582912.0f;
  const V n = (x * 1.44269504088896341f + shifter) - shifter;
  const V er = exp_over_power_of_two(x, n);
#if defined(__AVX512F__)
  // er * 2^n by vscalefps, one instruction for fast_exp's three. The mask form with every lane
  // set: GCC 12's plain form reads an "undefined" vector that -Werror=uninitialized rejects.
  return V(_mm512_mask_scalef_ps(__m512(er), 0xffff, __m512(er), __m512(n)));
#else
  typedef int32_t Bits __attribute__((vector_size(kVectorBytes)));
  const Bits bits = (__builtin_convertvector(n, Bits) + 127) << 23;
  V two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return er * two_n;
#endif
}

// Calls f(j, m) for the vectors of floats that cover [0, n): m = lanes, then fewer at a partial
// last one (f loads and stores through Simd's load_first/store_first).
template <class F>
[[gnu::always_inline]] inline void for_float_vectors(int64_t n, F&& f) {
  constexpr int L = Simd<float>::lanes;
  int64_t j = 0;
  for (; j + L <= n; j += L) f(j, L);
  if (j < n) f(j, int(n - j));
}

// The row operations of the softmaxes (attention, cross-entropy), written in the forms GCC turns
// into vector code, or for float in vector code of our own. Two forms `omp simd` left scalar,
// measured on W-L's attention rows: `std::max` in a `reduction(max)` loop (0.57 ns an element
// against 0.04 for the comparison below), and an exponential stored and summed in one loop (the
// whole row in scalar code: the forward attention's softmax took as long as its two GEMMs); the
// float rows below do that store and sum in one pass, in explicit vectors.
template <class T>
T row_max(const T* x, int64_t n) {  // -inf for an empty row
  T mx = -INFINITY;
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < n; j++) mx = mx > x[j] ? mx : x[j];
  return mx;
}
// x = exp(x - shift); returns the sum of the new x.
template <class T>
T exp_shifted(T* x, int64_t n, T shift) {
  if constexpr (std::is_same_v<T, float>) {
    using S = Simd<float>;
    S::Vec sum{};
    for_float_vectors(n, [&](int64_t j, int m) {
      const S::Vec e = exp_lanes(S::load_first(x + j, m) - shift);
      S::store_first(x + j, e, m);
      sum += S::keep_first(e, m);
    });
    return S::sum(sum);
  }
#pragma omp simd
  for (int64_t j = 0; j < n; j++) x[j] = fast_exp(x[j] - shift);
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; j++) sum += x[j];
  return sum;
}
// The sum of exp(x - shift) over a row, x unchanged.
template <class T>
T sum_exp_shifted(const T* x, int64_t n, T shift) {
  if constexpr (std::is_same_v<T, float>) {
    using S = Simd<float>;
    S::Vec sum{};
    for_float_vectors(n, [&](int64_t j, int m) {
      sum += S::keep_first(exp_lanes(S::load_first(x + j, m) - shift), m);
    });
    return S::sum(sum);
  }
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; j++) sum += fast_exp(x[j] - shift);
  return sum;
}
template <class T>
void scale_row(T* x, int64_t n, T factor) {
#pragma omp simd
  for (int64_t j = 0; j < n; j++) x[j] *= factor;
}
template <class T>
T dot_row(const T* a, const T* b, int64_t n) {
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; j++) sum += a[j] * b[j];
  return sum;
}
// Softmax backward of one row from its scores and log-sum-exp (attention's backward, which keeps
// no probabilities), in one pass: p = exp(s - lse) in place of s, and d = p (d - dot) in place
// of d (dot = p . d over the row).
template <class T>
void softmax_backward_from_scores(T* s, T* d, int64_t n, T lse, T dot) {
  if constexpr (std::is_same_v<T, float>) {
    using S = Simd<float>;
    for_float_vectors(n, [&](int64_t j, int m) {
      const S::Vec p = exp_lanes(S::load_first(s + j, m) - lse);
      S::store_first(s + j, p, m);
      S::store_first(d + j, p * (S::load_first(d + j, m) - dot), m);
    });
    return;
  }
#pragma omp simd
  for (int64_t j = 0; j < n; j++) {
    const T p = fast_exp(s[j] - lse);
    s[j] = p;
    d[j] = p * (d[j] - dot);
  }
}

}  // namespace TRAINER_SIMD_NAMESPACE
}  // namespace trainer::cpu
