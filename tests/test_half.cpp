// The 16-bit formats against independent references, for every one of the 65536 bit patterns:
// fp16 against the compiler's IEEE _Float16 conversions, bf16 against the nearest value found
// in double precision (ties to the even pattern).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>

#include "kernels/half.h"

namespace trainer {
namespace {

bool is_nan16(uint16_t bits, int exponent_bits) {
  const int mantissa_bits = 15 - exponent_bits;
  const uint16_t exp_mask = uint16_t(((1u << exponent_bits) - 1) << mantissa_bits);
  return (bits & exp_mask) == exp_mask && (bits & ((1u << mantissa_bits) - 1));
}

// Floats that probe the rounding of a pattern: the value, the midpoints to its neighbours, and
// the floats just either side of those midpoints.
std::vector<float> probes(double value, double below, double above) {
  std::vector<float> out = {float(value)};
  for (double mid : {(value + below) / 2, (value + above) / 2}) {
    const float m = float(mid);  // exact: midpoints of 16-bit neighbours fit in fp32
    out.push_back(m);
    out.push_back(std::nextafter(m, -INFINITY));
    out.push_back(std::nextafter(m, INFINITY));
  }
  return out;
}

TEST(Half, Fp16MatchesIeeeConversionsForAllPatterns) {
  for (uint32_t bits = 0; bits < 65536; bits++) {
    const f16 h{uint16_t(bits)};
    const _Float16 ref = std::bit_cast<_Float16>(uint16_t(bits));
    const float value = to_float(h);
    if (is_nan16(uint16_t(bits), 5)) {
      ASSERT_TRUE(std::isnan(value)) << bits;
      ASSERT_TRUE(is_nan16(to_f16(value).bits, 5)) << bits;
      continue;
    }
    ASSERT_EQ(std::bit_cast<uint32_t>(value), std::bit_cast<uint32_t>(float(ref))) << bits;
    ASSERT_EQ(to_f16(value).bits, bits) << "round trip " << bits;
    if (std::isinf(value)) continue;
    const double below = std::bit_cast<_Float16>(uint16_t(bits - 1)),
                 above = std::bit_cast<_Float16>(uint16_t(bits + 1));
    for (float x : probes(value, (bits & 0x7fff) ? below : -double(value), above)) {
      const uint16_t want = std::bit_cast<uint16_t>(_Float16(x));
      ASSERT_EQ(to_f16(x).bits, want) << "x = " << x << " near pattern " << bits;
    }
  }
  EXPECT_EQ(to_f16(65519.99f).bits, 0x7bffu);  // 65504, the largest finite
  EXPECT_EQ(to_f16(65520.0f).bits, 0x7c00u);   // the tie rounds to even: infinity
  EXPECT_EQ(to_f16(1e-8f).bits, 0x0000u);      // below half the smallest subnormal
  EXPECT_EQ(to_f16(-3e-8f).bits, 0x8001u);     // -2^-24
}

// The nearest bf16 to x by exhaustive comparison in double: the reference for to_bf16.
uint16_t nearest_bf16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint16_t down = uint16_t(u >> 16);  // truncation: the neighbour towards zero
  const uint16_t up = uint16_t(down + 1);   // the neighbour away from zero
  const double d_down = std::abs(double(x) - to_float(bf16{down}));
  const double up_value = to_float(bf16{up});  // may be infinity: then always the farther
  const double d_up = std::isinf(up_value) && !std::isinf(x)
                          ? (std::abs(double(x)) >= 0x1.ffp127 ? 0.0 : INFINITY)
                          : std::abs(double(x) - up_value);
  if (d_down < d_up) return down;
  if (d_up < d_down) return up;
  return (down & 1) ? up : down;
}

TEST(Half, Bf16RoundsToNearestEvenForAllPatterns) {
  for (uint32_t bits = 0; bits < 65536; bits++) {
    const float value = to_float(bf16{uint16_t(bits)});
    if (is_nan16(uint16_t(bits), 8)) {
      ASSERT_TRUE(std::isnan(to_float(to_bf16(value))));
      continue;
    }
    ASSERT_EQ(std::bit_cast<uint32_t>(value), uint32_t(bits) << 16);
    ASSERT_EQ(to_bf16(value).bits, bits) << "round trip " << bits;
    if (std::isinf(value)) continue;
    const double below = (bits & 0x7fff) ? to_float(bf16{uint16_t(bits - 1)}) : -double(value);
    const double above = to_float(bf16{uint16_t(bits + 1)});
    for (float x : probes(value, below, std::isinf(above) ? 2.0 * value - below : above)) {
      if (std::isinf(x)) continue;
      ASSERT_EQ(to_bf16(x).bits, nearest_bf16(x)) << "x = " << x << " near pattern " << bits;
    }
  }
  EXPECT_EQ(to_bf16(std::numeric_limits<float>::max()).bits, 0x7f80u);  // overflows to inf
}

// Stochastic rounding is unbiased: the mean of many roundings of x is x.
TEST(Half, Bf16StochasticRoundingIsUnbiased) {
  std::mt19937 rng(3);
  for (float x : {1.0f + 0x1p-10f, -3.14159f, 1e-3f, 12345.678f}) {
    double sum = 0;
    const int n = 200000;
    for (int i = 0; i < n; i++) sum += to_float(to_bf16_stochastic(x, rng()));
    const double ulp = std::abs(to_float(bf16{uint16_t((std::bit_cast<uint32_t>(x) >> 16) + 1)}) -
                                to_float(bf16{uint16_t(std::bit_cast<uint32_t>(x) >> 16)}));
    EXPECT_NEAR(sum / n, x, 0.01 * ulp) << x;  // 5 standard errors of the mean
  }
}

}  // namespace
}  // namespace trainer
