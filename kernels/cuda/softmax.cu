// The softmaxes: causal attention (one warp per row) and softmax + cross-entropy over a slice of
// the vocabulary (one block per row). Every reduction has a fixed shape and order.
#include <cfloat>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_types.cuh"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kRowThreads = 512;  // threads per vocabulary row

template <class T>
__global__ void attention_softmax_forward_kernel(T* att, int64_t rows, int T_) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int i = int(row % T_);  // the query: keys 0..i are visible
  T* a = att + row * T_;
  float mx = -FLT_MAX;
  for (int j = lane; j <= i; j += 32) mx = fmaxf(mx, load(a[j]));
  mx = warp_max(mx);
  float sum = 0;
  for (int j = lane; j <= i; j += 32) sum += expf(load(a[j]) - mx);
  const float inv = 1.0f / warp_sum(sum);
  for (int j = lane; j < T_; j += 32) a[j] = store<T>(j <= i ? expf(load(a[j]) - mx) * inv : 0.0f);
}

template <class T>
__global__ void attention_softmax_backward_kernel(T* datt, const T* att, int64_t rows, int T_) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int i = int(row % T_);
  const T* p = att + row * T_;
  T* d = datt + row * T_;
  float dot = 0;
  for (int j = lane; j <= i; j += 32) dot += load(p[j]) * load(d[j]);
  dot = warp_sum(dot);
  for (int j = lane; j < T_; j += 32)
    d[j] = store<T>(j <= i ? load(p[j]) * (load(d[j]) - dot) : 0.0f);
}

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

void attention_softmax_forward(cudaStream_t s, DPtr att, int64_t rows, int T) {
  if (rows == 0) return;  // a grid of no blocks is a launch error
  const unsigned blocks = unsigned((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  dispatch(att.dtype, [&](auto tag) {
    using X = decltype(tag);
    attention_softmax_forward_kernel<X>
        <<<blocks, 32 * kWarpsPerBlock, 0, s>>>(typed<X>(att), rows, T);
  });
  CUDA_CHECK_LAUNCH("attention_softmax_forward");
}

void attention_softmax_backward(cudaStream_t s, DPtr datt, DPtr att, int64_t rows, int T) {
  if (rows == 0) return;  // a grid of no blocks is a launch error
  const unsigned blocks = unsigned((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  dispatch(att.dtype, [&](auto tag) {
    using X = decltype(tag);
    attention_softmax_backward_kernel<X>
        <<<blocks, 32 * kWarpsPerBlock, 0, s>>>(typed<X>(datt), typed<X>(att), rows, T);
  });
  CUDA_CHECK_LAUNCH("attention_softmax_backward");
}

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
