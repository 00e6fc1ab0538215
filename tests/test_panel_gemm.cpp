// The panel GEMM (kernels/cpu/panel_gemm.h) against a naive double product: all four
// transposes; shapes with partial 6-row tiles and partial vector panels, inner dimensions of one
// slice and of several, more columns than one packed block; beta 0 (C's old values, NaN here,
// ignored), 1 and another; a bias on every row; leading dimensions longer than the rows; on 1, 2
// and 3 threads, split both ways. Its bits do not depend on the number of threads, and empty
// products only scale C.
// The threads share a product a piece at a time, any piece to any thread.
// Built for every vector width (tests/CMakeLists.txt).
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <latch>
#include <memory>
#include <new>
#include <thread>
#include <vector>

#include "kernels/cpu/panel_gemm.h"
#include "tests/test_util.h"

namespace trainer::cpu {
namespace {

using test::random_vector;

struct Shape {
  int64_t M, N, K;
};

struct Product {
  bool ta, tb;
  Shape s;
  int64_t lda, ldb, ldc;
  std::vector<float> a, b, c;
  Product(bool ta_, bool tb_, Shape s_) : ta(ta_), tb(tb_), s(s_) {
    // Stored rows longer than the logical ones, by an odd amount.
    lda = (ta ? s.M : s.K) + 3, ldb = (tb ? s.K : s.N) + 5, ldc = s.N + 7;
    a = random_vector<float>(size_t(ta ? s.K : s.M) * lda, 11);
    b = random_vector<float>(size_t(tb ? s.N : s.K) * ldb, 12);
    c = random_vector<float>(size_t(s.M) * ldc, 13);
  }
  // The product alpha * op(A) @ op(B) + C over `out` (or + bias, where there is one), as
  // panel_gemm hands it to threads.
  detail::Product<float> shared(float alpha, std::vector<float>& out,
                                const float* bias = nullptr) const {
    return {.M = s.M,
            .N = s.N,
            .K = s.K,
            .alpha = alpha,
            .a = a.data(),
            .rs = ta ? 1 : lda,
            .ks = ta ? lda : 1,
            .b = b.data(),
            .ldb = ldb,
            .trans_b = tb,
            .add = bias == nullptr,
            .bias = bias,
            .c = out.data(),
            .ldc = ldc};
  }
  float A(int64_t r, int64_t k) const { return ta ? a[k * lda + r] : a[r * lda + k]; }
  float B(int64_t k, int64_t n) const { return tb ? b[n * ldb + k] : b[k * ldb + n]; }
  std::vector<float> run(float alpha, float beta, std::vector<float> out,
                         const float* bias = nullptr) const {
    panel_gemm<float>(ta, tb, s.M, s.N, s.K, alpha, a.data(), lda, b.data(), ldb, beta, out.data(),
                      ldc, bias);
    return out;
  }
  // The elements of `got` = alpha * op(A) @ op(B) + beta * c [+ bias] that are wrong, the first
  // reported. Float sums of K products in some order: each element within 1e-6 of the sum of
  // the terms' magnitudes (rounding adds ~sqrt(K) * 2^-24 of it; a term lost or counted twice is
  // ~1/K of it). Elements past each row of C must be untouched.
  int wrong(float alpha, float beta, const std::vector<float>& c, const std::vector<float>& got,
            const float* bias = nullptr) const {
    int wrong = 0;
    for (int64_t r = 0; r < s.M; r++)
      for (int64_t n = 0; n < ldc; n++) {
        const float old = c[r * ldc + n], out = got[r * ldc + n];
        if (n >= s.N) {
          wrong += !(out == old);
          continue;
        }
        double sum = 0, magnitude = 0;
        for (int64_t k = 0; k < s.K; k++) {
          const double term = double(A(r, k)) * double(B(k, n));
          sum += term, magnitude += std::abs(term);
        }
        const double kept = beta == 0.0f ? 0.0 : beta * double(old), add = bias ? bias[n] : 0.0;
        const double want = alpha * sum + kept + add;
        const double bound = 1e-6 * (alpha * magnitude + std::abs(kept) + std::abs(add));
        if (!(std::abs(out - want) <= bound) && wrong++ == 0)
          ADD_FAILURE() << "C(" << r << ", " << n << ") = " << out << ", want " << want;
      }
    return wrong;
  }
};

TEST(PanelGemm, MatchesTheNaiveProduct) {
  const int L = Simd<float>::lanes;
  // Slices kPanelDepth deep leave room for fewer than 800 columns in a block.
  static_assert(kPanelBytes / sizeof(float) / kPanelDepth < 800);
  static_assert(2 * kTransposedPanelDepth < kPanelDepth + 40);  // as the comments below say
  const std::vector<Shape> shapes = {
      {1, 1, 1},                      // one element
      {kTileRows + 1, 2 * L + 3, 7},  // partial tiles and panel
      // M < N: threads split the columns; two slices of k (three with A^T).
      {29, 150, kPanelDepth + 40},
      // M > N: threads split the rows; three slices (five with A^T).
      {151, 29, 2 * kPanelDepth + 100},
      {12, 16, 8000},  // one panel: a third thread has none
      // The deepest slices, whose column blocks are narrower than each thread's columns.
      {kTileRows + 1, 1600 + L / 2, 3 * kPanelDepth},
      {3, 1300, 40},              // a short, wide product
      {2 * kTileRows, 4 * L, 1},  // whole tiles, one k
  };
  // On one thread, and on two and three that split the rows or the columns.
  for (int team : {1, 2, 3})
    for (const Shape& s : shapes)
      for (bool ta : {false, true})
        for (bool tb : {false, true})
          for (float beta : {0.0f, 1.0f, -0.5f}) {
            const test::OmpThreads threads(team);
            SCOPED_TRACE(testing::Message()
                         << s.M << " x " << s.N << " x " << s.K << (ta ? " A^T" : "")
                         << (tb ? " B^T" : "") << " beta " << beta << ", " << team << " thread(s)");
            if (s.M * s.N * s.K >= int64_t(1) << 20) {  // large enough to be shared
              EXPECT_TRUE(panel_gemm_shares(s.M, s.N, s.K));
            }
            const Product p(ta, tb, s);
            std::vector<float> c = p.c;
            if (beta == 0.0f)  // BLAS ignores C when beta = 0, NaN included
              for (int64_t r = 0; r < s.M; r++) c[r * p.ldc] = NAN;
            const float alpha = 0.75f;
            EXPECT_EQ(p.wrong(alpha, beta, c, p.run(alpha, beta, c)), 0);
          }
}

// The bias is added once to every row of C, unscaled by alpha, as each tile is first stored: with
// beta 0, 1 and another (C scaled, then the bias added before the tiles add C), in one slice of k
// and in several (A read along its rows and down its columns), in several column blocks, on whole
// and partial panels, with the threads splitting rows or columns; and with alpha = 0 or K = 0,
// where the bias is what is added. matmul_forward's bias rides on this.
TEST(PanelGemm, AddsTheBiasToEveryRowOnce) {
  const int L = Simd<float>::lanes;
  const std::vector<Shape> shapes = {
      {kTileRows + 1, 3 * L + 5, 40},                  // one slice; a partial panel
      {29, 150, kPanelDepth + 40},                     // columns split; two slices (three with A^T)
      {151, 2 * L + 3, 2 * kPanelDepth + 1},           // rows split; three slices (five with A^T)
      {kTileRows + 1, 1600 + L / 2, 3 * kPanelDepth},  // several column blocks on each thread
      {5, 20, 0},                                      // an empty product: C = beta * C + bias
  };
  for (int team : {1, 3})
    for (const Shape& s : shapes)
      for (bool ta : {false, true})
        for (float alpha : {1.0f, 0.75f, 0.0f})
          for (float beta : {0.0f, 1.0f, 0.5f}) {
            if (s.N > 1000 && (alpha != 0.75f || beta == 0.5f)) continue;  // its blocks: enough
            const test::OmpThreads threads(team);
            SCOPED_TRACE(testing::Message()
                         << s.M << " x " << s.N << " x " << s.K << (ta ? " A^T" : "") << " alpha "
                         << alpha << " beta " << beta << ", " << team << " thread(s)");
            const Product p(ta, true, s);  // as matmul_forward calls it
            const std::vector<float> bias = random_vector<float>(size_t(s.N), 14);
            const std::vector<float> got = p.run(alpha, beta, p.c, bias.data());
            EXPECT_EQ(p.wrong(alpha, beta, p.c, got, bias.data()), 0);
          }
}

// C = beta * C without reading A or B, when K = 0 or alpha = 0 (NaN in A stays out); nothing at
// all when M or N is 0.
TEST(PanelGemm, EmptyProductsScaleC) {
  Product p(false, false, {5, 20, 3});
  p.a.assign(p.a.size(), NAN);
  for (int64_t K : {0, 3})
    for (float beta : {0.0f, 1.0f, 0.5f}) {
      SCOPED_TRACE(testing::Message() << "K " << K << " beta " << beta);
      std::vector<float> c = p.c;
      panel_gemm<float>(false, false, 5, 20, K, K ? 0.0f : 1.0f, p.a.data(), p.lda, p.b.data(),
                        p.ldb, beta, c.data(), p.ldc);
      for (int64_t r = 0; r < 5; r++)
        for (int64_t n = 0; n < p.ldc; n++) {
          const float old = p.c[r * p.ldc + n];
          EXPECT_EQ(c[r * p.ldc + n], n < 20 ? beta * old : old);
        }
    }
  for (Shape s : {Shape{0, 20, 3}, Shape{5, 0, 3}}) {
    std::vector<float> c = p.c;
    panel_gemm<float>(false, false, s.M, s.N, s.K, 1.0f, p.a.data(), p.lda, p.b.data(), p.ldb, 0.0f,
                      c.data(), p.ldc);
    EXPECT_EQ(c, p.c);
  }
}

// Each element sums k in one order whatever splits the rows or columns among threads: one, two
// and three threads give the same bits, for every transpose, both splits and beta 0 and 1, over
// several slices of k (two, or three with A^T).
TEST(PanelGemm, BitsDoNotDependOnTheThreadCount) {
  for (Shape s : {Shape{200, 70, kPanelDepth + 40}, Shape{70, 200, kPanelDepth + 40}})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (float beta : {0.0f, 1.0f}) {
          SCOPED_TRACE(testing::Message() << s.M << " x " << s.N << (ta ? " A^T" : "")
                                          << (tb ? " B^T" : "") << " beta " << beta);
          const Product p(ta, tb, s);
          std::vector<float> bits[3];
          for (int team : {1, 2, 3}) {
            const test::OmpThreads threads(team);
            bits[team - 1] = p.run(1.0f, beta, p.c);
          }
          EXPECT_EQ(bits[0], bits[1]);
          EXPECT_EQ(bits[0], bits[2]);
        }
}

// No piece of a shared product belongs to a thread: one thread alone, among the two or four it
// was cut for, computes all of it (as when the others are slowed down, or have no scratch), with
// the bits of panel_gemm on one thread; and two threads taking pieces at once give those bits
// too (each element's slices in order: where the rows are one piece, the second thread's first
// step waits for the first's). Rows shared (A along its rows and down its columns, two
// and three slices of k, column blocks) and columns (pieces narrower than a block, and as wide),
// with B or B^T, C added or a bias.
TEST(PanelGemm, AnyThreadTakesAnyPiece) {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  auto scratch = [] {
    std::unique_ptr<float, Free> panels(static_cast<float*>(std::aligned_alloc(64, kPanelBytes)));
    if (!panels) throw std::bad_alloc();
    return panels;
  };
  const std::vector<Shape> shapes = {
      {151, 29, 2 * kPanelDepth + 100},         // rows
      {200, 1200, kPanelDepth + 40},            // columns: several pieces and blocks
      {kTileRows + 1, 1600, 3 * kPanelDepth},   // columns: the narrowest pieces
      {1000, 700, kTransposedPanelDepth + 40},  // rows: column blocks and slices
      {kTileRows, kTileRows, 4 * kPanelDepth},  // rows: one piece, which waits its turn
  };
  // A^T, B^T or neither; C added, or a bias in its place (beta 0).
  for (const Shape& s : shapes)
    for (int variant = 0; variant < 4; variant++) {
      const bool ta = variant == 1, tb = variant == 2, with_bias = variant == 3;
      SCOPED_TRACE(testing::Message() << s.M << " x " << s.N << " x " << s.K << (ta ? " A^T" : "")
                                      << (tb ? " B^T" : "") << (with_bias ? " bias" : ""));
      const Product p(ta, tb, s);
      const std::vector<float> bias = random_vector<float>(size_t(s.N), 15);
      const float* b = with_bias ? bias.data() : nullptr;
      std::vector<float> serial;
      {
        const test::OmpThreads threads(1);
        serial = p.run(0.75f, with_bias ? 0.0f : 1.0f, p.c, b);
      }
      for (int cut_for : {2, 4}) {
        std::vector<float> alone = p.c;
        detail::SharedProduct<float> product(p.shared(0.75f, alone, b), cut_for);
        product.take_pieces(scratch().get(), cut_for - 1);  // the last range first
        EXPECT_EQ(alone, serial) << "one thread of " << cut_for;
      }
      for (int run = 0; run < 5; run++) {
        std::vector<float> together = p.c;
        detail::SharedProduct<float> product(p.shared(0.75f, together, b), 2);
        std::latch start(2);  // both threads ready before either takes a piece
        auto take = [&](int thread) {
          const auto panels = scratch();
          start.arrive_and_wait();
          product.take_pieces(panels.get(), thread);
        };
        std::thread other(take, 1);
        take(0);
        other.join();
        EXPECT_EQ(together, serial) << "two threads at once";
      }
    }
}

}  // namespace
}  // namespace trainer::cpu
