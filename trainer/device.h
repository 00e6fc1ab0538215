#pragma once
// Where a rank computes and how its groups communicate: [run] device, gpu_memory_fraction and
// gpu_collectives turned into a kernel backend and a communicator wrapper.
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "comm/rank_groups.h"
#include "io/config.h"
#include "kernels/kernels.h"

namespace trainer {

// The CPU backend, or the CUDA backend on GPU (node-local rank) mod (GPUs on the node). Throws
// ConfigError, naming `origin`, when CUDA is asked for but not built or no GPU is visible.
std::unique_ptr<Kernels> make_kernels(const Config& cfg, const World& world,
                                      const std::string& origin);

// How device buffers are communicated: "nccl", "mpi" (staged through pinned host memory) or ""
// on the CPU. "auto" is NCCL unless ranks share a GPU (NCCL needs one GPU per rank).
std::string gpu_collectives(const Config& cfg, const World& world, const std::string& origin);

// The wrapper make_groups applies for those collectives (null on the CPU).
GroupWrapper group_wrapper(const Config& cfg, World& world, Kernels& kernels,
                           const std::string& origin);

}  // namespace trainer
