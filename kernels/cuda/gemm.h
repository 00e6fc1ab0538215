#pragma once
// Matrix products through cuBLASLt: the calls of kernels/gemm_plan.h (column-major, as cuBLAS
// sees them, strided batches, bias and GELU epilogues). A and B share a dtype (f32, bf16 or f16); C
// may be that dtype or f32 (16-bit products accumulated into fp32 gradients); all compute in fp32
// (no TF32, so fp32 runs match the CPU). The algorithm for each shape is chosen once and cached, so
// a shape always runs the same algorithm: bitwise-reproducible results on one GPU model.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "kernels/gemm_plan.h"

namespace trainer::cuda {

// Loads cuBLASLt now and resolves every function the GEMMs call (the backend does it on first
// use); returns the library's soname, or throws naming what is missing.
std::string load_cublaslt();

class Gemm {
 public:
  Gemm(cudaStream_t stream, void* workspace, size_t workspace_bytes);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // One call of kernels/gemm_plan.h, enqueued on the stream; throws when cuBLASLt has no
  // algorithm for it.
  void run(const GemmCall& call);
  // As run, but returns false (enqueueing nothing) when cuBLASLt has no algorithm: for fused
  // epilogues, whose caller then runs the unfused kernels. The answer is cached per shape.
  bool try_run(const GemmCall& call);

 private:
  struct Plan;
  using Key = std::tuple<bool, bool, int, int, int, int, int, int, int64_t, int64_t, int64_t, int,
                         int, int, int, int, int, int, int, bool, int, int, int, int>;
  static Key key_of(const GemmCall& call);
  // The cached plan for the call; null when cuBLASLt has no algorithm for it.
  Plan* plan(const Key& key, const GemmCall& call);
  cublasStatus_t enqueue(Plan& plan, const GemmCall& call);
  [[noreturn]] static void no_algorithm(const GemmCall& call);

  cudaStream_t stream_;
  void* workspace_;
  size_t workspace_bytes_;
  cublasLtHandle_t handle_ = nullptr;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace trainer::cuda
