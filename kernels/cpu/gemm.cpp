#include <cblas.h>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/panel_gemm.h"

namespace trainer::cpu {

static CBLAS_TRANSPOSE op(bool trans) {
  return trans ? CblasTrans : CblasNoTrans;
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
  if (bias) scale_and_add_bias(M, N, beta, C, ldc, bias), beta = 1.0f;  // BLAS has no bias
  cblas_sgemm(CblasRowMajor, op(ta), op(tb), M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

template <>
void gemm<double>(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A,
                  int64_t lda, const double* B, int64_t ldb, double beta, double* C, int64_t ldc,
                  const double* bias) {
  if (bias) scale_and_add_bias(M, N, beta, C, ldc, bias), beta = 1.0;  // BLAS has no bias
  cblas_dgemm(CblasRowMajor, op(ta), op(tb), M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

}  // namespace trainer::cpu
