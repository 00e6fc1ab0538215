// The panel GEMM (kernels/cpu/panel_gemm.h) against a naive double product: all four
// transposes; shapes with partial 6-row tiles and partial vector panels, inner dimensions of one
// slice and of several, more columns than one packed block; beta 0 (C's old values, NaN here,
// ignored), 1 and another; leading dimensions longer than the rows. And its bits do not depend on
// the number of threads. Built for every vector width (tests/CMakeLists.txt).
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
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
  float A(int64_t r, int64_t k) const { return ta ? a[k * lda + r] : a[r * lda + k]; }
  float B(int64_t k, int64_t n) const { return tb ? b[n * ldb + k] : b[k * ldb + n]; }
  std::vector<float> run(float alpha, float beta, std::vector<float> out) const {
    panel_gemm<float>(ta, tb, s.M, s.N, s.K, alpha, a.data(), lda, b.data(), ldb, beta, out.data(),
                      ldc);
    return out;
  }
};

TEST(PanelGemm, MatchesTheNaiveProduct) {
  const int L = Simd<float>::lanes;
  // Slices kPanelDepth deep leave room for fewer than 800 columns in a block.
  static_assert(kPanelBytes / sizeof(float) / kPanelDepth < 800);
  const std::vector<Shape> shapes = {
      {1, 1, 1},                            // one element
      {kTileRows + 1, 2 * L + 3, 7},        // partial tiles and panel
      {4 * kTileRows + 5, 9 * L + 1, 300},  // M < N; two slices of k
      {9 * L + 1, 4 * kTileRows + 5, 700},  // M > N; three slices
      // The deepest slices, whose column blocks are narrower than this (on one thread).
      {2 * kTileRows, 800 + L / 2, 3 * kPanelDepth},
      {3, 1300, 40},              // a short, wide product
      {2 * kTileRows, 4 * L, 1},  // whole tiles, one k
  };
  // On one thread, and on two that split the rows or the columns.
  const int threads = omp_get_max_threads();
  for (int team : {1, 2})
    for (const Shape& s : shapes)
      for (bool ta : {false, true})
        for (bool tb : {false, true})
          for (float beta : {0.0f, 1.0f, -0.5f}) {
            omp_set_num_threads(team);
            SCOPED_TRACE(testing::Message()
                         << s.M << " x " << s.N << " x " << s.K << (ta ? " A^T" : "")
                         << (tb ? " B^T" : "") << " beta " << beta << ", " << team << " thread(s)");
            const Product p(ta, tb, s);
            std::vector<float> c = p.c;
            if (beta == 0.0f)  // BLAS ignores C when beta = 0, NaN included
              for (int64_t r = 0; r < s.M; r++) c[r * p.ldc] = NAN;
            const float alpha = 0.75f;
            const std::vector<float> got = p.run(alpha, beta, c);
            // Float sums of K products in some order: each element within 1e-6 of the sum of the
            // terms' magnitudes (rounding adds ~sqrt(K) * 2^-24 of it; a term lost or counted
            // twice is ~1/K of it).
            int wrong = 0;
            for (int64_t r = 0; r < s.M; r++)
              for (int64_t n = 0; n < p.ldc; n++) {
                const float old = c[r * p.ldc + n], out = got[r * p.ldc + n];
                if (n >= s.N) {  // past the row: untouched
                  wrong += !(out == old);
                  continue;
                }
                double sum = 0, magnitude = 0;
                for (int64_t k = 0; k < s.K; k++) {
                  const double term = double(p.A(r, k)) * double(p.B(k, n));
                  sum += term, magnitude += std::abs(term);
                }
                const double want = alpha * sum + (beta == 0.0f ? 0.0 : beta * double(old));
                const double bound =
                    1e-6 * (alpha * magnitude + (beta == 0.0f ? 0.0 : std::abs(beta * old)));
                if (!(std::abs(out - want) <= bound) && wrong++ == 0)
                  ADD_FAILURE() << "C(" << r << ", " << n << ") = " << out << ", want " << want;
              }
            EXPECT_EQ(wrong, 0);
          }
  omp_set_num_threads(threads);
}

TEST(PanelGemm, EmptyInnerDimensionScalesC) {
  const Product p(false, false, {5, 20, 0});
  std::vector<float> zero = p.run(1.0f, 0.0f, p.c), half = p.run(1.0f, 0.5f, p.c);
  for (int64_t r = 0; r < 5; r++)
    for (int64_t n = 0; n < p.ldc; n++) {
      const float old = p.c[r * p.ldc + n];
      EXPECT_EQ(zero[r * p.ldc + n], n < 20 ? 0.0f : old);
      EXPECT_EQ(half[r * p.ldc + n], n < 20 ? 0.5f * old : old);
    }
}

// Each element sums k in one order whatever splits the rows or columns among threads: one
// thread and two give the same bits, for products split both ways.
TEST(PanelGemm, BitsDoNotDependOnTheThreadCount) {
  for (Shape s : {Shape{200, 70, 600}, Shape{70, 200, 600}}) {
    const Product p(true, false, s);
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    const std::vector<float> one = p.run(1.0f, 1.0f, p.c);
    omp_set_num_threads(2);
    const std::vector<float> two = p.run(1.0f, 1.0f, p.c);
    omp_set_num_threads(threads);
    EXPECT_EQ(one, two);
  }
}

}  // namespace
}  // namespace trainer::cpu
