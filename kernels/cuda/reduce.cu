// Whole-buffer reductions (the gradient norm's sum of squares, the mean loss) and AdamW.
#include <cmath>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_types.cuh"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {
namespace {

constexpr int kThreads = 256;

__device__ double warp_sum_double(double x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Sum over the block (kThreads threads) in a fixed order; valid in thread 0.
__device__ double block_sum_double(double x) {
  __shared__ double warps[kThreads / 32];
  x = warp_sum_double(x);
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = x;
  __syncthreads();
  double total = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kThreads / 32; w++) total += warps[w];
  return total;
}

// kSumBlocks blocks, each a fixed grid-stride share of the buffer: the same partition, and so
// the same result, on every run.
template <class T, bool kSquares>
__global__ void partial_sums_kernel(double* partials, const T* x, int64_t n) {
  double acc = 0;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < n;
       i += int64_t(kSumBlocks) * kThreads) {
    const double v = load(x[i]);
    acc += kSquares ? v * v : v;
  }
  const double total = block_sum_double(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

template <class T>
__global__ void partial_squares_ranges_kernel(double* partials, const T* x, const Range* ranges,
                                              int count) {
  double acc = 0;
  for (int r = 0; r < count; r++) {
    const T* base = x + ranges[r].offset;
    const int64_t n = ranges[r].count;
    for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < n;
         i += int64_t(kSumBlocks) * kThreads) {
      const double v = load(base[i]);
      acc += v * v;
    }
  }
  const double total = block_sum_double(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void finish_sum_kernel(double* result, const double* partials, double scale) {
  double acc = 0;
  for (int i = threadIdx.x; i < kSumBlocks; i += kThreads) acc += partials[i];
  const double total = block_sum_double(acc);
  if (threadIdx.x == 0) *result = total * scale;
}

template <class G>
__global__ void adamw_kernel(float* param, const G* grad, float* m, float* v, int64_t n,
                             AdamWConsts<float> c) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float p = param[i], mi = m[i];
    if (c.sgd) {  // v is neither read nor written, as on the CPU
      sgd_element(p, load(grad[i]), mi, c);
    } else {
      float vi = v[i];
      adamw_element(p, load(grad[i]), mi, vi, c, [](float x) { return sqrtf(x); });
      v[i] = vi;
    }
    param[i] = p;
    m[i] = mi;
  }
}

}  // namespace

void sum_values(cudaStream_t s, DPtr x, int64_t n, double* partials, double* result, double scale,
                bool squares) {
  dispatch(x.dtype, [&](auto tag) {
    using X = decltype(tag);
    if (squares)
      partial_sums_kernel<X, true><<<kSumBlocks, kThreads, 0, s>>>(partials, typed<X>(x), n);
    else
      partial_sums_kernel<X, false><<<kSumBlocks, kThreads, 0, s>>>(partials, typed<X>(x), n);
  });
  finish_sum_kernel<<<1, kThreads, 0, s>>>(result, partials, scale);
  CUDA_CHECK_LAUNCH("sum_values");
}

void sum_squares_ranges(cudaStream_t s, DPtr x, const Range* ranges, int count, double* partials,
                        double* result) {
  dispatch(x.dtype, [&](auto tag) {
    using X = decltype(tag);
    partial_squares_ranges_kernel<X>
        <<<kSumBlocks, kThreads, 0, s>>>(partials, typed<X>(x), ranges, count);
  });
  finish_sum_kernel<<<1, kThreads, 0, s>>>(result, partials, 1.0);
  CUDA_CHECK_LAUNCH("sum_squares_ranges");
}

void adamw_update(cudaStream_t s, DPtr param, DPtr grad, DPtr m, DPtr v, int64_t n,
                  const AdamWArgs& a) {
  if (n <= 0) return;
  // The bias corrections in float, as the CPU backend computes them.
  const AdamWConsts<float> c = adamw_consts<float>(a);
  float *p = f32(param), *pm = f32(m), *pv = f32(v);
  dispatch(grad.dtype, [&](auto tag) {
    using G = decltype(tag);
    adamw_kernel<G>
        <<<blocks_for(n, kThreads, 4096), kThreads, 0, s>>>(p, typed<G>(grad), pm, pv, n, c);
  });
  CUDA_CHECK_LAUNCH("adamw_update");
}

}  // namespace trainer::cuda
