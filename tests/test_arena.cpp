// The device memory arena's bookkeeping (kernels/arena.h), checked against a brute-force model
// of which bytes are taken.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "kernels/arena.h"

namespace trainer {
namespace {

TEST(Arena, FirstFitAlignsAndReusesFreedRanges) {
  Arena a(4096, 256);
  EXPECT_EQ(a.allocate(1), 0);
  EXPECT_EQ(a.allocate(300), 256);  // rounded up to 512 bytes
  EXPECT_EQ(a.allocate(256), 768);
  EXPECT_EQ(a.in_use(), 1024);
  a.release(256);
  EXPECT_EQ(a.allocate(200), 256);  // the first hole that fits
  EXPECT_EQ(a.allocate(300), 1024);
  EXPECT_EQ(a.peak(), 1280);
  EXPECT_FALSE(a.allocate(4096).has_value());
  EXPECT_THROW(a.release(128), std::logic_error);
}

TEST(Arena, FreedNeighboursMergeBackIntoOneRange) {
  Arena a(1 << 20, 256);
  std::vector<int64_t> offsets;
  for (int i = 0; i < 16; i++) offsets.push_back(*a.allocate(1000));
  for (int i : {3, 1, 2, 0, 15, 8, 10, 9, 4, 5, 7, 6, 12, 11, 14, 13}) a.release(offsets[i]);
  EXPECT_EQ(a.in_use(), 0);
  EXPECT_EQ(a.largest_free(), 1 << 20);
  EXPECT_EQ(a.allocate(1 << 20), 0);
}

TEST(Arena, RandomAllocationsNeverOverlapAndFreeEverything) {
  const int64_t capacity = 1 << 16;
  Arena a(capacity, 64);
  std::vector<int> owner(capacity, -1);
  std::vector<std::pair<int64_t, int64_t>> live;  // offset, rounded size
  std::mt19937 rng(7);
  for (int step = 0; step < 5000; step++) {
    if (live.empty() || rng() % 3) {
      const int64_t bytes = 1 + rng() % 3000;
      const auto at = a.allocate(bytes);
      if (!at) continue;
      const int64_t size = (bytes + 63) / 64 * 64;
      ASSERT_LE(*at + size, capacity);
      ASSERT_EQ(*at % 64, 0);
      for (int64_t i = *at; i < *at + size; i++) {
        ASSERT_EQ(owner[i], -1) << "byte " << i << " handed out twice";
        owner[i] = step;
      }
      live.push_back({*at, size});
    } else {
      const size_t k = rng() % live.size();
      a.release(live[k].first);
      for (int64_t i = live[k].first; i < live[k].first + live[k].second; i++) owner[i] = -1;
      live.erase(live.begin() + k);
    }
    int64_t used = 0;
    for (auto [o, s] : live) used += s;
    ASSERT_EQ(a.in_use(), used);
  }
  for (auto [o, s] : live) a.release(o);
  EXPECT_EQ(a.largest_free(), capacity);
}

}  // namespace
}  // namespace trainer
