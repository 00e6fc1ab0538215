// Softmax + cross-entropy over a slice of the vocabulary, one block per row. Every reduction has a
// fixed shape and order.
#include <cfloat>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_types.cuh"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {
namespace {

constexpr int kRowThreads = 512;  // threads per vocabulary row

// Block-wide sum or max of one value per thread (blockDim.x a multiple of 32, at most 1024), in
// a fixed order; every thread gets the result.
template <bool kMax>
__device__ float block_reduce(float x) {
  __shared__ float warps[32];
  __shared__ float result;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  x = kMax ? warp_max(x) : warp_sum(x);
  if (lane == 0) warps[warp] = x;
  __syncthreads();
  if (warp == 0) {
    float y = lane < n_warps ? warps[lane] : (kMax ? -FLT_MAX : 0.0f);
    y = kMax ? warp_max(y) : warp_sum(y);
    if (lane == 0) result = y;
  }
  __syncthreads();
  return result;
}

template <class T>
__global__ void crossentropy_max_kernel(float* rowmax, const T* logits, VocabSlice v) {
  const T* row = logits + int64_t(blockIdx.x) * v.width;
  float mx = -FLT_MAX;
  for (int i = threadIdx.x; i < v.valid; i += blockDim.x) mx = fmaxf(mx, load(row[i]));
  mx = block_reduce<true>(mx);
  if (threadIdx.x == 0) rowmax[blockIdx.x] = mx;
}

template <class T>
__global__ void crossentropy_sumexp_kernel(float* sumexp, float* target_logit, T* logits,
                                           const float* rowmax, const int32_t* targets,
                                           VocabSlice v) {
  const int64_t n = blockIdx.x;
  T* row = logits + n * v.width;
  const float mx = rowmax[n];
  const int32_t target = targets[n];
  if (threadIdx.x == 0) target_logit[n] = v.holds(target) ? load(row[target - v.start]) : 0.0f;
  __syncthreads();  // the target's logit is read before the row is overwritten
  float sum = 0;
  for (int i = threadIdx.x; i < v.width; i += blockDim.x) {
    const float e = i < v.valid ? expf(load(row[i]) - mx) : 0.0f;
    sum += e;
    row[i] = store<T>(e);
  }
  sum = block_reduce<false>(sum);
  if (threadIdx.x == 0) sumexp[n] = sum;
}

template <class T>
__global__ void crossentropy_finish_kernel(float* losses, T* probs, const float* rowmax,
                                           const float* sumexp, const float* target_logit,
                                           VocabSlice v) {
  const int64_t n = blockIdx.x;
  T* row = probs + n * v.width;
  const float inv = 1.0f / sumexp[n];
  for (int i = threadIdx.x; i < v.valid; i += blockDim.x) row[i] = store<T>(load(row[i]) * inv);
  if (threadIdx.x == 0) losses[n] = logf(sumexp[n]) + rowmax[n] - target_logit[n];
}

template <class T>
__global__ void crossentropy_backward_kernel(T* probs, const int32_t* targets, float dloss,
                                             VocabSlice v) {
  const int64_t n = blockIdx.x;
  T* row = probs + n * v.width;
  const int32_t target = targets[n];
  const int t = v.holds(target) ? target - v.start : -1;
  for (int i = threadIdx.x; i < v.valid; i += blockDim.x) {
    float x = load(row[i]) * dloss;
    if (i == t) x -= dloss;
    row[i] = store<T>(x);
  }
}

}  // namespace

void crossentropy_max(cudaStream_t s, DPtr rowmax, DPtr logits, int64_t N, VocabSlice v) {
  if (N == 0) return;
  dispatch(logits.dtype, [&](auto tag) {
    using X = decltype(tag);
    crossentropy_max_kernel<X>
        <<<unsigned(N), kRowThreads, 0, s>>>(f32(rowmax), typed<X>(logits), v);
  });
  CUDA_CHECK_LAUNCH("crossentropy_max");
}

void crossentropy_sumexp(cudaStream_t s, DPtr sumexp, DPtr target_logit, DPtr logits, DPtr rowmax,
                         const int32_t* targets, int64_t N, VocabSlice v) {
  if (N == 0) return;
  dispatch(logits.dtype, [&](auto tag) {
    using X = decltype(tag);
    crossentropy_sumexp_kernel<X><<<unsigned(N), kRowThreads, 0, s>>>(
        f32(sumexp), f32(target_logit), typed<X>(logits), f32(rowmax), targets, v);
  });
  CUDA_CHECK_LAUNCH("crossentropy_sumexp");
}

void crossentropy_finish(cudaStream_t s, DPtr losses, DPtr probs, DPtr rowmax, DPtr sumexp,
                         DPtr target_logit, int64_t N, VocabSlice v, double* partials,
                         double* mean) {
  if (N == 0) return;
  dispatch(probs.dtype, [&](auto tag) {
    using X = decltype(tag);
    crossentropy_finish_kernel<X><<<unsigned(N), kRowThreads, 0, s>>>(
        f32(losses), typed<X>(probs), f32(rowmax), f32(sumexp), f32(target_logit), v);
  });
  CUDA_CHECK_LAUNCH("crossentropy_finish");
  sum_values(s, losses, N, partials, mean, 1.0 / double(N));
}

void crossentropy_backward(cudaStream_t s, DPtr probs, const int32_t* targets, float dloss,
                           int64_t N, VocabSlice v) {
  if (N == 0) return;
  dispatch(probs.dtype, [&](auto tag) {
    using X = decltype(tag);
    crossentropy_backward_kernel<X>
        <<<unsigned(N), kRowThreads, 0, s>>>(typed<X>(probs), targets, dloss, v);
  });
  CUDA_CHECK_LAUNCH("crossentropy_backward");
}

}  // namespace trainer::cuda
