// The fused attention's register tiles (kernels/cpu/tile_product.h) against a naive double
// product: every row count up to a tile's, panel counts that need one, two and three tile widths
// (with the narrower remainders), X read as a matrix and as a transpose, alpha and accumulation;
// the same bits from every tile shape; and the packing of column and transposed panels with their
// zero padding.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "kernels/cpu/tile_product.h"
#include "tests/test_util.h"

namespace trainer::cpu {
namespace {

using test::all_close;
using test::random_vector;

template <class T>
void check_products(int64_t kn) {
  const int L = Simd<T>::lanes;
  const int64_t ld = 53;  // X's rows longer than needed
  const std::vector<T> x = random_vector<T>(size_t(std::max<int64_t>(kn, kTileRows)) * ld, 1);
  for (int npanels = 1; npanels <= 2 * kTilePanels + 1; npanels++) {
    const int64_t stride = kn * L + 3;  // panels need not be adjacent
    const std::vector<T> panels = random_vector<T>(size_t(npanels) * stride, 2);
    for (int rows = 1; rows <= kTileRows; rows++)
      for (bool transposed : {false, true})
        for (bool add : {false, true}) {
          SCOPED_TRACE(testing::Message() << "k " << kn << " panels " << npanels << " rows " << rows
                                          << (transposed ? " X^T" : " X") << (add ? " +C" : ""));
          // X(r, k): row r, column k of x, or row k, column r of it.
          const int64_t rs = transposed ? 1 : ld, ks = transposed ? ld : 1;
          const int64_t ldc = int64_t(npanels) * L + 5;
          // One row more than the tile's: it must stay as it was.
          std::vector<T> c = random_vector<T>(size_t(rows + 1) * ldc, 3);
          std::vector<double> want(c.size());
          const T alpha = T(0.75);
          for (int r = 0; r <= rows; r++)
            for (int64_t col = 0; col < ldc; col++) {
              double& w = want[r * ldc + col];
              w = double(c[r * ldc + col]);
              if (r == rows || col >= int64_t(npanels) * L) continue;  // untouched
              double sum = 0;
              for (int64_t k = 0; k < kn; k++)
                sum += double(x[r * rs + k * ks]) *
                       double(panels[(col / L) * stride + k * L + col % L]);
              w = alpha * sum + (add ? w : 0.0);
            }
          product_rows<T>(rows, x.data(), rs, ks, kn, panels.data(), stride, npanels, c.data(), ldc,
                          alpha, add);
          EXPECT_TRUE(all_close(c, want, 1e-5, 1e-5));
        }
  }
}

// k = 37 is a multiple of nothing; k = 1 is a single step of the loop.
TEST(TileProduct, MatchesTheNaiveProductForEveryTileShape) {
  for (int64_t kn : {37, 1}) {
    check_products<float>(kn);
    check_products<double>(kn);
  }
}

// An element's bits do not depend on the tile that computes it: C's columns cut into tiles one
// panel wide, or two, give the bits of the widest tiles, for every row count, with C added or a
// bias. (GCC fused alpha * acc + C into one multiply-add in some tile shapes only: a 2-row tile
// one panel wide differed from a 2-row tile four wide, so the GEMM's bits depended on how the
// threads cut C.)
template <class T>
void check_same_bits(int64_t kn) {
  const int L = Simd<T>::lanes, npanels = kTilePanels;
  const std::vector<T> x = random_vector<T>(size_t(kTileRows) * kn, 5),
                       panels = random_vector<T>(size_t(npanels) * kn * L, 6),
                       c = random_vector<T>(size_t(kTileRows) * npanels * L, 7),
                       bias = random_vector<T>(size_t(npanels) * L, 8);
  const int64_t ldc = int64_t(npanels) * L;
  for (int rows = 1; rows <= kTileRows; rows++)
    for (int epilogue = 0; epilogue < 3; epilogue++) {  // store, add C, add the bias
      SCOPED_TRACE(testing::Message()
                   << "k " << kn << " rows " << rows << " epilogue " << epilogue);
      const bool add = epilogue == 1;
      const T* b = epilogue == 2 ? bias.data() : nullptr;
      std::vector<T> widest = c;
      product_rows<T>(rows, x.data(), kn, 1, kn, panels.data(), kn * L, npanels, widest.data(), ldc,
                      T(0.75), add, b);
      for (int width : {1, 2}) {
        std::vector<T> narrow = c;
        for (int n = 0; n < npanels; n += width)
          product_rows<T>(rows, x.data(), kn, 1, kn, panels.data() + n * kn * L, kn * L,
                          std::min(width, npanels - n), narrow.data() + n * L, ldc, T(0.75), add,
                          b ? b + n * L : nullptr);
        EXPECT_EQ(narrow, widest) << "tiles " << width << " panel(s) wide";
      }
    }
}

TEST(TileProduct, BitsDoNotDependOnTheTileShape) {
  for (int64_t kn : {404, 64}) {
    check_same_bits<float>(kn);
    check_same_bits<double>(kn);
  }
}

// The panels of a rows x cols matrix (leading dimension ld), and nothing past them: a guard of
// T(9)s after each buffer stays as it was (a packer that stored a whole vector for a partial one
// writes there, and in attention.cpp into the next head's panels).
template <class T>
void check_packing(int64_t rows, int cols, int64_t ld) {
  SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols) + ", ld " + std::to_string(ld));
  const int L = Simd<T>::lanes;
  const size_t guard = size_t(2) * L * L;
  const std::vector<T> a = random_vector<T>(size_t(rows) * ld, 4);
  const int col_panels = (cols + L - 1) / L, row_panels = int((rows + L - 1) / L);
  const size_t by_columns_size = size_t(col_panels) * rows * L,
               transposed_size = size_t(row_panels) * cols * L;
  std::vector<T> by_columns(by_columns_size + guard, T(9)),
      transposed(transposed_size + guard, T(9));
  pack_column_panels(by_columns.data(), a.data(), ld, rows, cols);
  pack_transposed_panels(transposed.data(), a.data(), ld, rows, cols);
  for (int n = 0; n < col_panels; n++)
    for (int64_t k = 0; k < rows; k++)
      for (int l = 0; l < L; l++) {
        const int col = n * L + l;
        EXPECT_EQ(by_columns[(n * rows + k) * L + l], col < cols ? a[k * ld + col] : T(0));
      }
  for (int n = 0; n < row_panels; n++)
    for (int k = 0; k < cols; k++)
      for (int l = 0; l < L; l++) {
        const int64_t row = int64_t(n) * L + l;
        EXPECT_EQ(transposed[(n * cols + k) * L + l], row < rows ? a[row * ld + k] : T(0));
      }
  for (size_t i = 0; i < guard; i++) {
    EXPECT_EQ(by_columns[by_columns_size + i], T(9)) << "past the column panels: " << i;
    EXPECT_EQ(transposed[transposed_size + i], T(9)) << "past the transposed panels: " << i;
  }
}

template <class T>
void check_packings() {
  const int L = Simd<T>::lanes;
  check_packing<T>(2 * L + 3, L + 5, 70);  // partial panels both ways
  check_packing<T>(2 * L, 2 * L, 2 * L);   // whole panels, rows back to back
  check_packing<T>(3, 1, 1);               // less than a panel both ways
  check_packing<T>(L + 1, 4 * L - 1, 4 * L);
}

TEST(TileProduct, PanelsHoldTheMatrixAndZerosPastIt) {
  check_packings<float>();
  check_packings<double>();
}

}  // namespace
}  // namespace trainer::cpu
