#pragma once
// Every CUDA runtime, cuBLASLt and NCCL call is checked; a failure throws with the call, the
// library's message and file:line, so that the trainer's one-line error says where it broke.
#include <cuda_runtime.h>

#include <string>

namespace trainer::cuda {

[[noreturn]] void fail(const std::string& message, const char* call, const char* file, int line);

inline void check(cudaError_t status, const char* call, const char* file, int line) {
  if (status != cudaSuccess) fail(cudaGetErrorString(status), call, file, line);
}

}  // namespace trainer::cuda

#define CUDA_CHECK(call) ::trainer::cuda::check((call), #call, __FILE__, __LINE__)
// After a kernel launch: launch-configuration errors surface here, asynchronous faults at the
// next synchronising call.
#define CUDA_CHECK_LAUNCH(what) ::trainer::cuda::check(cudaGetLastError(), what, __FILE__, __LINE__)
