#include "trainer/device.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <exception>
#include <vector>

#include "comm/staged_comm.h"
#ifdef TRAINER_WITH_NCCL
#include "comm/nccl_comm.h"
#endif

namespace trainer {

using Uuid = std::array<std::byte, 16>;

#ifdef TRAINER_WITH_NCCL
constexpr bool kNcclBuilt = true;
#else
constexpr bool kNcclBuilt = false;  // GPU collectives through MPI, staged in host memory
#endif

GpuPlacement place_on_gpus(const Config& cfg, World& world, const std::string& origin) {
  if (cfg.run.device == "cpu") return {};
  if (!cuda_built())  // the same binary on every rank
    throw ConfigError(fmt::format(
        "{}: [run] device = \"cuda\", but this trainer was built without CUDA (no nvcc at build "
        "time)",
        origin));
  GpuPlacement p;
  const int gpus = cuda_device_count();
  Uuid mine{};  // all zeros: no GPU
  if (gpus > 0) {
    p.device = world.local_rank() % gpus;
    try {  // thrown here, it would leave the other ranks waiting in the gather
      mine = cuda_device_uuid(p.device);
    } catch (const std::exception&) {  // stays all zeros: reported below as no GPU
    }
  }
  std::vector<Uuid> all(size_t(world.size()));
  world.comm().all_gather(host_ptr(mine.data()), host_ptr(all.front().data()),
                          int64_t(mine.size()));
  for (int r = 0; r < world.size(); ++r)
    if (all[size_t(r)] == Uuid{})
      throw ConfigError(fmt::format("{}: [run] device = \"cuda\", but rank {} on {} sees no GPU",
                                    origin, r, world.host_of(r)));
  p.ranks_on_gpu = int(std::count(all.begin(), all.end(), mine));
  int most_sharing = 1, shared_by = 0;  // the first rank on the most shared GPU
  for (int r = 0; r < world.size(); ++r) {
    const int n = int(std::count(all.begin(), all.end(), all[size_t(r)]));
    if (n > most_sharing) most_sharing = n, shared_by = r;
  }
  if (cfg.run.gpu_collectives == "nccl" && !kNcclBuilt)
    throw ConfigError(fmt::format(
        "{}: [run] gpu_collectives = \"nccl\", but this trainer was built without NCCL (use "
        "\"mpi\" or \"auto\", or rebuild with NCCL found: cmake -DNCCL_ROOT=...)",
        origin));
  if (cfg.run.gpu_collectives == "nccl" && most_sharing > 1)
    throw ConfigError(fmt::format(
        "{}: [run] gpu_collectives = \"nccl\", but {} ranks share the GPU of rank {} on {}: NCCL "
        "needs one GPU per rank (use \"mpi\" or \"auto\")",
        origin, most_sharing, shared_by, world.host_of(shared_by)));
  p.collectives =
      cfg.run.gpu_collectives == "mpi" || most_sharing > 1 || !kNcclBuilt ? "mpi" : "nccl";
  return p;
}

std::unique_ptr<Kernels> make_kernels(const Config& cfg, const GpuPlacement& placement) {
  if (placement.device < 0) return make_cpu_kernels();
  CudaOptions o;
  o.device = placement.device;
  o.memory_fraction = cfg.run.gpu_memory_fraction / placement.ranks_on_gpu;
  return make_cuda_kernels(o);
}

GroupWrapper group_wrapper(const GpuPlacement& placement, [[maybe_unused]] World& world,
                           Kernels& kernels) {
  if (placement.collectives.empty()) return nullptr;
#ifdef TRAINER_WITH_NCCL
  if (placement.collectives == "nccl")
    return [&world, &kernels](std::unique_ptr<Communicator> c, const std::string&) {
      return make_nccl_communicator(std::move(c), kernels, world);
    };
#endif
  return [&kernels](std::unique_ptr<Communicator> c, const std::string&) {
    return make_staged_communicator(std::move(c), kernels);
  };
}

}  // namespace trainer
