// The CUDA entry points of a build without nvcc: no devices, and a clear error if asked for one.
#include <stdexcept>

#include "kernels/kernels.h"

namespace trainer {

bool cuda_built() {
  return false;
}
int cuda_device_count() {
  return 0;
}
std::array<std::byte, 16> cuda_device_uuid(int) {
  throw std::runtime_error("cuda_device_uuid: this trainer was built without CUDA");
}
std::unique_ptr<Kernels> make_cuda_kernels(const CudaOptions&) {
  throw std::runtime_error(
      "this trainer was built without CUDA (no nvcc at build time): rebuild with the CUDA "
      "toolkit installed, or set [run] device = \"cpu\"");
}

}  // namespace trainer
