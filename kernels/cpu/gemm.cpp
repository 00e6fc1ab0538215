#include <cblas.h>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/panel_gemm.h"

namespace trainer::cpu {

static CBLAS_TRANSPOSE op(bool trans) {
  return trans ? CblasTrans : CblasNoTrans;
}

// BLAS has no bias: C = beta * C + bias first, then the product added to it.
template <class T>
static T add_bias(int64_t M, int64_t N, T beta, T* C, int64_t ldc, const T* bias) {
  if (!bias) return beta;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < M; r++)
    for (int64_t n = 0; n < N; n++)
      C[r * ldc + n] = (beta == T(0) ? T(0) : beta * C[r * ldc + n]) + bias[n];
  return T(1);
}

// float: the panel GEMM where -march gives AVX-512 (32 registers hold its 6 x 64 tiles), OpenBLAS
// on narrower builds, whose tiles would be a quarter of that. double (the finite-difference
// references) stays with OpenBLAS: an implementation independent of the one it checks.
template <>
void gemm<float>(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                 int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc,
                 const float* bias) {
  if constexpr (kVectorBytes == 64)
    return panel_gemm<float>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, bias);
  beta = add_bias(M, N, beta, C, ldc, bias);
  cblas_sgemm(CblasRowMajor, op(ta), op(tb), M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

template <>
void gemm<double>(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A,
                  int64_t lda, const double* B, int64_t ldb, double beta, double* C, int64_t ldc,
                  const double* bias) {
  beta = add_bias(M, N, beta, C, ldc, bias);
  cblas_dgemm(CblasRowMajor, op(ta), op(tb), M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

}  // namespace trainer::cpu
