#include <algorithm>

#include "kernels/cpu/cpu_ops.h"

namespace trainer::cpu {

// The bias goes in with the GEMM's first store of each tile (gemm's last argument), not in a
// pass of its own that writes `out` before the GEMM reads it back.
template <class T>
void matmul_forward(T* out, const T* inp, const T* w, const T* bias, int64_t N, int IC, int OC) {
  gemm<T>(false, true, N, OC, IC, T(1), inp, IC, w, IC, T(0), out, OC, bias);
}

template <class T>
void matmul_backward(T* dinp, T* dw, T* dbias, const T* dout, const T* inp, const T* w, int64_t N,
                     int IC, int OC) {
  if (dinp) gemm<T>(false, false, N, IC, OC, T(1), dout, OC, w, IC, T(0), dinp, IC);
  gemm<T>(true, false, OC, IC, N, T(1), dout, OC, inp, IC, T(1), dw, IC);
  if (dbias) {
    // Each thread owns a block of columns and sums rows in order: deterministic.
#pragma omp parallel for schedule(static)
    for (int o0 = 0; o0 < OC; o0 += 64) {
      int o1 = std::min(OC, o0 + 64);
      for (int64_t n = 0; n < N; n++) {
        const T* d = dout + n * OC;
        for (int o = o0; o < o1; o++) dbias[o] += d[o];
      }
    }
  }
}

template void matmul_forward<float>(float*, const float*, const float*, const float*, int64_t, int,
                                    int);
template void matmul_forward<double>(double*, const double*, const double*, const double*, int64_t,
                                     int, int);
template void matmul_backward<float>(float*, float*, float*, const float*, const float*,
                                     const float*, int64_t, int, int);
template void matmul_backward<double>(double*, double*, double*, const double*, const double*,
                                      const double*, int64_t, int, int);

}  // namespace trainer::cpu
