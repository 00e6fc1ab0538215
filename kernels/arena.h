#pragma once
// Offsets into one block of memory reserved at start-up: the CUDA backend makes a single
// cudaMalloc and hands out pieces of it, so that no step allocates device memory (cudaMalloc
// synchronises the device) and the job's peak memory is known exactly. Host-only bookkeeping,
// tested on the CPU.
#include <cstdint>
#include <map>
#include <optional>

namespace trainer {

class Arena {
 public:
  explicit Arena(int64_t capacity, int64_t alignment = 256);

  // First fit: the lowest free offset with room for `bytes` (rounded up to the alignment), or
  // nothing when no free range is large enough.
  std::optional<int64_t> allocate(int64_t bytes);
  // Returns a range allocate() gave out; neighbouring free ranges merge.
  void release(int64_t offset);

  int64_t capacity() const { return capacity_; }
  int64_t in_use() const { return in_use_; }
  int64_t peak() const { return peak_; }
  int64_t largest_free() const;

 private:
  int64_t capacity_, alignment_;
  std::map<int64_t, int64_t> free_;  // offset -> size, disjoint and never adjacent
  std::map<int64_t, int64_t> used_;  // offset -> size
  int64_t in_use_ = 0, peak_ = 0;
};

}  // namespace trainer
