#pragma once
// Which rows of an embedding table a batch touches and where, so that a GPU can sum each row's
// gradient in one block, in sequence order, without atomics (deterministic, and the same order
// as the CPU backend). Built on the host, where the token ids are, by a counting sort.
#include <cstdint>
#include <vector>

#include "kernels/kernels.h"

namespace trainer {

class TokenIndex {
 public:
  // data() = [the U distinct ids of the slice, ascending | U + 1 offsets into the positions |
  // the positions of each id in `tokens`, ascending]; ids outside the slice are left out.
  void build(const int32_t* tokens, int64_t n, VocabSlice v);
  int distinct() const { return distinct_; }
  const std::vector<int32_t>& data() const { return data_; }

 private:
  std::vector<int32_t> data_, cursor_;
  int distinct_ = 0;
};

}  // namespace trainer
