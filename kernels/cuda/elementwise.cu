// Encoder, GELU, residual and dtype conversion: memory-bound grid-stride kernels.
#include <stdexcept>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_types.cuh"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {
namespace {

constexpr int kThreads = 256;

template <class T>
__global__ void encoder_forward_kernel(T* out, const int32_t* tokens, const T* wte, const T* wpe,
                                       int64_t n, int T_, int C, VocabSlice v) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t bt = i / C;
    const int c = int(i % C);
    const int32_t token = tokens[bt];
    float x = v.holds(token) ? load(wte[int64_t(token - v.start) * C + c]) : 0.0f;
    if (wpe) x += load(wpe[(bt % T_) * C + c]);
    out[i] = store<T>(x);
  }
}

// One block per distinct token: its row of dwte gains the rows of dout where it occurs, added in
// sequence order (as on the CPU); no two blocks touch one row, so no atomics.
template <class G, class T>
__global__ void encoder_backward_wte_kernel(G* dwte, const T* dout, const int32_t* index, int U,
                                            int C, int start) {
  const int u = blockIdx.x;
  const int32_t* offsets = index + U;
  const int32_t* positions = index + 2 * U + 1;
  G* row = dwte + int64_t(index[u] - start) * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = load(row[c]);
    for (int p = offsets[u]; p < offsets[u + 1]; p++)
      acc += load(dout[int64_t(positions[p]) * C + c]);
    row[c] = store<G>(acc);
  }
}

// One thread per (t, c) of dwpe, summing over the batch in order.
template <class G, class T>
__global__ void encoder_backward_wpe_kernel(G* dwpe, const T* dout, int B, int T_, int C) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < int64_t(T_) * C;
       i += int64_t(gridDim.x) * blockDim.x) {
    float acc = load(dwpe[i]);
    for (int b = 0; b < B; b++) acc += load(dout[int64_t(b) * T_ * C + i]);
    dwpe[i] = store<G>(acc);
  }
}

__device__ __forceinline__ float gelu_value(float x) {
  return gelu_from_tanh(x, tanhf(gelu_tanh_arg(x)));
}

template <class T>
__global__ void gelu_forward_kernel(T* out, const T* inp, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = store<T>(gelu_value(load(inp[i])));
}

template <class T>
__global__ void gelu_backward_kernel(T* dinp, const T* inp, const T* dout, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float x = load(inp[i]);
    dinp[i] = store<T>(load(dout[i]) * gelu_grad_from_tanh(x, tanhf(gelu_tanh_arg(x))));
  }
}

template <class T>
__global__ void residual_forward_kernel(T* out, const T* a, const T* b, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = store<T>(load(a[i]) + load(b[i]));
}

template <class D, class S>
__global__ void convert_kernel(D* dst, const S* src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = store<D>(load(src[i]));
}

// fp32 (or fp16, widened exactly) -> bf16 with stochastic rounding: the random bits are a
// function of (seed, index), as on the CPU, so both backends round every element the same way.
template <class S>
__global__ void convert_stochastic_kernel(bf16* dst, const S* src, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = bf16{bf16_bits_stochastic(__float_as_uint(load(src[i])),
                                       uint32_t(random_bits(seed, uint64_t(i))))};
}

}  // namespace

void encoder_forward(cudaStream_t s, DPtr out, const int32_t* tokens, DPtr wte, DPtr wpe, int B,
                     int T, int C, VocabSlice v) {
  const int64_t n = int64_t(B) * T * C;
  dispatch(out.dtype, [&](auto tag) {
    using X = decltype(tag);
    encoder_forward_kernel<X><<<blocks_for(n, kThreads), kThreads, 0, s>>>(
        typed<X>(out), tokens, typed<X>(wte), wpe ? typed<X>(wpe) : nullptr, n, T, C, v);
  });
  CUDA_CHECK_LAUNCH("encoder_forward");
}

void encoder_backward(cudaStream_t s, DPtr dwte, DPtr dwpe, DPtr dout, const int32_t* index, int U,
                      int B, int T, int C, VocabSlice v) {
  if (dwpe && dwpe.dtype != dwte.dtype)  // one gradient buffer holds both
    throw std::logic_error("encoder_backward: dwte and dwpe of different dtypes");
  dispatch(dout.dtype, [&](auto tag) {
    using X = decltype(tag);
    dispatch(dwte.dtype, [&](auto gtag) {
      using G = decltype(gtag);
      if (U > 0)
        encoder_backward_wte_kernel<G, X>
            <<<U, kThreads, 0, s>>>(typed<G>(dwte), typed<X>(dout), index, U, C, v.start);
      if (dwpe)
        encoder_backward_wpe_kernel<G, X><<<blocks_for(int64_t(T) * C, kThreads), kThreads, 0, s>>>(
            typed<G>(dwpe), typed<X>(dout), B, T, C);
    });
  });
  CUDA_CHECK_LAUNCH("encoder_backward");
}

void gelu_forward(cudaStream_t s, DPtr out, DPtr inp, int64_t n) {
  dispatch(out.dtype, [&](auto tag) {
    using X = decltype(tag);
    gelu_forward_kernel<X>
        <<<blocks_for(n, kThreads), kThreads, 0, s>>>(typed<X>(out), typed<X>(inp), n);
  });
  CUDA_CHECK_LAUNCH("gelu_forward");
}

void gelu_backward(cudaStream_t s, DPtr dinp, DPtr inp, DPtr dout, int64_t n) {
  dispatch(dout.dtype, [&](auto tag) {
    using X = decltype(tag);
    gelu_backward_kernel<X><<<blocks_for(n, kThreads), kThreads, 0, s>>>(
        typed<X>(dinp), typed<X>(inp), typed<X>(dout), n);
  });
  CUDA_CHECK_LAUNCH("gelu_backward");
}

void residual_forward(cudaStream_t s, DPtr out, DPtr a, DPtr b, int64_t n) {
  dispatch(out.dtype, [&](auto tag) {
    using X = decltype(tag);
    residual_forward_kernel<X>
        <<<blocks_for(n, kThreads), kThreads, 0, s>>>(typed<X>(out), typed<X>(a), typed<X>(b), n);
  });
  CUDA_CHECK_LAUNCH("residual_forward");
}

void convert(cudaStream_t s, DPtr dst, DPtr src, int64_t n, uint64_t stochastic_seed) {
  if (n <= 0) return;
  if (dst.dtype == src.dtype) {
    if (dst.p != src.p)
      CUDA_CHECK(
          cudaMemcpyAsync(dst.p, src.p, n * dtype_size(dst.dtype), cudaMemcpyDeviceToDevice, s));
    return;
  }
  if (dst.dtype == DType::bf16 && stochastic_seed != 0) {  // from f32 or f16, as on the CPU
    dispatch(src.dtype, [&](auto stag) {
      using S = decltype(stag);
      convert_stochastic_kernel<S><<<blocks_for(n, kThreads), kThreads, 0, s>>>(
          typed<bf16>(dst), typed<S>(src), n, stochastic_seed);
    });
  } else {
    dispatch(dst.dtype, [&](auto dtag) {
      using D = decltype(dtag);
      dispatch(src.dtype, [&](auto stag) {
        using S = decltype(stag);
        convert_kernel<D, S>
            <<<blocks_for(n, kThreads), kThreads, 0, s>>>(typed<D>(dst), typed<S>(src), n);
      });
    });
  }
  CUDA_CHECK_LAUNCH("convert");
}

}  // namespace trainer::cuda
