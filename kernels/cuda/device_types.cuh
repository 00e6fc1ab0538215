#pragma once
// Loads and stores of the three storage types on the device: every kernel computes in fp32 and
// rounds when it stores, exactly as the CPU backend's staging does. bf16 rounds through the
// same bit-level function as the CPU (kernels/shared_math.h), so the two agree bitwise; fp16
// through CUDA's round-to-nearest-even intrinsic (the same IEEE rounding as kernels/half.h).
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/half.h"
#include "kernels/shared_math.h"

namespace trainer::cuda {

__device__ __forceinline__ float load(float x) {
  return x;
}
__device__ __forceinline__ float load(bf16 x) {
  return __uint_as_float(uint32_t(x.bits) << 16);
}
__device__ __forceinline__ float load(f16 x) {
  return __half2float(__ushort_as_half(x.bits));
}

template <class T>
__device__ __forceinline__ T store(float x);
template <>
__device__ __forceinline__ float store<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ bf16 store<bf16>(float x) {
  return bf16{bf16_bits_nearest(__float_as_uint(x))};
}
template <>
__device__ __forceinline__ f16 store<f16>(float x) {
  return f16{__half_as_ushort(__float2half_rn(x))};
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
  for (int offset = 16; offset > 0; offset /= 2)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// Grid size for n elements, at most `cap` blocks (grid-stride loops do the rest).
inline unsigned blocks_for(int64_t n, int threads, int64_t cap = 65535) {
  const int64_t b = (n + threads - 1) / threads;
  return unsigned(b < 1 ? 1 : b > cap ? cap : b);
}

}  // namespace trainer::cuda
