#pragma once
// Host memory for large buffers: the CPU backend's tensors, and the host copies a checkpoint or
// the offloaded optimizer keeps. From 2 MB on, each is a mapping of its own, aligned to 2 MB,
// with transparent huge pages asked for (madvise: the kernel's default here): the first touch of
// a 4 KB page is a page fault (on a virtual machine a trap to the hypervisor, 0.3 GB/s on the
// machine this was measured on), of a 2 MB page one fault for 512 of them; and a freed buffer
// goes back to the system at once, leaving no allocator slack behind.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace trainer {

// `bytes` of zeroed memory, resident, 64-byte aligned (2 MB aligned from 2 MB on); throws
// std::bad_alloc.
void* allocate_host_memory(size_t bytes);
// Frees what allocate_host_memory returned (nullptr: nothing).
void free_host_memory(void* p) noexcept;

// A std allocator over them: host vectors whose values are all written before they are read
// (its memory comes zeroed: resize writes it once more).
template <class T>
struct HostAllocator {
  using value_type = T;
  HostAllocator() = default;
  template <class U>
  HostAllocator(const HostAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(allocate_host_memory(n * sizeof(T))); }
  void deallocate(T* p, size_t) noexcept { free_host_memory(p); }
  template <class U>
  bool operator==(const HostAllocator<U>&) const {
    return true;
  }
};
template <class T>
using HostVector = std::vector<T, HostAllocator<T>>;

// Makes the process's malloc keep what is freed for its next allocations (glibc: no trimming of
// the heap, no mapping of its own below 1 GB), for the buffers others allocate and free in the
// hot loop: Open MPI's collectives take their temporaries (a ring's segments, a reduction's
// scratch) from malloc on every call, and glibc handed a large one back to the system when it
// was freed, so every call faulted its pages in afresh. Measured on this machine (2 cores, a
// VM): a 64 MB all-reduce among 4 ranks 0.27 -> 1.5 GB/s, among 2 ranks 0.40 -> 3.6 GB/s. The
// price: memory freed stays the process's until release_freed_memory. Call first in main,
// before MPI starts. Returns false where the allocator refused (or is not glibc's).
bool keep_freed_memory();
// Hands what is free in the heap back to the system, once, at a point where setting-up is done
// and what it freed would otherwise count as held (before the memory check and the model).
void release_freed_memory();
// Page faults (minor and major) this process has taken so far.
int64_t page_faults();

}  // namespace trainer
