#pragma once
// exp and tanh for the CPU kernels' hot loops. libm's expf/tanhf are scalar calls that the
// compiler cannot vectorise; these are branch-free so that `omp simd` loops become AVX-512
// code. float: Cephes' expf polynomial (relative error ~2e-7, i.e. a few ulp); double: libm,
// so that the f64 finite-difference checks keep full precision.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace trainer::cpu {

inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  // n = round(x / ln2) by the 1.5 * 2^23 trick (vectorisable, no libm call).
  const float shifter = 12582912.0f;
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  // r = x - n ln2, with ln2 split in two for precision.
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float er = p * r * r + r + 1.0f;
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

}  // namespace trainer::cpu
