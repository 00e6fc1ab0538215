// Softmax + cross-entropy over a slice of the vocabulary (kernels/kernels.h), one block per row:
// the forward reads the logits once, the backward rewrites them as gradients. Every reduction
// has a fixed shape and order.
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

// One pass over the row: each thread keeps the max of its elements and their exponentials' sum
// relative to it, rebased as the max grows; the block then combines the threads' pairs.
template <class T>
__global__ void crossentropy_stats_kernel(float* rowmax, float* sumexp, float* target_logit,
                                          const T* logits, const int32_t* targets, VocabSlice v) {
  const int64_t n = blockIdx.x;
  const T* row = logits + n * v.width;
  float mx = -FLT_MAX, sum = 0;
  for (int i = threadIdx.x; i < v.valid; i += blockDim.x) {
    const float x = load(row[i]);
    if (x > mx) {
      sum = sum * expf(mx - x) + 1.0f;
      mx = x;
    } else {
      sum += expf(x - mx);
    }
  }
  const float row_mx = block_reduce<true>(mx);
  sum = block_reduce<false>(sum * expf(mx - row_mx));
  if (threadIdx.x == 0) {
    rowmax[n] = row_mx;
    sumexp[n] = sum;
    const int32_t target = targets[n];
    target_logit[n] = v.holds(target) ? load(row[target - v.start]) : 0.0f;
  }
}

__global__ void crossentropy_rebase_kernel(float* rowmax, float* sumexp, const float* group_max,
                                           int64_t N) {
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= N) return;
  sumexp[n] *= expf(rowmax[n] - group_max[n]);
  rowmax[n] = group_max[n];
}

__global__ void crossentropy_loss_kernel(float* losses, const float* rowmax, const float* sumexp,
                                         const float* target_logit, int64_t N) {
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n < N) losses[n] = logf(sumexp[n]) + rowmax[n] - target_logit[n];
}

template <class T>
__global__ void crossentropy_backward_kernel(T* logits, const float* rowmax, const float* sumexp,
                                             const int32_t* targets, float dloss, VocabSlice v) {
  const int64_t n = blockIdx.x;
  T* row = logits + n * v.width;
  const float mx = rowmax[n], inv = 1.0f / sumexp[n];
  const int32_t target = targets[n];
  const int t = v.holds(target) ? target - v.start : -1;
  for (int i = threadIdx.x; i < v.width; i += blockDim.x) {
    float x = i < v.valid ? expf(load(row[i]) - mx) * inv * dloss : 0.0f;
    if (i == t) x -= dloss;
    row[i] = store<T>(x);
  }
}

}  // namespace

void crossentropy_stats(cudaStream_t s, DPtr rowmax, DPtr sumexp, DPtr target_logit, DPtr logits,
                        const int32_t* targets, int64_t N, VocabSlice v) {
  if (N == 0) return;
  dispatch(logits.dtype, [&](auto tag) {
    using X = decltype(tag);
    crossentropy_stats_kernel<X><<<unsigned(N), kRowThreads, 0, s>>>(
        f32(rowmax), f32(sumexp), f32(target_logit), typed<X>(logits), targets, v);
  });
  CUDA_CHECK_LAUNCH("crossentropy_stats");
}

void crossentropy_rebase(cudaStream_t s, DPtr rowmax, DPtr sumexp, DPtr group_max, int64_t N) {
  if (N == 0) return;
  crossentropy_rebase_kernel<<<unsigned((N + 255) / 256), 256, 0, s>>>(f32(rowmax), f32(sumexp),
                                                                       f32(group_max), N);
  CUDA_CHECK_LAUNCH("crossentropy_rebase");
}

void crossentropy_loss(cudaStream_t s, DPtr losses, DPtr rowmax, DPtr sumexp, DPtr target_logit,
                       int64_t N, double* partials, double* mean) {
  if (N == 0) return;
  crossentropy_loss_kernel<<<unsigned((N + 255) / 256), 256, 0, s>>>(
      f32(losses), f32(rowmax), f32(sumexp), f32(target_logit), N);
  CUDA_CHECK_LAUNCH("crossentropy_loss");
  sum_values(s, losses, N, partials, mean, 1.0 / double(N));
}

void crossentropy_backward(cudaStream_t s, DPtr logits, DPtr rowmax, DPtr sumexp,
                           const int32_t* targets, float dloss, int64_t N, VocabSlice v) {
  if (N == 0) return;
  dispatch(logits.dtype, [&](auto tag) {
    using X = decltype(tag);
    crossentropy_backward_kernel<X><<<unsigned(N), kRowThreads, 0, s>>>(
        typed<X>(logits), f32(rowmax), f32(sumexp), targets, dloss, v);
  });
  CUDA_CHECK_LAUNCH("crossentropy_backward");
}

}  // namespace trainer::cuda
