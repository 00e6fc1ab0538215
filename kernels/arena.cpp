#include "kernels/arena.h"

#include <algorithm>
#include <stdexcept>

namespace trainer {

Arena::Arena(int64_t capacity, int64_t alignment)
    : capacity_(alignment > 0 ? capacity / alignment * alignment : 0), alignment_(alignment) {
  if (alignment <= 0 || capacity < 0) throw std::invalid_argument("Arena: bad size");
  if (capacity_ > 0) free_[0] = capacity_;
}

std::optional<int64_t> Arena::allocate(int64_t bytes) {
  const int64_t size = std::max<int64_t>(1, (bytes + alignment_ - 1) / alignment_) * alignment_;
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < size) continue;
    const int64_t offset = it->first, rest = it->second - size;
    free_.erase(it);
    if (rest > 0) free_[offset + size] = rest;
    used_[offset] = size;
    in_use_ += size;
    peak_ = std::max(peak_, in_use_);
    return offset;
  }
  return std::nullopt;
}

void Arena::release(int64_t offset) {
  const auto used = used_.find(offset);
  if (used == used_.end()) throw std::logic_error("Arena::release: not an allocated offset");
  int64_t begin = offset, end = offset + used->second;
  in_use_ -= used->second;
  used_.erase(used);
  auto next = free_.lower_bound(begin);
  if (next != free_.end() && next->first == end) {
    end += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == begin) {
      begin = prev->first;
      free_.erase(prev);
    }
  }
  free_[begin] = end - begin;
}

int64_t Arena::largest_free() const {
  int64_t best = 0;
  for (const auto& [offset, size] : free_) best = std::max(best, size);
  return best;
}

}  // namespace trainer
