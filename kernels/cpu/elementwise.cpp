// Encoder, GELU and residual: memory-bound loops parallelised with OpenMP.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/fast_math.h"

namespace trainer::cpu {

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

#define INSTANTIATE(T)                                                                            \
  template void encoder_forward<T>(T*, const int32_t*, const T*, const T*, int, int, int,         \
                                   VocabSlice);                                                   \
  template void encoder_backward<T>(T*, T*, const T*, const int32_t*, int, int, int, VocabSlice); \
  template void gelu_forward<T>(T*, const T*, int64_t);                                           \
  template void gelu_backward<T>(T*, const T*, const T*, int64_t);                                \
  template void residual_forward<T>(T*, const T*, const T*, int64_t);
INSTANTIATE(float)
INSTANTIATE(double)

}  // namespace trainer::cpu
