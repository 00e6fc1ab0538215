// Encoder, GELU, residual, RoPE, SwiGLU, dropout and dtype conversion: memory-bound grid-stride
// kernels.
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

// One thread per rotated pair: pair i of query or key head `head` of token bt, at position
// pos0 + t. The query heads and then the key heads are the first NH + NKV heads of each row.
template <class T>
__global__ void rope_kernel(T* qkv, const float* cos_sin, int64_t pairs, int T_, int NH, int NKV,
                            int hs, int pos0, bool inverse) {
  const int half = hs / 2, rotated = NH + NKV;
  const int64_t width = int64_t(NH + 2 * NKV) * hs;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < pairs;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int i = int(e % half);
    const int head = int(e / half % rotated);
    const int64_t bt = e / half / rotated;
    const float* angle = cos_sin + (int64_t(pos0) + bt % T_) * half * 2 + 2 * i;
    T* x = qkv + bt * width + int64_t(head) * hs + 2 * i;
    float x0 = load(x[0]), x1 = load(x[1]);
    rotate_pair(x0, x1, angle[0], inverse ? -angle[1] : angle[1]);
    x[0] = store<T>(x0);
    x[1] = store<T>(x1);
  }
}

__device__ __forceinline__ float sigmoid(float g) {
  return 1.0f / (1.0f + expf(-g));
}

// One thread per (row, f): out = silu(gate) * up with the row's [gate | up].
template <class T>
__global__ void swiglu_forward_kernel(T* out, const T* gate_up, int64_t n, int F) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t at = e / F * 2 * F + e % F;
    const float g = load(gate_up[at]);
    out[e] = store<T>(silu_from_sigmoid(g, sigmoid(g)) * load(gate_up[at + F]));
  }
}

template <class T>
__global__ void swiglu_backward_kernel(T* d_gate_up, const T* dout, const T* gate_up, int64_t n,
                                       int F) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t at = e / F * 2 * F + e % F;
    const float g = load(gate_up[at]), up = load(gate_up[at + F]), d = load(dout[e]);
    const float sig = sigmoid(g);
    d_gate_up[at] = store<T>(d * up * silu_grad_from_sigmoid(g, sig));
    d_gate_up[at + F] = store<T>(d * silu_from_sigmoid(g, sig));
  }
}

// The mask is kernels/shared_math.h's, so it is the CPU's element for element.
template <class T>
__global__ void dropout_kernel(T* x, int64_t n, float p, float scale, uint64_t seed,
                               int64_t offset) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] = store<T>(dropout_keeps(seed, uint64_t(offset + i), p) ? load(x[i]) * scale : 0.0f);
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

void rope(cudaStream_t s, DPtr qkv, DPtr cos_sin, int B, int T, int NH, int NKV, int hs, int pos0,
          bool inverse) {
  const int64_t pairs = int64_t(B) * T * (NH + NKV) * (hs / 2);
  if (pairs == 0) return;
  dispatch(qkv.dtype, [&](auto tag) {
    using X = decltype(tag);
    rope_kernel<X><<<blocks_for(pairs, kThreads), kThreads, 0, s>>>(
        typed<X>(qkv), f32(cos_sin), pairs, T, NH, NKV, hs, pos0, inverse);
  });
  CUDA_CHECK_LAUNCH(inverse ? "rope_backward" : "rope_forward");
}

void swiglu_forward(cudaStream_t s, DPtr out, DPtr gate_up, int64_t N, int F) {
  const int64_t n = N * F;
  dispatch(out.dtype, [&](auto tag) {
    using X = decltype(tag);
    swiglu_forward_kernel<X>
        <<<blocks_for(n, kThreads), kThreads, 0, s>>>(typed<X>(out), typed<X>(gate_up), n, F);
  });
  CUDA_CHECK_LAUNCH("swiglu_forward");
}

void swiglu_backward(cudaStream_t s, DPtr d_gate_up, DPtr dout, DPtr gate_up, int64_t N, int F) {
  const int64_t n = N * F;
  dispatch(dout.dtype, [&](auto tag) {
    using X = decltype(tag);
    swiglu_backward_kernel<X><<<blocks_for(n, kThreads), kThreads, 0, s>>>(
        typed<X>(d_gate_up), typed<X>(dout), typed<X>(gate_up), n, F);
  });
  CUDA_CHECK_LAUNCH("swiglu_backward");
}

void dropout(cudaStream_t s, DPtr x, int64_t n, float p, uint64_t seed, int64_t offset) {
  if (p == 0 || n == 0) return;  // p = 0 keeps everything, scaled by 1
  // The scale as the CPU computes it in fp32, so that kept fp32 elements agree bitwise.
  const float scale = 1.0f / (1.0f - p);
  dispatch(x.dtype, [&](auto tag) {
    using X = decltype(tag);
    dropout_kernel<X>
        <<<blocks_for(n, kThreads), kThreads, 0, s>>>(typed<X>(x), n, p, scale, seed, offset);
  });
  CUDA_CHECK_LAUNCH("dropout");
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
