#include "kernels/cpu/host_memory.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

namespace trainer {
namespace {

constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kHeader = 64;  // before the pointer: where the block starts, and how long it is

struct Header {
  void* base;
  size_t mapped;  // 0: from the heap
};

Header* header_of(void* p) {
  return reinterpret_cast<Header*>(static_cast<std::byte*>(p) - kHeader);
}

}  // namespace

void* allocate_host_memory(size_t bytes) {
  bytes = (bytes + 63) / 64 * 64;
  if (bytes < kHugePage) {
    void* base = std::aligned_alloc(64, kHeader + bytes);
    if (!base) throw std::bad_alloc();
    void* p = static_cast<std::byte*>(base) + kHeader;
    *header_of(p) = {base, 0};
    return std::memset(p, 0, bytes);
  }
  // The header sits in the page below the aligned start: that page is a small one, the rest huge
  // pages where the mapping covers them (the tail's partial one is small pages too).
  const size_t mapped = kHugePage + bytes;
  void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) throw std::bad_alloc();
  const auto start =
      (reinterpret_cast<uintptr_t>(base) + kHeader + kHugePage - 1) / kHugePage * kHugePage;
  void* p = reinterpret_cast<void*>(start);
  madvise(p, bytes, MADV_HUGEPAGE);  // advice: where it is not taken, small pages
  *header_of(p) = {base, mapped};
  // Touched now, as the heap's were: what is allocated is resident (the memory plan counts the
  // buffers, used or not, as a GPU holds them), and its faults are not in the first step's time.
  return std::memset(p, 0, bytes);
}

void free_host_memory(void* p) noexcept {
  if (!p) return;
  const Header h = *header_of(p);
  if (h.mapped)
    munmap(h.base, h.mapped);
  else
    std::free(h.base);
}

}  // namespace trainer
