#pragma once
// The two 16-bit float formats, as storage: bf16 (8 exponent bits, 7 mantissa bits: fp32's range)
// and IEEE fp16 (5 exponent bits, 10 mantissa bits). Conversions from fp32 round to nearest,
// ties to even, as GPUs do; fp16 overflows to infinity and keeps subnormals; NaN stays NaN.
#include <cstdint>

#include "kernels/shared_math.h"

namespace trainer {

struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

inline float to_float(bf16 h) {
  return bits_float(uint32_t(h.bits) << 16);
}

inline bf16 to_bf16(float x) {
  return {bf16_bits_nearest(float_bits(x))};
}

// bf16 with stochastic rounding: rounds up with probability equal to the dropped fraction, so
// that the expected value is x (small updates to large weights are not always lost). `random`
// supplies 16 uniform bits.
inline bf16 to_bf16_stochastic(float x, uint32_t random) {
  return {bf16_bits_stochastic(float_bits(x), random)};
}

inline float to_float(f16 h) {
  const uint32_t sign = uint32_t(h.bits & 0x8000u) << 16;
  const uint32_t exponent = (h.bits >> 10) & 0x1fu, mantissa = h.bits & 0x3ffu;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {  // zero or subnormal: mantissa x 2^-24, exact in fp32
    const float magnitude = float(mantissa) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

inline f16 to_f16(float x) {
  const uint32_t u = float_bits(x);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return {uint16_t(sign | 0x7e00u)};   // NaN
  if (a >= 0x477ff000u) return {uint16_t(sign | 0x7c00u)};  // rounds to >= 65536: infinity
  if (a < 0x38800000u) {  // below the smallest normal 2^-14: a multiple of 2^-24, rounded
    // Adding 0.5 (2^-1) aligns the binary point so that the float addition rounds the value
    // to a multiple of 2^-24 with fp32's own round-to-nearest-even.
    const float shifted = bits_float(a) + 0.5f;
    return {uint16_t(sign | (float_bits(shifted) - 0x3f000000u))};
  }
  const uint32_t lsb = (a >> 13) & 1;
  return {uint16_t(sign | ((a - 0x38000000u + 0xfffu + lsb) >> 13))};
}

}  // namespace trainer
