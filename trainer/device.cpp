#include "trainer/device.h"

#include <fmt/format.h>

#include "comm/staged_comm.h"
#ifdef TRAINER_WITH_CUDA
#include "comm/nccl_comm.h"
#endif

namespace trainer {

std::unique_ptr<Kernels> make_kernels(const Config& cfg, const World& world,
                                      const std::string& origin) {
  if (cfg.run.device == "cpu") return make_cpu_kernels();
  if (!cuda_built())
    throw ConfigError(fmt::format(
        "{}: [run] device = \"cuda\", but this trainer was built without CUDA (no nvcc at build "
        "time)",
        origin));
  const int gpus = cuda_device_count();
  if (gpus == 0)
    throw ConfigError(fmt::format("{}: [run] device = \"cuda\", but rank {} on {} sees no GPU",
                                  origin, world.rank(), world.host()));
  CudaOptions o;
  o.device = world.local_rank() % gpus;
  // The node's ranks on this GPU divide its memory between them.
  const int sharing = (world.local_size() - o.device + gpus - 1) / gpus;
  o.memory_fraction = cfg.run.gpu_memory_fraction / sharing;
  return make_cuda_kernels(o);
}

std::string gpu_collectives(const Config& cfg, const World& world, const std::string& origin) {
  if (cfg.run.device != "cuda") return "";
  const int gpus = cuda_device_count();
  const bool shared = world.local_size() > gpus;
  if (cfg.run.gpu_collectives == "nccl" && shared)
    throw ConfigError(fmt::format(
        "{}: [run] gpu_collectives = \"nccl\", but {} ranks share {} GPU(s) on {}: NCCL needs one "
        "GPU per rank (use \"mpi\" or \"auto\")",
        origin, world.local_size(), gpus, world.host()));
  if (cfg.run.gpu_collectives == "mpi" || shared) return "mpi";
  return "nccl";
}

GroupWrapper group_wrapper(const Config& cfg, World& world, Kernels& kernels,
                           const std::string& origin) {
  const std::string how = gpu_collectives(cfg, world, origin);
  if (how.empty()) return nullptr;
#ifdef TRAINER_WITH_CUDA
  if (how == "nccl")
    return [&world, &kernels](std::unique_ptr<Communicator> c) {
      return make_nccl_communicator(std::move(c), kernels, world);
    };
#endif
  return [&kernels](std::unique_ptr<Communicator> c) {
    return make_staged_communicator(std::move(c), kernels);
  };
}

}  // namespace trainer
