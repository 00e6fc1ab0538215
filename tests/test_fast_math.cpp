// The softmaxes' row loops in vectors of floats (kernels/cpu/fast_math.h) against double
// references: every row length up to three vectors and a long one (the partial last vector is
// loaded and stored under a mask), rows that reach exp's lower clamp and -inf, and exp_lanes
// against the scalar fast_exp it stands for, bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/fast_math.h"
#include "tests/test_util.h"

namespace trainer::cpu {
namespace {

using test::random_vector;

// Row lengths: none, each partial vector, whole vectors, and a long row.
std::vector<int> lengths() {
  std::vector<int> n;
  for (int i = 0; i <= 3 * Simd<float>::lanes + 1; i++) n.push_back(i);
  n.push_back(1000);
  return n;
}

// A row of scores with a guard element past its end, which no row operation may touch.
std::vector<float> row_with_guard(int n, uint64_t seed) {
  std::vector<float> x = random_vector<float>(size_t(n), seed, 3.0);
  if (n > 2) x[1] = -200.0f;  // under the clamp: exp gives (about) 0
  if (n > 3) x[2] = -std::numeric_limits<float>::infinity();
  x.push_back(12345.0f);
  return x;
}

#ifdef TRAINER_EXPECT_VECTOR_BYTES
// The narrower builds (tests/CMakeLists.txt) run the vector width they were built for: without
// their -march they would silently test the native paths again.
TEST(FastMath, BuiltForItsVectorWidth) {
  EXPECT_EQ(kVectorBytes, TRAINER_EXPECT_VECTOR_BYTES);
}
#endif

TEST(FastMath, ExpLanesGivesFastExpValues) {
  using S = Simd<float>;
  // Every multiple of 2^-10 in [-90, 90] (halfway points of x / ln2 included), and the clamps.
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> xs = {-inf, -1e30f, -200.0f, 100.0f, 1e30f, inf};
  for (int i = -90 * 1024; i <= 90 * 1024; i++) xs.push_back(float(i) / 1024);
  while (xs.size() % S::lanes) xs.push_back(0.0f);
  for (size_t i = 0; i < xs.size(); i += S::lanes) {
    const S::Vec got = exp_lanes(S::load(&xs[i]));
    for (int l = 0; l < S::lanes; l++) ASSERT_EQ(got[l], fast_exp(xs[i + l])) << "x " << xs[i + l];
  }
}

TEST(FastMath, ExpShiftedAndItsSum) {
  for (int n : lengths()) {
    SCOPED_TRACE(testing::Message() << "n " << n);
    std::vector<float> x = row_with_guard(n, uint64_t(n) + 1);
    const std::vector<float> in = x;
    const float shift = 2.5f;
    const float sum_only = sum_exp_shifted(x.data(), n, shift);
    const float sum = exp_shifted(x.data(), n, shift);
    double want_sum = 0;
    for (int j = 0; j < n; j++) {
      // The argument is rounded to float first, in the kernel as here.
      const double want = std::exp(double(in[j] - shift));
      want_sum += want;
      // Cephes' polynomial: a few ulp; the clamp gives exp(-87) ~ 1.6e-38 for exp(-inf).
      EXPECT_NEAR(x[j], want, 4e-7 * want + 2e-38) << "j " << j;
    }
    EXPECT_NEAR(sum, want_sum, 1e-6 * want_sum);
    EXPECT_NEAR(sum_only, want_sum, 1e-6 * want_sum);
    EXPECT_EQ(x[size_t(n)], 12345.0f);
  }
}

TEST(FastMath, SoftmaxBackwardFromScores) {
  for (int n : lengths()) {
    SCOPED_TRACE(testing::Message() << "n " << n);
    std::vector<float> s = row_with_guard(n, uint64_t(n) + 100);
    std::vector<float> d = random_vector<float>(size_t(n), uint64_t(n) + 200);
    d.push_back(54321.0f);
    const std::vector<float> s_in = s, d_in = d;
    const float lse = 4.0f, dot = 0.3f;
    softmax_backward_from_scores(s.data(), d.data(), n, lse, dot);
    for (int j = 0; j < n; j++) {
      const double p = std::exp(double(s_in[j] - lse));
      EXPECT_NEAR(s[j], p, 4e-7 * p + 2e-38) << "j " << j;
      EXPECT_NEAR(d[j], p * (double(d_in[j]) - dot), 1e-6 * std::abs(p * (d_in[j] - dot)) + 1e-37)
          << "j " << j;
    }
    EXPECT_EQ(s[size_t(n)], 12345.0f);
    EXPECT_EQ(d[size_t(n)], 54321.0f);
  }
}

}  // namespace
}  // namespace trainer::cpu
