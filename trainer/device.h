#pragma once
// Where a rank computes and how its groups communicate: [run] device, gpu_memory_fraction and
// gpu_collectives turned into a GPU placement, a kernel backend and a communicator wrapper.
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "comm/rank_groups.h"
#include "io/config.h"
#include "kernels/kernels.h"

namespace trainer {

struct GpuPlacement {
  int device = -1;          // this rank's GPU (node-local rank mod GPUs visible); -1: the CPU
  int ranks_on_gpu = 1;     // ranks of the job computing on this rank's physical GPU
  std::string collectives;  // how device buffers travel: "nccl", "mpi" (staged), "" on the CPU
};

// Collective over the world when [run] device = "cuda": the ranks compare the UUIDs of their
// GPUs, so that sharing is seen whatever CUDA_VISIBLE_DEVICES each rank has, and every rank
// takes the same decisions. Throws the same ConfigError on every rank, naming `origin`, when
// CUDA is not built, a rank sees no GPU, or NCCL is asked for on a shared GPU.
GpuPlacement place_on_gpus(const Config& cfg, World& world, const std::string& origin);

// The CPU backend, or the CUDA backend on the placement's GPU with its share of the memory.
std::unique_ptr<Kernels> make_kernels(const Config& cfg, const GpuPlacement& placement);

// The wrapper make_groups applies for the placement's collectives (null on the CPU).
GroupWrapper group_wrapper(const GpuPlacement& placement, World& world, Kernels& kernels);

}  // namespace trainer
