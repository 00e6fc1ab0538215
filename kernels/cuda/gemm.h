#pragma once
// Matrix products through cuBLASLt, column-major as cuBLAS sees them:
//   C(m, n) = alpha * op(A) op(B) + beta * C  [+ bias(m) added to every column]
// `batch` times at the given element strides. A and B share a dtype (f32, bf16 or f16); C may be
// that dtype or f32 (16-bit products accumulated into fp32 gradients); all compute in fp32 (no
// TF32, so fp32 runs match the CPU). The algorithm for each shape is chosen once and cached, so a
// shape always runs the same algorithm: bitwise-reproducible results on one GPU model.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "kernels/dtype.h"

namespace trainer::cuda {

struct GemmOperand {
  DPtr p;
  int ld;              // leading dimension (elements)
  int64_t stride = 0;  // between batch entries (elements)
};

class Gemm {
 public:
  Gemm(cudaStream_t stream, void* workspace, size_t workspace_bytes);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  void run(bool trans_a, bool trans_b, int m, int n, int k, float alpha, GemmOperand A,
           GemmOperand B, float beta, GemmOperand C, int batch = 1, DPtr bias = {});

 private:
  struct Plan;
  using Key = std::tuple<bool, bool, int, int, int, int, int, int, int64_t, int64_t, int64_t, int,
                         int, int, int, int, int, int, int, bool>;
  Plan& plan(const Key& key, bool trans_a, bool trans_b, int m, int n, int k, GemmOperand A,
             GemmOperand B, GemmOperand C, int batch, DPtr bias, float beta);

  cudaStream_t stream_;
  void* workspace_;
  size_t workspace_bytes_;
  cublasLtHandle_t handle_ = nullptr;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace trainer::cuda
