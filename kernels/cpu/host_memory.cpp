#include "kernels/cpu/host_memory.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace trainer {
namespace {

constexpr size_t kHugePage = size_t(2) << 20, kPage = 4096;
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
  if (bytes > (size_t(1) << 62)) throw std::bad_alloc();  // a negative count, converted
  bytes = std::max<size_t>(64, (bytes + 63) / 64 * 64);
  if (bytes < kHugePage) {
    void* base = std::aligned_alloc(64, kHeader + bytes);
    if (!base) throw std::bad_alloc();
    void* p = static_cast<std::byte*>(base) + kHeader;
    *header_of(p) = {base, 0};
    return std::memset(p, 0, bytes);
  }
  // Mapped with room to align, then trimmed to the header's page below the aligned start and the
  // buffer's pages: the header's page and the tail's partial 2 MB are then small pages (their
  // 2 MB ranges are not all mapped), the rest huge pages where the kernel has them.
  const size_t pages = (bytes + kPage - 1) / kPage * kPage, room = kHugePage + pages;
  auto* mapped = static_cast<std::byte*>(
      mmap(nullptr, room, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (mapped == MAP_FAILED) throw std::bad_alloc();
  const uintptr_t at = reinterpret_cast<uintptr_t>(mapped) + kPage;
  auto* p = reinterpret_cast<std::byte*>((at + kHugePage - 1) / kHugePage * kHugePage);
  std::byte *base = p - kPage, *end = p + pages;
  if (base > mapped) munmap(mapped, size_t(base - mapped));
  if (end < mapped + room) munmap(end, size_t(mapped + room - end));
  madvise(p, bytes, MADV_HUGEPAGE);  // advice: where it is not taken, small pages
  *header_of(p) = {base, size_t(end - base)};
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

bool keep_freed_memory() {
#if defined(__GLIBC__)
  // Setting either also ends glibc's sliding threshold, which would otherwise rise to the
  // largest block freed so far (at most 32 MB) and trim the heap at twice that. Older glibc
  // refuses a threshold above 32 MB: then blocks up to 32 MB are kept.
  const bool heap =
      mallopt(M_MMAP_THRESHOLD, 1 << 30) == 1 || mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1;
  const bool untrimmed = mallopt(M_TRIM_THRESHOLD, -1) == 1;  // -1: never (mallopt(3))
  return heap && untrimmed;
#else
  return false;
#endif
}

void release_freed_memory() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

int64_t page_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return int64_t(u.ru_minflt) + int64_t(u.ru_majflt);
}

}  // namespace trainer
