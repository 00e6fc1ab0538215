#pragma once
// Kernel tests' tolerances, and values stored as float, bf16 or f16 (what the CPU backend's
// kernels see) beside the same values widened to double for the naive references.
#include <gtest/gtest.h>

#include <type_traits>
#include <vector>

#include "kernels/half.h"
#include "test_util.h"

namespace trainer::test {

// fp32 has a unit roundoff of 6e-8; the longest sums in the kernel tests have a few hundred
// terms of O(1) values, so relative errors stay below 1e-5: rtol 1e-4 and a small atol for values
// that cancel to near zero.
inline constexpr double kRtol = 1e-4, kAtol = 1e-5;

struct Tolerance {
  double rtol, atol;
};

// The formats typed kernel tests run in.
using StorageTypes = ::testing::Types<float, bf16, f16>;

// 16-bit storage: the CPU backend widens the (rounded) inputs to fp32, computes, and rounds each
// output once to nearest, so an output is off from the exact value on the rounded inputs by at
// most half a unit in its last place (2^-9 relative for bf16, 2^-12 for fp16) plus fp32 error
// (~1e-6). We allow one unit, 2^-8 and 2^-11, as relative and absolute tolerances (values are
// O(1); the absolute part covers outputs that cancel to near zero). A chain of kernels (attention's
// backward reads the forward's output rounded to 16 bits) gets `chain` units.

template <class S>
inline Tolerance storage_tolerance(double chain = 1) {
  if constexpr (std::is_same_v<S, bf16>) return {0x1p-8 * chain, 0x1p-8 * chain};
  if constexpr (std::is_same_v<S, f16>) return {0x1p-11 * chain, 0x1p-11 * chain};
  return {kRtol * chain, kAtol * chain};
}

// Values stored as S (float, bf16 or f16): what the kernels see, and the same values widened.
template <class S>
inline std::vector<S> stored(const std::vector<float>& v) {
  std::vector<S> out(v.size());
  for (size_t i = 0; i < v.size(); i++) {
    if constexpr (std::is_same_v<S, bf16>)
      out[i] = to_bf16(v[i]);
    else if constexpr (std::is_same_v<S, f16>)
      out[i] = to_f16(v[i]);
    else
      out[i] = v[i];
  }
  return out;
}
template <class S>
inline std::vector<double> widened(const std::vector<S>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); i++) {
    if constexpr (std::is_same_v<S, float>)
      out[i] = v[i];
    else
      out[i] = to_float(v[i]);
  }
  return out;
}
template <class S>
inline std::vector<double> download_widened(Device& d, DPtr p, size_t n) {
  return widened(d.download<S>(p, n));
}

}  // namespace trainer::test
