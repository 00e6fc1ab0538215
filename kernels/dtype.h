#pragma once
// Element types the kernels understand, and a typed device pointer that carries its dtype so
// that buffers of different precisions can be passed through one backend-neutral interface.
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace trainer {

enum class DType : uint8_t {
  f32,  // the training dtype of the CPU backend
  f64,  // reference precision for finite-difference tests
};

constexpr size_t dtype_size(DType t) {
  return t == DType::f64 ? 8 : 4;
}
constexpr std::string_view dtype_name(DType t) {
  return t == DType::f64 ? "f64" : "f32";
}

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::f32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::f64;
}

// A pointer into backend memory plus its element type. Arithmetic is in elements.
struct DPtr {
  std::byte* p = nullptr;
  DType dtype = DType::f32;

  DPtr operator+(int64_t elems) const {
    return {p + elems * static_cast<int64_t>(dtype_size(dtype)), dtype};
  }
  template <class T>
  T* as() const {
    assert(dtype == dtype_of<T>());
    return reinterpret_cast<T*>(p);
  }
  explicit operator bool() const { return p != nullptr; }
};

}  // namespace trainer
