#pragma once
// Collectives on device buffers through NCCL, one NCCL communicator per group (its unique id
// broadcast over the group's MPI communicator). Each operation runs on the communicator's own
// stream after an event on the compute stream, so it starts as soon as the gradients it reduces
// are computed, while later kernels keep running; wait() polls for completion and NCCL's
// asynchronous errors, and past [faults] collective_timeout_s aborts the NCCL communicator and
// ends the job instead of hanging. Host buffers (scalars, compressed messages) and
// point-to-point messages go through the MPI communicator, staged (comm/staged_comm.h): NCCL
// sends block in stream order, and a pipeline's paired sends would deadlock.
#include <memory>

#include "comm/communicator.h"
#include "kernels/kernels.h"

namespace trainer {

// `host` is the group's MPI communicator; `cuda` the CUDA backend (its device and stream).
std::unique_ptr<Communicator> make_nccl_communicator(std::unique_ptr<Communicator> host,
                                                     Kernels& cuda, World& world);

}  // namespace trainer
