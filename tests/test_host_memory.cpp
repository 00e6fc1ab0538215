// Host memory (kernels/cpu/host_memory.h): zeroed and aligned; from 2 MB on, a mapping of its own
// that the kernel may back with transparent huge pages (which fails when the advice is
// disconnected), given back to the system when freed.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "kernels/cpu/host_memory.h"
#include "kernels/kernels.h"

namespace trainer {
namespace {

// The lines of /proc/self/smaps for the mapping holding `p` ("" when none does).
std::string mapping_of(const void* p) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  std::ifstream in("/proc/self/smaps");
  std::string line, found;
  bool inside = false;
  while (std::getline(in, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find(' '))
      inside = lo <= at && at < hi;
    if (inside) found += line + "\n";
  }
  return found;
}

std::string thp_mode() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string modes;
  std::getline(in, modes);
  return modes;
}

TEST(HostMemory, ZeroedAlignedAndLargeOnesMayBeHugePages) {
  for (size_t bytes : {size_t(1), size_t(100), size_t(1) << 20, (size_t(8) << 20) + 12345}) {
    SCOPED_TRACE(bytes);
    auto* p = static_cast<unsigned char*>(allocate_host_memory(bytes));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
    bool zero = true;
    for (size_t i = 0; i < bytes; i++) zero &= p[i] == 0;
    EXPECT_TRUE(zero);
    p[bytes - 1] = 1;  // all of it writable
    free_host_memory(p);
  }
  void* large = allocate_host_memory(size_t(8) << 20);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(large) % (2 << 20), 0u);
  const std::string smaps = mapping_of(large), mode = thp_mode();
  ASSERT_FALSE(smaps.empty());
  // The mapping is the buffer's pages alone (the header's page and the room to align are not
  // advised, or gone); advised (VmFlags "hg") and, where the kernel allows them, eligible for
  // huge pages.
  const size_t size = smaps.find("\nSize:");
  ASSERT_NE(size, std::string::npos) << smaps;
  EXPECT_EQ(std::stoi(smaps.substr(size + 6)), 8192) << smaps;  // kB
  if (!mode.empty()) {  // "": a kernel without transparent huge pages
    const size_t flags = smaps.find("VmFlags:");
    ASSERT_NE(flags, std::string::npos) << smaps;
    EXPECT_NE(smaps.find(" hg", flags), std::string::npos) << smaps;
  }
  if (!mode.empty() && mode.find("[never]") == std::string::npos) {
    const size_t eligible = smaps.find("THPeligible:");
    ASSERT_NE(eligible, std::string::npos) << smaps;
    EXPECT_EQ(std::stoi(smaps.substr(eligible + 12)), 1) << smaps;
  }
  free_host_memory(large);
  EXPECT_EQ(mapping_of(large), "");  // unmapped: back to the system
  free_host_memory(nullptr);
}

// The CPU backend's tensors and host buffers come from it.
TEST(HostMemory, TheCpuBackendAllocatesThere) {
  auto k = make_cpu_kernels();
  const DPtr t = k->alloc(int64_t(4) << 20, DType::f32);  // 16 MB
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.p) % (2 << 20), 0u);
  void* h = k->alloc_host(int64_t(16) << 20);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(h) % (2 << 20), 0u);
  k->free_host(h);
  k->free(t);
  EXPECT_EQ(mapping_of(t.p), "");
}

}  // namespace
}  // namespace trainer
