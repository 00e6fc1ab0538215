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
//  - The product is walked in column blocks and slices of the inner dimension (kPanelBytes of
//    panels): each slice of B is packed as panels (`lanes` columns each, row after row, as the
//    tiles read them), then the 6-row tiles run down the rows, reading A in place.
//  - The threads share C along its longer side a piece at a time (detail::SharedProduct), so
//    that a thread slowed down hands its work to the others; each packs its own panels of B,
//    which stay in its L2.
//  - Slices are as deep as A's strip lets L1 hold it: a 6 x 768 strip of A's rows is 18 KiB,
//    while A^T's strip takes a cache line for each k (384: 24 KiB). Each slice after the first
//    reads C back, and C rarely fits in a cache: alternated with slices 256 deep on the layers
//    of W-S, W-M and W-L with cold caches, 768 was 4-17% faster where A is read along its rows,
//    384 about 2% faster where it is read down its columns (512: 7% slower there).
// Each element of C sums the inner dimension in one order (slice after slice, k ascending in
// each) however many threads run: the bits do not depend on the thread count.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <thread>

#include "kernels/cpu/tile_product.h"

namespace trainer::cpu {

constexpr int64_t kPanelDepth = 768;            // the deepest slice where A is read along rows
constexpr int64_t kTransposedPanelDepth = 384;  // ... and where A is read down its columns
constexpr int64_t kPanelBytes = 768 << 10;      // the packed slice of B: 3/4 of Zen 5's L2
constexpr int64_t kPrefetchTileRows = 2;        // how far ahead A^T's strips are fetched
constexpr int64_t kPiecesPerThread = 16;        // how finely the threads share a product
constexpr int64_t kPieceTiles = 4;              // the narrowest piece of columns, in tiles

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

// One product: C(M, N) = alpha * op(A) @ op(B) [+ C when `add`, or + bias on every row when not
// null], op(A)(r, k) at a[r * rs + k * ks] (ks = 1: A's rows; rs = 1: its columns) and op(B)(k, n)
// at b[k * ldb + n] (or b[n * ldb + k] when trans_b).
template <class T>
struct Product {
  int64_t M, N, K;
  T alpha;
  const T* a;
  int64_t rs, ks;
  const T* b;
  int64_t ldb;
  bool trans_b, add;
  const T* bias;
  T* c;
  int64_t ldc;
  // Its columns [n0, n0 + width): a product of its own.
  Product columns(int64_t n0, int64_t width) const {
    Product p = *this;
    p.N = width;
    p.b += n0 * (trans_b ? ldb : 1);
    if (bias) p.bias += n0;
    p.c += n0;
    return p;
  }
};

// How a product is cut: slices of the inner dimension, each `slice` deep, and blocks of
// `columns` columns, one packed slice of B each (equal slices: 1000 = 500 + 500, not 768 + 232;
// as many whole tiles' columns as kPanelBytes holds).
struct Blocking {
  int64_t slice, columns;
  int64_t slices(int64_t K) const { return (K + slice - 1) / slice; }
  int64_t steps(int64_t N, int64_t K) const { return (N + columns - 1) / columns * slices(K); }
};
template <class T>
Blocking blocking(int64_t K, int64_t ks) {
  const int64_t deepest = ks == 1 ? kPanelDepth : kTransposedPanelDepth;
  const int64_t slices = (K + deepest - 1) / deepest, slice = (K + slices - 1) / slices;
  constexpr int64_t tile_columns = int64_t(kTilePanels) * Simd<T>::lanes;
  static_assert(kPanelBytes / int64_t(sizeof(T)) / kPanelDepth >= tile_columns);
  return {slice, kPanelBytes / int64_t(sizeof(T)) / slice / tile_columns * tile_columns};
}

// One slice of one column block: op(B)'s rows [k0, k0 + depth) x columns [n0, n0 + width).
struct Step {
  int64_t k0, n0;
  int depth, width;
};
// Step i of a product, column block by column block and slice by slice within each: the order in
// which every element's slices add, on one thread or shared.
template <class T>
Step step_of(const Product<T>& p, const Blocking& cut, int64_t i) {
  const int64_t slices = cut.slices(p.K), k0 = i % slices * cut.slice,
                n0 = i / slices * cut.columns;
  return {k0, n0, int(std::min(cut.slice, p.K - k0)), int(std::min(cut.columns, p.N - n0))};
}

// Packs a step's slice of B as panels (`lanes` columns each, row after row, as the tiles read
// them).
template <class T>
void pack_slice(T* panels, const Product<T>& p, const Step& s) {
  assert((s.width + Simd<T>::lanes - 1) / Simd<T>::lanes * Simd<T>::lanes * int64_t(s.depth) *
             int64_t(sizeof(T)) <=
         kPanelBytes);
  if (p.trans_b)
    pack_transposed_panels(panels, p.b + s.n0 * p.ldb + s.k0, p.ldb, s.width, s.depth);
  else
    pack_column_panels(panels, p.b + s.k0 * p.ldb + s.n0, p.ldb, s.depth, s.width);
}

// A step of the product on C's rows [r0, r1), in 6-row tiles from r0, its slice of B packed in
// `panels`: the first slice stores (adding the bias) unless the product adds to C, the others add.
template <class T>
void multiply_slice(const Product<T>& p, const Step& s, const T* panels, int64_t r0, int64_t r1) {
  constexpr int L = Simd<T>::lanes;
  const int whole = s.width / L, tail = s.width % L;
  const int64_t stride = int64_t(s.depth) * L, rs = p.rs, ks = p.ks;
  const bool accumulate = p.add || s.k0 > 0;
  const T* bias = s.k0 == 0 && p.bias ? p.bias + s.n0 : nullptr;
  for (int64_t r = r0; r < r1; r += kTileRows) {
    const int rows = int(std::min<int64_t>(kTileRows, r1 - r));
    const T* x = p.a + r * rs + s.k0 * ks;
    T* out = p.c + r * p.ldc + s.n0;
    // A^T's strip takes a cache line for each k, each on a page of its own where A's rows are
    // long: no hardware prefetcher follows that, and each tile row waited on memory for its
    // lines. This fetches those of the strip kPrefetchTileRows ahead while this one multiplies
    // (its last element for each k: its first shares a line with the strip before it, or starts
    // the line). Alternated, cold caches: W-S's head weight gradient 318 -> 351 GFLOP/s, the
    // layers' and heads' A^T shapes of W-S, W-M and W-L together 324 -> 339.
    if (ks != 1 && r + (kPrefetchTileRows + 1) * kTileRows <= p.M)
      for (int k = 0; k < s.depth; k++)
        __builtin_prefetch(x + (kPrefetchTileRows + 1) * kTileRows - 1 + k * ks);
    product_rows<T>(rows, x, rs, ks, s.depth, panels, stride, whole, out, p.ldc, p.alpha,
                    accumulate, bias);
    if (tail) {  // a last panel narrower than a vector: through a tile, then its columns
      alignas(64) T tile[kTileRows * L];
      product_rows<T>(rows, x, rs, ks, s.depth, panels + whole * stride, stride, 1, tile, L,
                      p.alpha, false);
      for (int i = 0; i < rows; i++)
        for (int l = 0; l < tail; l++) {
          T& o = out[i * p.ldc + whole * L + l];
          T v = tile[i * L + l];
          if (accumulate) v += o;
          if (bias) v += bias[whole * L + l];
          o = v;
        }
    }
  }
}

// The whole product on one thread: step by step, each slice of B packed into `panels` and
// multiplied by all of A's rows.
template <class T>
void multiply_alone(const Product<T>& p, T* panels) {
  const Blocking cut = blocking<T>(p.K, p.ks);
  for (int64_t i = 0; i < cut.steps(p.N, p.K); i++) {
    const Step s = step_of(p, cut, i);
    pack_slice(panels, p, s);
    multiply_slice(p, s, panels, 0, p.M);
  }
}

// Waits until `counter` reaches `value`: spinning (x86's pause) while the thread it waits for is
// likely running, then giving the core away, which that thread may need (more threads than cores,
// a busy neighbour).
inline void wait_for(const std::atomic<int64_t>& counter, int64_t value) {
  for (int spins = 0; counter.load(std::memory_order_acquire) < value; spins++) {
    if (spins < 1024) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }
}

// A product shared among threads a piece at a time: each thread that has scratch for B's panels
// calls take_pieces, which returns when no piece is left. Pieces are not bound to threads, so
// one slowed down (a busy neighbour on its core, an interrupt, the other hyperthread) leaves its
// share to the others instead of holding them at the end: with a busy loop on one of the two
// cores, W-M's layer and head shapes ran at 235 GFLOP/s against 153 when each thread had half of
// every product. Each element of C still sums its slices in order, one thread at a time: the
// bits do not depend on the threads.
template <class T>
class SharedProduct {
 public:
  // Cut for `threads` threads, kPiecesPerThread pieces each if they all ran at one speed.
  SharedProduct(const Product<T>& p, int threads)
      : p_(p),
        cut_(blocking<T>(p.K, p.ks)),
        by_rows_(p.M >= p.N),
        piece_rows_(((p.M + kTileRows - 1) / kTileRows + threads * kPiecesPerThread - 1) /
                    (threads * kPiecesPerThread) * kTileRows),
        row_pieces_(by_rows_ ? (p.M + piece_rows_ - 1) / piece_rows_ : 0),
        piece_columns_(piece_columns(p, cut_, threads * kPiecesPerThread)),
        ranges_(threads),
        cursors_(new Cursor[ranges_]),
        done_(new std::atomic<int64_t>[row_pieces_]()) {}

  // Takes pieces until none is left: `thread` (0, 1...) says which range to start with.
  void take_pieces(T* panels, int thread) {
    int64_t packed = -1;  // the step whose slice `panels` holds (rows shared)
    for (int r = 0; r < ranges_; r++) {
      const int range = (thread + r) % ranges_;
      if (by_rows_)
        take_rows(panels, range, packed);
      else
        take_columns(panels, range);
    }
  }

 private:
  // Where C is at least as tall as wide, pieces of rows, step by step (a step: one slice of one
  // column block). Each thread has a range of consecutive pieces (its even share of the rows),
  // which it takes (step, piece) pair by pair, in order, from the range's cursor,
  // packing the slice of each new step (into its own L2); then it takes what is left of the
  // others' ranges the same way. A piece waits for its rows' previous step where a slower thread
  // still holds that (done_: how many steps of each piece are done), so that each element's
  // slices add in order; a thread is held only there, not at the end of every step.
  void take_rows(T* panels, int range, int64_t& packed) {
    const int64_t first = range * row_pieces_ / ranges_,
                  count = (range + 1) * row_pieces_ / ranges_ - first;
    if (count == 0) return;
    const int64_t pairs = cut_.steps(p_.N, p_.K) * count;
    std::atomic<int64_t>& cursor = cursors_[range].next;
    for (int64_t u; (u = cursor.fetch_add(1, std::memory_order_relaxed)) < pairs;) {
      const int64_t step = u / count, piece = first + u % count;
      const Step s = step_of(p_, cut_, step);
      if (step != packed) {
        pack_slice(panels, p_, s);
        packed = step;
      }
      wait_for(done_[piece], step);
      const int64_t r0 = piece * piece_rows_;
      multiply_slice(p_, s, panels, r0, std::min(p_.M, r0 + piece_rows_));
      done_[piece].store(step + 1, std::memory_order_release);
    }
  }
  // Where C is wider than tall, pieces of whole tiles' columns, each a product of its own, taken
  // in order from each thread's range of columns (its even share of whole panels), then from
  // the others'.
  void take_columns(T* panels, int range) {
    constexpr int L = Simd<T>::lanes;
    const int64_t panels_in_c = (p_.N + L - 1) / L;
    const int64_t c0 = range * panels_in_c / ranges_ * L,
                  c1 = std::min(p_.N, (range + 1) * panels_in_c / ranges_ * L);
    std::atomic<int64_t>& cursor = cursors_[range].next;
    for (int64_t n0;
         (n0 = c0 + cursor.fetch_add(1, std::memory_order_relaxed) * piece_columns_) < c1;)
      multiply_alone(p_.columns(n0, std::min(piece_columns_, c1 - n0)), panels);
  }
  // Each piece reads all of A's strips again, and each strip serves the piece's tiles from L1: at
  // least kPieceTiles tiles wide, and as wide as a block where A is read down its columns (a
  // cache line for each k of a strip; a share of one block is then one piece, which no other
  // thread can take over: weight gradients wider than tall over few columns keep fixed shares).
  static int64_t piece_columns(const Product<T>& p, const Blocking& cut, int64_t pieces) {
    constexpr int64_t tile_columns = int64_t(kTilePanels) * Simd<T>::lanes;
    if (p.ks != 1) return cut.columns;
    return std::clamp(p.N / pieces / tile_columns * tile_columns,
                      std::min(cut.columns, kPieceTiles * tile_columns), cut.columns);
  }

  struct alignas(64) Cursor {  // a cache line each: the threads take from them at once
    std::atomic<int64_t> next{0};
  };
  const Product<T> p_;
  const Blocking cut_;
  const bool by_rows_;
  const int64_t piece_rows_, row_pieces_, piece_columns_;
  const int ranges_;
  const std::unique_ptr<Cursor[]> cursors_;
  const std::unique_ptr<std::atomic<int64_t>[]> done_;
};

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
  const detail::Product<T> p{.M = M,
                             .N = N,
                             .K = K,
                             .alpha = alpha,
                             .a = A,
                             .rs = trans_a ? 1 : lda,
                             .ks = trans_a ? lda : 1,
                             .b = B,
                             .ldb = ldb,
                             .trans_b = trans_b,
                             .add = beta != T(0),
                             .bias = bias,
                             .c = C,
                             .ldc = ldc};
  const int threads = omp_get_max_threads();
  if (threads == 1 || !panel_gemm_shares(M, N, K)) {
    T* panels = detail::panel_scratch<T>();
    if (!panels) throw std::bad_alloc();
    return detail::multiply_alone(p, panels);
  }
  detail::SharedProduct<T> shared(p, threads);
  bool computed = false;  // by some thread: one without scratch leaves its pieces to the others
#pragma omp parallel reduction(|| : computed)
  {
    if (T* panels = detail::panel_scratch<T>()) {
      shared.take_pieces(panels, omp_get_thread_num());
      computed = true;
    }
  }
  if (!computed) throw std::bad_alloc();  // here: an exception may not leave a thread
}

}  // namespace TRAINER_SIMD_NAMESPACE
}  // namespace trainer::cpu
