#include "kernels/token_index.h"

#include <algorithm>

namespace trainer {

void TokenIndex::build(const int32_t* tokens, int64_t n, VocabSlice v) {
  cursor_.assign(size_t(std::max(v.valid, 0)), 0);  // counts, then each id's next position slot
  for (int64_t i = 0; i < n; i++)
    if (v.holds(tokens[i])) cursor_[size_t(tokens[i] - v.start)]++;
  int U = 0;
  for (int32_t c : cursor_) U += c > 0;
  distinct_ = U;
  data_.assign(size_t(2 * U + 1), 0);
  int32_t* ids = data_.data();
  int32_t* offsets = ids + U;
  int32_t at = 0, u = 0;
  for (int t = 0; t < v.valid; t++) {
    const int32_t count = cursor_[size_t(t)];
    if (count == 0) continue;
    ids[u] = t + v.start;
    offsets[u++] = at;
    cursor_[size_t(t)] = at;
    at += count;
  }
  offsets[U] = at;
  data_.resize(size_t(2 * U + 1) + size_t(at));
  int32_t* positions = data_.data() + 2 * U + 1;
  for (int64_t i = 0; i < n; i++)
    if (v.holds(tokens[i])) positions[cursor_[size_t(tokens[i] - v.start)]++] = int32_t(i);
}

}  // namespace trainer
