#pragma once
// The layers' float GEMM on AVX-512: GotoBLAS's blocking around the attention's register tiles
// (tile_product.h), in place of OpenBLAS's sgemm. Why our own: OpenBLAS 0.3.21 (Debian 12) has
// no kernels for current CPUs of its own (this AMD Zen 5 runs its Cooperlake ones, or Haswell's
// where a site pins OPENBLAS_CORETYPE, as this workplace does: half the rate), and on the narrow
// layers of small models it packs both operands and syncs its threads for little work. On this
// machine, alternated in one session: W-S 1675 against 904 tokens/s under the Haswell pin, and
// +6% against the Cooperlake kernels; W-M and W-L within the machine's drift of Cooperlake (README:
// Benchmark).
//
//  - The threads split C into one block each along its longer side (rows of A or columns of B),
//    so that no thread waits for another; each packs its own panels of B, which stay in its L2.
//  - A thread walks its block in column blocks and slices of the inner dimension (kPanelBytes of
//    panels), packs that slice of B as panels (`lanes` columns each, row after row, as the tiles
//    read them) and runs the 6-row tiles down all its rows, reading A in place.
//  - Slices are as deep as A's strip lets L1 hold it: a 6 x 768 strip of A's rows is 18 KiB,
//    while A^T's strip takes a cache line for each k (384: 24 KiB). Each slice after the first
//    reads C back, and C rarely fits in a cache: alternated with slices 256 deep on the layers
//    of W-S, W-M and W-L with cold caches, 768 was 4-17% faster where A is read along its rows,
//    384 about 2% faster where it is read down its columns (512: 7% slower there).
// Each element of C sums the inner dimension in one order (slice after slice, k ascending in
// each) however many threads run: the bits do not depend on the thread count.
#include <omp.h>

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>

#include "kernels/cpu/tile_product.h"

namespace trainer::cpu {

constexpr int64_t kPanelDepth = 768;            // the deepest slice where A is read along rows
constexpr int64_t kTransposedPanelDepth = 384;  // ... and where A is read down its columns
constexpr int64_t kPanelBytes = 768 << 10;      // the packed slice of B: 3/4 of Zen 5's L2
constexpr int64_t kPrefetchTileRows = 2;        // how far ahead A^T's strips are fetched

inline namespace TRAINER_SIMD_NAMESPACE {

namespace detail {

// One thread's scratch for B's panels, kept from call to call (as OpenBLAS keeps its buffers):
// packing into memory that was just allocated would fault its pages in on every call.
template <class T>
T* panel_scratch() {
  constexpr size_t bytes = kPanelBytes;  // a multiple of the alignment, as aligned_alloc needs
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<T, Free> scratch(static_cast<T*>(std::aligned_alloc(64, bytes)));
  return scratch.get();  // null when out of memory: the caller throws, outside its threads
}

// C(M, N) = alpha * op(A) @ op(B) [+ C when `add`, or + bias on every row when not null] on one
// thread, op(A)(r, k) at a[r * rs + k * ks] (ks = 1: A's rows; rs = 1: its columns) and op(B)(k, n)
// at b[k * ldb + n] (or b[n * ldb + k] when trans_b). False, with C untouched, when the thread's
// scratch could not be allocated.
template <class T>
bool panel_gemm_block(bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* a,
                      int64_t rs, int64_t ks, const T* b, int64_t ldb, bool add, const T* bias,
                      T* c, int64_t ldc) {
  constexpr int L = Simd<T>::lanes;
  T* panels = panel_scratch<T>();
  if (!panels) return false;
  // Equal slices (1000 = 500 + 500, not 768 + 232), and as many whole tiles' columns as fit.
  const int64_t deepest = ks == 1 ? kPanelDepth : kTransposedPanelDepth;
  const int64_t slices = (K + deepest - 1) / deepest, slice = (K + slices - 1) / slices;
  constexpr int64_t tile_columns = int64_t(kTilePanels) * L;
  static_assert(kPanelBytes / int64_t(sizeof(T)) / kPanelDepth >= tile_columns);
  const int64_t columns = kPanelBytes / int64_t(sizeof(T)) / slice / tile_columns * tile_columns;
  for (int64_t n0 = 0; n0 < N; n0 += columns) {
    const int width = int(std::min<int64_t>(columns, N - n0));
    const int whole = width / L, tail = width % L;
    for (int64_t k0 = 0; k0 < K; k0 += slice) {
      const int depth = int(std::min<int64_t>(slice, K - k0));
      assert((width + L - 1) / L * L * int64_t(depth) * int64_t(sizeof(T)) <= kPanelBytes);
      if (trans_b)
        pack_transposed_panels(panels, b + n0 * ldb + k0, ldb, width, depth);
      else
        pack_column_panels(panels, b + k0 * ldb + n0, ldb, depth, width);
      // The first slice overwrites C (with the product + bias) unless beta != 0 (C was scaled).
      const bool accumulate = add || k0 > 0;
      const T* slice_bias = k0 == 0 && bias ? bias + n0 : nullptr;
      const int64_t stride = int64_t(depth) * L;
      for (int64_t r0 = 0; r0 < M; r0 += kTileRows) {
        const int rows = int(std::min<int64_t>(kTileRows, M - r0));
        const T* x = a + r0 * rs + k0 * ks;
        T* out = c + r0 * ldc + n0;
        // A^T's strip takes a cache line for each k, each on a page of its own where A's rows are
        // long: no hardware prefetcher follows that, and each tile row waited on memory for its
        // lines. This fetches those of the strip kPrefetchTileRows ahead while this one
        // multiplies (its last element for each k: its first shares a line with the strip before
        // it, or starts the line). Alternated, cold caches: W-S's head weight gradient 318 -> 351
        // GFLOP/s, the layers' and heads' A^T shapes of W-S, W-M and W-L together 324 -> 339.
        if (ks != 1 && r0 + (kPrefetchTileRows + 1) * kTileRows <= M)
          for (int k = 0; k < depth; k++)
            __builtin_prefetch(x + (kPrefetchTileRows + 1) * kTileRows - 1 + k * ks);
        product_rows<T>(rows, x, rs, ks, depth, panels, stride, whole, out, ldc, alpha, accumulate,
                        slice_bias);
        if (tail) {  // a last panel narrower than a vector: through a tile, then its columns
          alignas(64) T tile[kTileRows * L];
          product_rows<T>(rows, x, rs, ks, depth, panels + whole * stride, stride, 1, tile, L,
                          alpha, false);
          for (int r = 0; r < rows; r++)
            for (int l = 0; l < tail; l++) {
              T& o = out[r * ldc + whole * L + l];
              T v = tile[r * L + l];
              if (accumulate) v += o;
              if (slice_bias) v += slice_bias[whole * L + l];
              o = v;
            }
        }
      }
    }
  }
  return true;
}

}  // namespace detail

// C(M, N) = beta * C + bias(N) on every row (C unread when beta = 0, nothing added when bias is
// null): what a GEMM whose products only store or accumulate does first.
template <class T>
void scale_and_add_bias(int64_t M, int64_t N, T beta, T* C, int64_t ldc, const T* bias) {
#pragma omp parallel for schedule(static) if (!omp_in_parallel())
  for (int64_t r = 0; r < M; r++)
    for (int64_t n = 0; n < N; n++) {
      T v = beta == T(0) ? T(0) : beta * C[r * ldc + n];
      if (bias) v += bias[n];
      C[r * ldc + n] = v;
    }
}

// Whether panel_gemm shares this product among the threads: not inside a parallel region, and not
// under a million multiply-adds (a few microseconds' work, about what waking threads costs).
inline bool panel_gemm_shares(int64_t M, int64_t N, int64_t K) {
  return !omp_in_parallel() && M * N * K >= (int64_t(1) << 20);
}

// Row-major C(M, N) = alpha * op(A)(M, K) @ op(B)(K, N) + beta * C [+ bias(N) on every row], as
// cblas_?gemm (A and B unread when alpha = 0 or K = 0, C unread when beta = 0) with a bias added
// as the tiles are stored; shared among the threads as panel_gemm_shares says.
template <class T>
void panel_gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
                int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc,
                const T* bias = nullptr) {
  if (M <= 0 || N <= 0) return;
  // The tiles store the product, add it to C, or add it to the bias. Anything else (beta other
  // than 0 or 1, C and a bias both, nothing to multiply) takes a pass over C first.
  const bool empty = K <= 0 || alpha == T(0);
  if ((beta != T(0) && beta != T(1)) || (bias && beta != T(0)) ||
      (empty && (beta == T(0) || bias))) {
    scale_and_add_bias(M, N, beta, C, ldc, bias);
    beta = T(1), bias = nullptr;
  }
  if (empty) return;
  const bool add = beta != T(0);
  constexpr int L = Simd<T>::lanes;
  const int64_t rs = trans_a ? 1 : lda, ks = trans_a ? lda : 1;
  const bool split_rows = M >= N;
  bool out_of_memory = false;
#pragma omp parallel if (panel_gemm_shares(M, N, K)) reduction(|| : out_of_memory)
  {
    const int threads = omp_get_num_threads(), t = omp_get_thread_num();
    if (split_rows) {  // whole 6-row tiles to each thread
      const int64_t tiles = (M + kTileRows - 1) / kTileRows;
      const int64_t r0 = tiles * t / threads * kTileRows,
                    r1 = std::min(M, tiles * (t + 1) / threads * kTileRows);
      if (r1 > r0)
        out_of_memory = !detail::panel_gemm_block(trans_b, r1 - r0, N, K, alpha, A + r0 * rs, rs,
                                                  ks, B, ldb, add, bias, C + r0 * ldc, ldc);
    } else {  // whole panels to each thread
      const int64_t panels = (N + L - 1) / L;
      const int64_t n0 = panels * t / threads * L, n1 = std::min(N, panels * (t + 1) / threads * L);
      if (n1 > n0)
        out_of_memory = !detail::panel_gemm_block(trans_b, M, n1 - n0, K, alpha, A, rs, ks,
                                                  B + n0 * (trans_b ? ldb : 1), ldb, add,
                                                  bias ? bias + n0 : nullptr, C + n0, ldc);
    }
  }
  if (out_of_memory) throw std::bad_alloc();  // here: an exception may not leave a thread
}

}  // namespace TRAINER_SIMD_NAMESPACE
}  // namespace trainer::cpu
