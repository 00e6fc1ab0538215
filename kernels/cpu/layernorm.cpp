#include <omp.h>

#include <cmath>

#include "kernels/cpu/cpu_ops.h"

namespace trainer::cpu {

// The rows' sums are `omp simd` reductions (vector lanes summed at the end): without them GCC
// keeps each sum in source order, one lane at a time (W-L's RMSNorm forward: 6.5 -> 3.4 ms a
// step).
constexpr double kLayerNormEps = 1e-5;

template <class T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* w, const T* b, int64_t N,
                       int C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    const T* x = inp + n * C;
    T m = 0;
#pragma omp simd reduction(+ : m)
    for (int c = 0; c < C; c++) m += x[c];
    m /= C;
    T var = 0;
#pragma omp simd reduction(+ : var)
    for (int c = 0; c < C; c++) var += (x[c] - m) * (x[c] - m);
    var /= C;
    T s = T(1) / std::sqrt(var + T(kLayerNormEps));
    T* o = out + n * C;
#pragma omp simd
    for (int c = 0; c < C; c++) o[c] = (x[c] - m) * s * w[c] + (b ? b[c] : T(0));
    mean[n] = m;
    rstd[n] = s;
  }
}

template <class T>
void layernorm_backward(T* dinp, T* dw, T* db, const T* dout, const T* inp, const T* w,
                        const T* mean, const T* rstd, int64_t N, int C,
                        std::vector<double>& scratch) {
  // Parameter gradients are summed per thread over a static row partition and then combined
  // in thread order, so the result is deterministic for a given thread count.
  const int nthreads = omp_get_max_threads();
  scratch.assign(size_t(nthreads) * 2 * C, 0.0);
#pragma omp parallel num_threads(nthreads)
  {
    double* pdw = scratch.data() + size_t(omp_get_thread_num()) * 2 * C;
    double* pdb = pdw + C;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
      const T* x = inp + n * C;
      const T* d = dout + n * C;
      T m = mean[n], s = rstd[n];
      T dnorm_mean = 0, dnorm_norm_mean = 0;
#pragma omp simd reduction(+ : dnorm_mean, dnorm_norm_mean)
      for (int c = 0; c < C; c++) {
        T norm = (x[c] - m) * s;
        T dnorm = w[c] * d[c];
        dnorm_mean += dnorm;
        dnorm_norm_mean += dnorm * norm;
      }
#pragma omp simd
      for (int c = 0; c < C; c++) {
        pdb[c] += d[c];
        pdw[c] += (x[c] - m) * s * d[c];
      }
      dnorm_mean /= C;
      dnorm_norm_mean /= C;
      T* di = dinp + n * C;
#pragma omp simd
      for (int c = 0; c < C; c++) {
        T norm = (x[c] - m) * s;
        T dnorm = w[c] * d[c];
        di[c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
      }
    }
  }
  for (int t = 0; t < nthreads; t++) {
    const double* pdw = scratch.data() + size_t(t) * 2 * C;
    for (int c = 0; c < C; c++) {
      dw[c] += T(pdw[c]);
      if (db) db[c] += T(pdw[C + c]);  // no bias (GPT-2's bias = false): nothing to add to
    }
  }
}

template <class T>
void rmsnorm_forward(T* out, T* rstd, const T* inp, const T* w, int64_t N, int C, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    const T* x = inp + n * C;
    T sq = 0;
#pragma omp simd reduction(+ : sq)
    for (int c = 0; c < C; c++) sq += x[c] * x[c];
    const T s = T(1) / std::sqrt(sq / C + T(eps));
    T* o = out + n * C;
#pragma omp simd
    for (int c = 0; c < C; c++) o[c] = x[c] * s * w[c];
    rstd[n] = s;
  }
}

// With xhat = x rstd and g = dout w: dx = rstd (g - xhat mean(g xhat)) (the mean term is the
// derivative of rstd), dw = sum over rows of dout xhat.
template <class T>
void rmsnorm_backward(T* dinp, T* dw, const T* dout, const T* inp, const T* w, const T* rstd,
                      int64_t N, int C, std::vector<double>& scratch) {
  // Per-thread partial sums of dw over a static row partition, combined in thread order:
  // deterministic for a given thread count (as layernorm_backward).
  const int nthreads = omp_get_max_threads();
  scratch.assign(size_t(nthreads) * C, 0.0);
#pragma omp parallel num_threads(nthreads)
  {
    double* pdw = scratch.data() + size_t(omp_get_thread_num()) * C;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
      const T* x = inp + n * C;
      const T* d = dout + n * C;
      const T s = rstd[n];
      T g_xhat_mean = 0;
#pragma omp simd reduction(+ : g_xhat_mean)
      for (int c = 0; c < C; c++) g_xhat_mean += d[c] * w[c] * (x[c] * s);
#pragma omp simd
      for (int c = 0; c < C; c++) pdw[c] += x[c] * s * d[c];
      g_xhat_mean /= C;
      T* di = dinp + n * C;
#pragma omp simd
      for (int c = 0; c < C; c++) di[c] += s * (d[c] * w[c] - x[c] * s * g_xhat_mean);
    }
  }
  for (int t = 0; t < nthreads; t++) {
    const double* pdw = scratch.data() + size_t(t) * C;
    for (int c = 0; c < C; c++) dw[c] += T(pdw[c]);
  }
}

template void layernorm_forward<float>(float*, float*, float*, const float*, const float*,
                                       const float*, int64_t, int);
template void layernorm_forward<double>(double*, double*, double*, const double*, const double*,
                                        const double*, int64_t, int);
template void layernorm_backward<float>(float*, float*, float*, const float*, const float*,
                                        const float*, const float*, const float*, int64_t, int,
                                        std::vector<double>&);
template void layernorm_backward<double>(double*, double*, double*, const double*, const double*,
                                         const double*, const double*, const double*, int64_t, int,
                                         std::vector<double>&);
template void rmsnorm_forward<float>(float*, float*, const float*, const float*, int64_t, int,
                                     float);
template void rmsnorm_forward<double>(double*, double*, const double*, const double*, int64_t, int,
                                      float);
template void rmsnorm_backward<float>(float*, float*, const float*, const float*, const float*,
                                      const float*, int64_t, int, std::vector<double>&);
template void rmsnorm_backward<double>(double*, double*, const double*, const double*,
                                       const double*, const double*, int64_t, int,
                                       std::vector<double>&);

}  // namespace trainer::cpu
