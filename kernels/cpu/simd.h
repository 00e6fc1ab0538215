#pragma once
// The widest vector registers -march gives (zmm with AVX-512), as GCC vector types, so that one
// source serves float and double: the attention's register tiles (tile_product.h) and the
// softmaxes' row loops (fast_math.h).
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace trainer::cpu {

#if defined(__AVX512F__)
constexpr int kVectorBytes = 64;
#elif defined(__AVX__)
constexpr int kVectorBytes = 32;
#else
constexpr int kVectorBytes = 16;
#endif

// Code on these types depends on -march: an inline namespace named by the vector width keeps two
// translation units built for different widths from sharing (and silently swapping) it. The
// headers built on them (fast_math.h) open it too.
#if defined(__AVX512F__)
#define TRAINER_SIMD_NAMESPACE simd_64_bytes
#elif defined(__AVX__)
#define TRAINER_SIMD_NAMESPACE simd_32_bytes
#else
#define TRAINER_SIMD_NAMESPACE simd_16_bytes
#endif
inline namespace TRAINER_SIMD_NAMESPACE {

template <class T>
struct Simd {
  typedef T Vec __attribute__((vector_size(kVectorBytes)));
  static constexpr int lanes = kVectorBytes / int(sizeof(T));
  static Vec load(const T* p) {
    Vec v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static void store(T* p, Vec v) { std::memcpy(p, &v, sizeof v); }
  // The first n <= lanes elements, zeros in the other lanes; their store; v with zeros past its
  // first n lanes. AVX-512 masks them (a memcpy of a run-time length is a call: the attention
  // backward's short rows took 14% longer with it).
  static Vec load_first(const T* p, int n) {
#if defined(__AVX512F__)
    if constexpr (sizeof(T) == 4) return Vec(_mm512_maskz_loadu_ps(mask(n), p));
    if constexpr (sizeof(T) == 8) return Vec(_mm512_maskz_loadu_pd(mask(n), p));
#endif
    if (n == lanes) return load(p);
    Vec v{};
    for (int l = 0; l < n; l++) v[l] = p[l];
    return v;
  }
  static void store_first(T* p, Vec v, int n) {
#if defined(__AVX512F__)
    if constexpr (sizeof(T) == 4) return _mm512_mask_storeu_ps(p, mask(n), __m512(v));
    if constexpr (sizeof(T) == 8) return _mm512_mask_storeu_pd(p, mask(n), __m512d(v));
#endif
    if (n == lanes) return store(p, v);
    for (int l = 0; l < n; l++) p[l] = v[l];
  }
  static Vec keep_first(Vec v, int n) {
#if defined(__AVX512F__)
    if constexpr (sizeof(T) == 4) return Vec(_mm512_maskz_mov_ps(mask(n), __m512(v)));
    if constexpr (sizeof(T) == 8) return Vec(_mm512_maskz_mov_pd(mask(n), __m512d(v)));
#endif
    Vec kept{};
    for (int l = 0; l < n; l++) kept[l] = v[l];
    return kept;
  }
#if defined(__AVX512F__)
  using Mask = std::conditional_t<sizeof(T) == 4, __mmask16, __mmask8>;
  static Mask mask(int n) {
    return Mask((1u << n) - 1);
  }
#endif
  static T sum(Vec v) {
    T s = 0;
    for (int l = 0; l < lanes; l++) s += v[l];
    return s;
  }
};

}  // namespace TRAINER_SIMD_NAMESPACE
}  // namespace trainer::cpu
