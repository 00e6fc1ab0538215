// Zeroing, encoder, GELU, residual, RoPE, SwiGLU and dropout: memory-bound loops parallelised
// with OpenMP.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/fast_math.h"
#include "kernels/shared_math.h"

namespace trainer::cpu {

void zero_bytes(void* p, size_t bytes) {
  // One thread's memset writes at about half what the cores together do: the gradients (500 MB
  // on W-L) in 4 MB slices across the threads, 14 -> 7 ms.
  constexpr size_t kSlice = size_t(4) << 20;
  auto* at = static_cast<std::byte*>(p);
  const int64_t slices = int64_t((bytes + kSlice - 1) / kSlice);
#pragma omp parallel for schedule(static) if (slices > 1)
  for (int64_t s = 0; s < slices; s++)
    std::memset(at + s * kSlice, 0, std::min(kSlice, bytes - size_t(s) * kSlice));
}

template <class T>
void encoder_forward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int B, int T_,
                     int C, VocabSlice v) {
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < int64_t(B) * T_; bt++) {
    T* o = out + bt * C;
    std::fill(o, o + C, T(0));
    if (v.holds(tokens[bt])) {
      const T* we = wte + int64_t(tokens[bt] - v.start) * C;
      for (int c = 0; c < C; c++) o[c] = we[c];
    }
    if (wpe) {
      const T* pe = wpe + (bt % T_) * C;
      for (int c = 0; c < C; c++) o[c] += pe[c];
    }
  }
}

template <class T>
void encoder_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int B, int T_, int C,
                      VocabSlice v) {
  // Threads own disjoint column ranges, so repeated tokens never race and the order of
  // accumulation per element is the sequence order: deterministic for any thread count.
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int c0 = 0; c0 < C; c0 += 16) {
      int c1 = std::min(C, c0 + 16);
      for (int64_t bt = 0; bt < int64_t(B) * T_; bt++) {
        const T* d = dout + bt * C;
        if (v.holds(tokens[bt])) {
          T* we = dwte + int64_t(tokens[bt] - v.start) * C;
          for (int c = c0; c < c1; c++) we[c] += d[c];
        }
        if (dwpe) {
          T* pe = dwpe + (bt % T_) * C;
          for (int c = c0; c < c1; c++) pe[c] += d[c];
        }
      }
    }
  }
}

template <class T>
void gelu_forward(T* out, const T* inp, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const T x = inp[i];
    out[i] = gelu_from_tanh(x, fast_tanh(gelu_tanh_arg(x)));
  }
}

template <class T>
void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const T x = inp[i];
    dinp[i] = dout[i] * gelu_grad_from_tanh(x, fast_tanh(gelu_tanh_arg(x)));
  }
}

template <class T>
void residual_forward(T* out, const T* a, const T* b, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

template <class T>
void rope(T* qkv, const float* cos_sin, int B, int T_, int NH, int NKV, int hs, int pos0,
          bool inverse) {
  const int64_t width = int64_t(NH + 2 * NKV) * hs;
  const int half = hs / 2;
  // The query heads and then the key heads are the first NH + NKV heads of each row.
  const int rotated = NH + NKV;
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < int64_t(B) * T_; bt++) {
    const float* angle = cos_sin + int64_t(pos0 + bt % T_) * half * 2;
    for (int h = 0; h < rotated; h++) {
      T* x = qkv + bt * width + int64_t(h) * hs;
      for (int i = 0; i < half; i++) {
        const T c = T(angle[2 * i]), s = T(angle[2 * i + 1]);
        rotate_pair(x[2 * i], x[2 * i + 1], c, inverse ? -s : s);
      }
    }
  }
}

template <class T>
void swiglu_forward(T* out, const T* gate_up, int64_t N, int F) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    const T* gate = gate_up + n * 2 * F;
    const T* up = gate + F;
    T* o = out + n * F;
#pragma omp simd
    for (int f = 0; f < F; f++) {
      const T sig = T(1) / (T(1) + fast_exp(-gate[f]));
      o[f] = silu_from_sigmoid(gate[f], sig) * up[f];
    }
  }
}

template <class T>
void swiglu_backward(T* d_gate_up, const T* dout, const T* gate_up, int64_t N, int F) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    const T* gate = gate_up + n * 2 * F;
    const T* up = gate + F;
    const T* d = dout + n * F;
    T* dgate = d_gate_up + n * 2 * F;
    T* dup = dgate + F;
#pragma omp simd
    for (int f = 0; f < F; f++) {
      const T sig = T(1) / (T(1) + fast_exp(-gate[f]));
      dgate[f] = d[f] * up[f] * silu_grad_from_sigmoid(gate[f], sig);
      dup[f] = d[f] * silu_from_sigmoid(gate[f], sig);
    }
  }
}

template <class T>
void dropout(T* x, int64_t n, float p, uint64_t seed, int64_t offset) {
  if (p == 0) return;  // keeps everything, scaled by 1: exactly nothing to do
  const T scale = T(1) / (T(1) - T(p));
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++)
    x[i] = dropout_keeps(seed, uint64_t(offset + i), p) ? x[i] * scale : T(0);
}

#define INSTANTIATE(T)                                                                            \
  template void encoder_forward<T>(T*, const int32_t*, const T*, const T*, int, int, int,         \
                                   VocabSlice);                                                   \
  template void encoder_backward<T>(T*, T*, const T*, const int32_t*, int, int, int, VocabSlice); \
  template void gelu_forward<T>(T*, const T*, int64_t);                                           \
  template void gelu_backward<T>(T*, const T*, const T*, int64_t);                                \
  template void residual_forward<T>(T*, const T*, const T*, int64_t);                             \
  template void rope<T>(T*, const float*, int, int, int, int, int, int, bool);                    \
  template void swiglu_forward<T>(T*, const T*, int64_t, int);                                    \
  template void swiglu_backward<T>(T*, const T*, const T*, int64_t, int);                         \
  template void dropout<T>(T*, int64_t, float, uint64_t, int64_t);
INSTANTIATE(float)
INSTANTIATE(double)

}  // namespace trainer::cpu
