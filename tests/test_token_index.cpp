// The GPU embedding backward's index (kernels/token_index.h) against brute force, and the sum it
// drives (one row at a time, positions in order) bit for bit against the CPU backend's
// encoder_backward, whose order it promises to keep.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "kernels/token_index.h"
#include "test_util.h"

namespace trainer {
namespace {

TEST(TokenIndex, ListsEachTokenOfTheSliceWithItsPositionsInOrder) {
  std::mt19937 rng(3);
  for (VocabSlice v : {VocabSlice{0, 50, 64}, VocabSlice{20, 13, 16}, VocabSlice{60, 0, 4}}) {
    std::vector<int32_t> tokens(300);
    for (auto& t : tokens) t = int32_t(rng() % 64);
    TokenIndex index;
    index.build(tokens.data(), int64_t(tokens.size()), v);
    const std::vector<int32_t>& d = index.data();
    const int U = index.distinct();
    std::vector<int32_t> want_ids;
    for (int t = v.start; t < v.start + v.valid; t++)
      if (std::count(tokens.begin(), tokens.end(), t)) want_ids.push_back(t);
    ASSERT_EQ(U, int(want_ids.size()));
    ASSERT_EQ(std::vector<int32_t>(d.begin(), d.begin() + U), want_ids);
    for (int u = 0; u < U; u++) {
      std::vector<int32_t> want;
      for (int i = 0; i < int(tokens.size()); i++)
        if (tokens[i] == want_ids[u]) want.push_back(i);
      const int32_t* positions = d.data() + 2 * U + 1;
      EXPECT_EQ(std::vector<int32_t>(positions + d[U + u], positions + d[U + u + 1]), want);
    }
    EXPECT_EQ(int(d.size()), 2 * U + 1 + d[2 * U]);
  }
}

TEST(TokenIndex, RowSumsInIndexOrderAreTheCpuEncoderBackwardBitForBit) {
  test::Device d;
  const int B = 4, T = 16, C = 8;
  const VocabSlice v{5, 20, 24};
  std::vector<int32_t> tokens(B * T);
  for (int i = 0; i < B * T; i++) tokens[i] = (i * 7 + i / 5) % 30;
  const auto dout = test::random_vector(size_t(B) * T * C, 1);
  const auto dwte0 = test::random_vector(size_t(v.width) * C, 2);
  DPtr dwte = d.upload(dwte0);
  d.k->encoder_backward(dwte, DPtr{}, d.upload(dout), tokens.data(), B, T, C, v);

  TokenIndex index;
  index.build(tokens.data(), B * T, v);
  const std::vector<int32_t>& x = index.data();
  const int U = index.distinct();
  std::vector<float> got = dwte0;
  for (int u = 0; u < U; u++)  // what each GPU block does for its row
    for (int c = 0; c < C; c++) {
      float acc = got[size_t(x[u] - v.start) * C + c];
      for (int p = x[U + u]; p < x[U + u + 1]; p++) acc += dout[size_t(x[2 * U + 1 + p]) * C + c];
      got[size_t(x[u] - v.start) * C + c] = acc;
    }
  EXPECT_EQ(got, d.download<float>(dwte, size_t(v.width) * C));
}

}  // namespace
}  // namespace trainer
