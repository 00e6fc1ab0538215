#pragma once
// Element types the kernels understand, and a typed device pointer that carries its dtype so
// that buffers of different precisions can be passed through one backend-neutral interface.
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "kernels/half.h"

namespace trainer {

enum class DType : uint8_t {
  f32,   // master weights, optimizer state, fp32 training
  f64,   // reference precision for finite-difference tests
  bf16,  // mixed-precision storage (computed in fp32 on the CPU)
  f16,
  u8,  // raw bytes: compressed gradients on the wire (never a kernel argument)
};

constexpr size_t dtype_size(DType t) {
  return t == DType::f64 ? 8 : t == DType::f32 ? 4 : t == DType::u8 ? 1 : 2;
}
constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::f64:
      return "f64";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::u8:
      return "u8";
  }
  return "?";
}
constexpr bool is_half(DType t) {
  return t == DType::bf16 || t == DType::f16;
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
template <>
constexpr DType dtype_of<bf16>() {
  return DType::bf16;
}
template <>
constexpr DType dtype_of<f16>() {
  return DType::f16;
}
template <>
constexpr DType dtype_of<std::byte>() {
  return DType::u8;
}

// A pointer into backend memory plus its element type and where it lives: host memory (the CPU
// backend's, and host buffers handed to collectives) or a device's, which the host cannot
// dereference (communicators move such buffers with NCCL or stage them through host memory).
// Arithmetic is in elements.
struct DPtr {
  std::byte* p = nullptr;
  DType dtype = DType::f32;
  bool device = false;

  DPtr operator+(int64_t elems) const {
    return {p + elems * static_cast<int64_t>(dtype_size(dtype)), dtype, device};
  }
  template <class T>
  T* as() const {
    assert(dtype == dtype_of<T>());
    return reinterpret_cast<T*>(p);
  }
  explicit operator bool() const { return p != nullptr; }
};

// A host array as a DPtr (the CPU backend's memory, and host buffers handed to collectives).
template <class T>
DPtr host_ptr(T* p) {
  return {reinterpret_cast<std::byte*>(p), dtype_of<std::remove_const_t<T>>()};
}

}  // namespace trainer
