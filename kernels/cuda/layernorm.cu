// LayerNorm and RMSNorm forward and backward, and the column sums that give parameter gradients
// (norm weights and biases, linear biases). Rows are handled one warp each; column sums go through
// a fixed number of row chunks and are added in chunk order: deterministic, no atomics.
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_types.cuh"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {
namespace {

constexpr float kLayerNormEps = 1e-5f;
constexpr int kWarpsPerBlock = 8;

// The rest of one row's forward, by its warp: mean (from each lane's share `sum` of the row x),
// rstd, the normalised output and the statistics.
template <class T>
__device__ void normalize_row(const T* x, float sum, T* out, float* mean, float* rstd, const T* w,
                              const T* b, int64_t row, int C, int lane) {
  const float m = warp_sum(sum) / float(C);
  float sq = 0;
  for (int c = lane; c < C; c += 32) {
    const float d = load(x[c]) - m;
    sq += d * d;
  }
  const float s = 1.0f / sqrtf(warp_sum(sq) / float(C) + kLayerNormEps);
  T* o = out + row * C;
  for (int c = lane; c < C; c += 32)
    o[c] = store<T>((load(x[c]) - m) * s * load(w[c]) + (b ? load(b[c]) : 0.0f));
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

template <class T>
__global__ void layernorm_forward_kernel(T* out, float* mean, float* rstd, const T* inp, const T* w,
                                         const T* b, int64_t N, int C) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const T* x = inp + row * C;
  float sum = 0;
  for (int c = lane; c < C; c += 32) sum += load(x[c]);
  normalize_row(x, sum, out, mean, rstd, w, b, row, C, lane);
}

// The residual add fused in: each lane rounds its sums as they are stored and normalises those
// stored values, exactly what the two separate kernels compute. res may alias a (each element
// is read and written by the same thread).
template <class T>
__global__ void residual_layernorm_forward_kernel(T* res, T* out, float* mean, float* rstd,
                                                  const T* a, const T* b, const T* w, const T* bias,
                                                  int64_t N, int C) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  T* x = res + row * C;
  float sum = 0;
  for (int c = lane; c < C; c += 32) {
    const T r = store<T>(load(a[row * C + c]) + load(b[row * C + c]));
    x[c] = r;
    sum += load(r);
  }
  normalize_row(x, sum, out, mean, rstd, w, bias, row, C, lane);
}

// RMSNorm forward for one row per warp: rstd = 1 / sqrt(mean(x^2) + eps), out = x rstd w.
template <class T>
__global__ void rmsnorm_forward_kernel(T* out, float* rstd, const T* inp, const T* w, int64_t N,
                                       int C, float eps) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const T* x = inp + row * C;
  float sq = 0;
  for (int c = lane; c < C; c += 32) sq += load(x[c]) * load(x[c]);
  const float s = 1.0f / sqrtf(warp_sum(sq) / float(C) + eps);
  T* o = out + row * C;
  for (int c = lane; c < C; c += 32) o[c] = store<T>(load(x[c]) * s * load(w[c]));
  if (lane == 0) rstd[row] = s;
}

// RMSNorm's dinp += for one row per warp: with xhat = x rstd and g = dout w,
// dx = rstd (g - xhat mean(g xhat)).
template <class T>
__global__ void rmsnorm_backward_input_kernel(T* dinp, const T* dout, const T* inp, const T* w,
                                              const float* rstd, int64_t N, int C) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const T* x = inp + row * C;
  const T* d = dout + row * C;
  const float s = rstd[row];
  float g_xhat_sum = 0;
  for (int c = lane; c < C; c += 32) g_xhat_sum += load(d[c]) * load(w[c]) * load(x[c]) * s;
  const float g_xhat_mean = warp_sum(g_xhat_sum) / float(C);
  T* di = dinp + row * C;
  for (int c = lane; c < C; c += 32)
    di[c] = store<T>(load(di[c]) + s * (load(d[c]) * load(w[c]) - load(x[c]) * s * g_xhat_mean));
}

// dinp += for one row per warp.
template <class T>
__global__ void layernorm_backward_input_kernel(T* dinp, const T* dout, const T* inp, const T* w,
                                                const float* mean, const float* rstd, int64_t N,
                                                int C) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const T* x = inp + row * C;
  const T* d = dout + row * C;
  const float m = mean[row], s = rstd[row];
  float dnorm_sum = 0, dnorm_norm_sum = 0;
  for (int c = lane; c < C; c += 32) {
    const float dnorm = load(w[c]) * load(d[c]);
    dnorm_sum += dnorm;
    dnorm_norm_sum += dnorm * (load(x[c]) - m) * s;
  }
  const float dnorm_mean = warp_sum(dnorm_sum) / float(C);
  const float dnorm_norm_mean = warp_sum(dnorm_norm_sum) / float(C);
  T* di = dinp + row * C;
  for (int c = lane; c < C; c += 32) {
    const float norm = (load(x[c]) - m) * s;
    const float dnorm = load(w[c]) * load(d[c]);
    di[c] = store<T>(load(di[c]) + (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s);
  }
}

// Partial column sums over one chunk of rows: partials[chunk][c] = sum of dout[r][c] (times
// the normalised input when kNorm, into the first half; dout alone into the second half). The
// input is normalised as (x - mean) rstd, or as x rstd when mean is null (RMSNorm).
// Block (32, 8): 32 columns, 8 row lanes combined in order through shared memory.
template <class T, bool kNorm>
__global__ void column_partials_kernel(float* partials, const T* dout, const T* inp,
                                       const float* mean, const float* rstd, int64_t N, int C) {
  __shared__ float acc_norm[8][32], acc_plain[8][32];
  const int c = blockIdx.x * 32 + threadIdx.x;
  const int chunk = blockIdx.y;
  const int64_t rows_per = (N + kColumnChunks - 1) / kColumnChunks;
  const int64_t begin = chunk * rows_per, end = min(N, begin + rows_per);
  float with_norm = 0, plain = 0;
  if (c < C)
    for (int64_t r = begin + threadIdx.y; r < end; r += 8) {
      const float d = load(dout[r * C + c]);
      plain += d;
      if constexpr (kNorm)
        with_norm += d * (load(inp[r * C + c]) - (mean ? mean[r] : 0.0f)) * rstd[r];
    }
  acc_norm[threadIdx.y][threadIdx.x] = with_norm;
  acc_plain[threadIdx.y][threadIdx.x] = plain;
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
  float a = 0, b = 0;
  for (int y = 0; y < 8; y++) {
    a += acc_norm[y][threadIdx.x];
    b += acc_plain[y][threadIdx.x];
  }
  if constexpr (kNorm) {
    partials[int64_t(chunk) * C + c] = a;
    partials[int64_t(kColumnChunks + chunk) * C + c] = b;
  } else {
    partials[int64_t(chunk) * C + c] = b;
  }
}

// out[c] += the chunks' partial sums, in chunk order.
template <class G>
__global__ void column_finish_kernel(G* out, const float* partials, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float acc = 0;
  for (int k = 0; k < kColumnChunks; k++) acc += partials[int64_t(k) * C + c];
  out[c] = store<G>(load(out[c]) + acc);
}

}  // namespace

void layernorm_forward(cudaStream_t s, DPtr out, DPtr mean, DPtr rstd, DPtr inp, DPtr weight,
                       DPtr bias, int64_t N, int C) {
  if (N == 0) return;  // a grid of no blocks is a launch error
  const unsigned blocks = unsigned((N + kWarpsPerBlock - 1) / kWarpsPerBlock);
  dispatch(out.dtype, [&](auto tag) {
    using X = decltype(tag);
    layernorm_forward_kernel<X><<<blocks, 32 * kWarpsPerBlock, 0, s>>>(
        typed<X>(out), f32(mean), f32(rstd), typed<X>(inp), typed<X>(weight), typed<X>(bias), N, C);
  });
  CUDA_CHECK_LAUNCH("layernorm_forward");
}

void residual_layernorm_forward(cudaStream_t s, DPtr res, DPtr out, DPtr mean, DPtr rstd, DPtr a,
                                DPtr b, DPtr weight, DPtr bias, int64_t N, int C) {
  if (N == 0) return;  // a grid of no blocks is a launch error
  const unsigned blocks = unsigned((N + kWarpsPerBlock - 1) / kWarpsPerBlock);
  dispatch(out.dtype, [&](auto tag) {
    using X = decltype(tag);
    residual_layernorm_forward_kernel<X><<<blocks, 32 * kWarpsPerBlock, 0, s>>>(
        typed<X>(res), typed<X>(out), f32(mean), f32(rstd), typed<X>(a), typed<X>(b),
        typed<X>(weight), typed<X>(bias), N, C);
  });
  CUDA_CHECK_LAUNCH("residual_layernorm_forward");
}

void layernorm_backward(cudaStream_t s, DPtr dinp, DPtr dweight, DPtr dbias, DPtr dout, DPtr inp,
                        DPtr weight, DPtr mean, DPtr rstd, int64_t N, int C, float* partials) {
  if (N == 0) return;
  const unsigned row_blocks = unsigned((N + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const dim3 grid((C + 31) / 32, kColumnChunks), block(32, 8);
  dispatch(dout.dtype, [&](auto tag) {
    using X = decltype(tag);
    layernorm_backward_input_kernel<X>
        <<<row_blocks, 32 * kWarpsPerBlock, 0, s>>>(typed<X>(dinp), typed<X>(dout), typed<X>(inp),
                                                    typed<X>(weight), f32(mean), f32(rstd), N, C);
    column_partials_kernel<X, true><<<grid, block, 0, s>>>(partials, typed<X>(dout), typed<X>(inp),
                                                           f32(mean), f32(rstd), N, C);
    dispatch(dweight.dtype, [&](auto gtag) {
      using G = decltype(gtag);
      const unsigned blocks = unsigned((C + 255) / 256);
      column_finish_kernel<G><<<blocks, 256, 0, s>>>(typed<G>(dweight), partials, C);
      if (dbias)  // no bias (GPT-2's bias = false): no gradient to add to
        column_finish_kernel<G>
            <<<blocks, 256, 0, s>>>(typed<G>(dbias), partials + int64_t(kColumnChunks) * C, C);
    });
  });
  CUDA_CHECK_LAUNCH("layernorm_backward");
}

void rmsnorm_forward(cudaStream_t s, DPtr out, DPtr rstd, DPtr inp, DPtr weight, int64_t N, int C,
                     float eps) {
  if (N == 0) return;  // a grid of no blocks is a launch error
  const unsigned blocks = unsigned((N + kWarpsPerBlock - 1) / kWarpsPerBlock);
  dispatch(out.dtype, [&](auto tag) {
    using X = decltype(tag);
    rmsnorm_forward_kernel<X><<<blocks, 32 * kWarpsPerBlock, 0, s>>>(
        typed<X>(out), f32(rstd), typed<X>(inp), typed<X>(weight), N, C, eps);
  });
  CUDA_CHECK_LAUNCH("rmsnorm_forward");
}

void rmsnorm_backward(cudaStream_t s, DPtr dinp, DPtr dweight, DPtr dout, DPtr inp, DPtr weight,
                      DPtr rstd, int64_t N, int C, float* partials) {
  if (N == 0) return;
  const unsigned row_blocks = unsigned((N + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const dim3 grid((C + 31) / 32, kColumnChunks), block(32, 8);
  dispatch(dout.dtype, [&](auto tag) {
    using X = decltype(tag);
    rmsnorm_backward_input_kernel<X><<<row_blocks, 32 * kWarpsPerBlock, 0, s>>>(
        typed<X>(dinp), typed<X>(dout), typed<X>(inp), typed<X>(weight), f32(rstd), N, C);
    // No mean: the partials' first half sums dout * x * rstd, the weight's gradient.
    column_partials_kernel<X, true>
        <<<grid, block, 0, s>>>(partials, typed<X>(dout), typed<X>(inp), nullptr, f32(rstd), N, C);
    dispatch(dweight.dtype, [&](auto gtag) {
      using G = decltype(gtag);
      column_finish_kernel<G>
          <<<unsigned((C + 255) / 256), 256, 0, s>>>(typed<G>(dweight), partials, C);
    });
  });
  CUDA_CHECK_LAUNCH("rmsnorm_backward");
}

void bias_backward(cudaStream_t s, DPtr dbias, DPtr dout, int64_t N, int OC, float* partials) {
  if (N == 0) return;
  const dim3 grid((OC + 31) / 32, kColumnChunks), block(32, 8);
  dispatch(dout.dtype, [&](auto tag) {
    using X = decltype(tag);
    column_partials_kernel<X, false>
        <<<grid, block, 0, s>>>(partials, typed<X>(dout), nullptr, nullptr, nullptr, N, OC);
    dispatch(dbias.dtype, [&](auto gtag) {
      using G = decltype(gtag);
      column_finish_kernel<G>
          <<<unsigned((OC + 255) / 256), 256, 0, s>>>(typed<G>(dbias), partials, OC);
    });
  });
  CUDA_CHECK_LAUNCH("bias_backward");
}

}  // namespace trainer::cuda
