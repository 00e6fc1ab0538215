#pragma once
// A communicator for device buffers over a host-memory one (MPI): device buffers are copied into
// pinned host memory, communicated there, and copied back when the operation completes. Host
// buffers pass straight through. Slower than NCCL, but it works where NCCL does not: several
// ranks sharing one GPU (tests), and point-to-point messages (see comm/nccl_comm.h).
#include <memory>

#include "comm/communicator.h"
#include "kernels/kernels.h"

namespace trainer {

std::unique_ptr<Communicator> make_staged_communicator(std::unique_ptr<Communicator> host,
                                                       Kernels& kernels);

}  // namespace trainer
