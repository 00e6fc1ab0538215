#pragma once
// Calls f(T{}) with T the storage type of a CUDA buffer's dtype.
#include <stdexcept>
#include <string>

#include "kernels/dtype.h"

namespace trainer::cuda {

template <class F>
void dispatch(DType t, F&& f) {
  switch (t) {
    case DType::f32:
      return f(float{});
    case DType::bf16:
      return f(bf16{});
    case DType::f16:
      return f(f16{});
    case DType::f64:
    case DType::u8:
      break;
  }
  throw std::invalid_argument("the CUDA backend computes in f32, bf16 or f16, not " +
                              std::string(dtype_name(t)));
}

// Per-row statistics and optimizer state are fp32 on the GPU.
inline float* f32(DPtr p) {
  if (p && p.dtype != DType::f32)
    throw std::invalid_argument("the CUDA backend keeps statistics in f32, not " +
                                std::string(dtype_name(p.dtype)));
  return reinterpret_cast<float*>(p.p);
}

template <class T>
T* typed(DPtr p) {
  return reinterpret_cast<T*>(p.p);
}

}  // namespace trainer::cuda
