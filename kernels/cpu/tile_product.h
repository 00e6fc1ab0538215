#pragma once
// Small register-tiled products for the attention kernels, where the operands are a few rows of
// a matrix in cache and a strip of "panels" packed once per head, and under the float GEMM
// (panel_gemm.h), which packs its slices of B the same way. OpenBLAS answers each of these
// calls by packing both operands again and zeroing C in a separate pass; for attention's short
// inner dimension (the head size) and causal shapes that overhead, not the multiply-adds, set
// the pace. Written with GCC vector types of the widest registers -march gives (zmm with
// AVX-512), so one source serves float and double.
//
// A panel holds `lanes` columns of a matrix, row after row: element (k, l) of panel n sits at
// panels[n * panel_stride + k * lanes + l]. The left operand X is read through two strides, so
// that the same tile multiplies by X (row r, column k at x[r * rs + k * ks], rs = ld, ks = 1) and
// by X^T (rs = 1, ks = ld).
#include <algorithm>
#include <cassert>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "kernels/cpu/simd.h"

namespace trainer::cpu {

// AVX-512: 6 x 4 accumulators + 4 panel vectors + 1 in 32 registers; narrower: 6 x 2 + 2 + 1
// in 16.
constexpr int kTilePanels = kVectorBytes == 64 ? 4 : 2;
constexpr int kTileRows = 6;

inline namespace TRAINER_SIMD_NAMESPACE {  // the tiles depend on -march: see simd.h

// Keeps v as it is rounded here: GCC fuses alpha * acc + C into one multiply-add in some tile
// shapes and not in others (6 x 4 and 2 x 1 tiles gave other bits for the same element), and the
// bits of a product would depend on how its columns were cut among threads. An empty asm the
// value passes through, which no fusing crosses (on x86 and AArch64; elsewhere none is written).
template <class V>
[[gnu::always_inline]] inline void round_alone(V& v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+v"(v));  // v: any vector register (all 32 with AVX-512)
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#endif
}

// C(R rows, NC panels) = alpha * sum over k < kn of X(r, k) * panel row k [+ C when `add`], or
// with kBias + `bias` (one value per column, on every row) in place of C (`add` false). kBias is
// a template argument: a run-time test of the pointer made GCC spill the 24 accumulators before
// storing them, and the products without a bias 3-8% slower.
template <class T, int R, int NC, bool kBias>
inline void product_tile(const T* x, int64_t rs, int64_t ks, int64_t kn, const T* panels,
                         int64_t panel_stride, T* c, int64_t ldc, T alpha, bool add,
                         const T* bias) {
  using S = Simd<T>;
  typename S::Vec acc[R][NC] = {};
  for (int64_t k = 0; k < kn; k++) {
    typename S::Vec b[NC];
    for (int n = 0; n < NC; n++) b[n] = S::load(panels + n * panel_stride + k * S::lanes);
    for (int r = 0; r < R; r++) {
      const T a = x[r * rs + k * ks];
      for (int n = 0; n < NC; n++) acc[r][n] += a * b[n];
    }
  }
  for (int r = 0; r < R; r++)
    for (int n = 0; n < NC; n++) {
      T* out = c + r * ldc + n * S::lanes;
      typename S::Vec v = alpha * acc[r][n];
      round_alone(v);
      if constexpr (kBias)
        v += S::load(bias + n * S::lanes);
      else if (add)
        v += S::load(out);
      S::store(out, v);
    }
}

// The compile-time tile shapes for a run-time count: the largest NC <= kTilePanels that fits.
template <class T, int R, bool kBias, int NC = kTilePanels>
inline void product_panels(const T* x, int64_t rs, int64_t ks, int64_t kn, const T* panels,
                           int64_t panel_stride, int npanels, T* c, int64_t ldc, T alpha, bool add,
                           const T* bias) {
  if constexpr (NC > 0) {
    constexpr int L = Simd<T>::lanes;
    int n = 0;
    for (; n + NC <= npanels; n += NC)
      product_tile<T, R, NC, kBias>(x, rs, ks, kn, panels + n * panel_stride, panel_stride,
                                    c + n * L, ldc, alpha, add, kBias ? bias + n * L : nullptr);
    product_panels<T, R, kBias, NC - 1>(x, rs, ks, kn, panels + n * panel_stride, panel_stride,
                                        npanels - n, c + n * L, ldc, alpha, add,
                                        kBias ? bias + n * L : nullptr);
  }
}

// C(rows, npanels * lanes) = alpha * X(rows, kn) @ panels(kn, npanels * lanes) [+ C or + bias
// on every row], for rows <= kTileRows (callers step through their rows, each group with its own
// causal range).
template <class T, int R = kTileRows, bool kBias = false>
inline void product_rows(int rows, const T* x, int64_t rs, int64_t ks, int64_t kn, const T* panels,
                         int64_t panel_stride, int npanels, T* c, int64_t ldc, T alpha, bool add,
                         const T* bias = nullptr) {
  assert(rows >= 1 && rows <= kTileRows && !(add && bias));
  if constexpr (!kBias)
    if (bias)
      return product_rows<T, R, true>(rows, x, rs, ks, kn, panels, panel_stride, npanels, c, ldc,
                                      alpha, add, bias);
  if constexpr (R > 0) {
    if (rows == R)
      return product_panels<T, R, kBias>(x, rs, ks, kn, panels, panel_stride, npanels, c, ldc,
                                         alpha, add, bias);
    product_rows<T, R - 1, kBias>(rows, x, rs, ks, kn, panels, panel_stride, npanels, c, ldc, alpha,
                                  add, bias);
  }
}

// Packs rows [0, rows) x columns [0, cols) of a row-major matrix (leading dimension ld) as
// panels of its columns (panel stride rows * lanes), zero past `cols`.
template <class T>
void pack_column_panels(T* panels, const T* a, int64_t ld, int64_t rows, int cols) {
  using S = Simd<T>;
  const int L = S::lanes;
  for (int n = 0; n * L < cols; n++) {
    const int width = std::min(L, cols - n * L);
    for (int64_t k = 0; k < rows; k++)
      S::store(panels + (n * rows + k) * L, S::load_first(a + k * ld + n * L, width));
  }
}

namespace detail {
// One step of an L x L transpose in registers (L a power of two): rows i and i + s (i & s == 0)
// swap their off-diagonal blocks of s lanes. After the steps s = L / 2, ..., 2, 1, v[i] holds
// column i.
template <class T, int s, int... lane>
inline void transpose_step(typename Simd<T>::Vec* v, std::integer_sequence<int, lane...>) {
  using Index = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;
  typedef Index IVec __attribute__((vector_size(kVectorBytes)));
  constexpr int L = Simd<T>::lanes;
  constexpr IVec low = {Index((lane & s) == 0 ? lane : L + lane - s)...},
                 high = {Index((lane & s) == 0 ? lane + s : L + lane)...};
  for (int i = 0; i < L; i++)
    if ((i & s) == 0) {
      const auto a = v[i], b = v[i + s];
      v[i] = __builtin_shuffle(a, b, low);
      v[i + s] = __builtin_shuffle(a, b, high);
    }
  if constexpr (s > 1) transpose_step<T, s / 2>(v, std::integer_sequence<int, lane...>());
}
}  // namespace detail

// Packs the transpose of rows [0, rows) x columns [0, cols) as panels of its columns: panel n
// holds rows n * lanes... of `a` as columns (panel stride cols * lanes), zero past `rows`.
// Lanes x lanes blocks are transposed in registers: on W-S's attention shape (24 heads of 256 x
// 64) 61-64 -> 29 us against the element-by-element copy (and 43 -> 31 for the column panels).
template <class T>
void pack_transposed_panels(T* panels, const T* a, int64_t ld, int64_t rows, int cols) {
  using S = Simd<T>;
  constexpr int L = S::lanes;
  static_assert(L >= 2 && (L & (L - 1)) == 0, "the transpose pairs lanes by halves");
  for (int64_t n = 0; n * L < rows; n++) {
    const int height = int(std::min<int64_t>(L, rows - n * L));
    for (int k0 = 0; k0 < cols; k0 += L) {
      const int width = std::min(L, cols - k0);
      typename S::Vec v[L];
      for (int l = 0; l < L; l++)
        v[l] = l < height ? S::load_first(a + (n * L + l) * ld + k0, width) : typename S::Vec{};
      detail::transpose_step<T, L / 2>(v, std::make_integer_sequence<int, L>());
      for (int k = 0; k < width; k++) S::store(panels + (n * cols + k0 + k) * L, v[k]);
    }
  }
}

}  // namespace TRAINER_SIMD_NAMESPACE
}  // namespace trainer::cpu
