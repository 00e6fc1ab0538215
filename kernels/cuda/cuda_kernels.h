#pragma once
// What other CUDA-aware code (the NCCL communicator) needs from the CUDA backend.
#include <cuda_runtime.h>

#include "kernels/kernels.h"

namespace trainer::cuda {

// The stream every kernel of `k` runs on, in order; throws unless `k` is the CUDA backend.
cudaStream_t compute_stream(Kernels& k);
int device_of(Kernels& k);

}  // namespace trainer::cuda
