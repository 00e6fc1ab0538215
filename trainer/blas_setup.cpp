#include "trainer/blas_setup.h"

#include <cblas.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace trainer {

const char* blas_core_name() {
  return openblas_get_corename();
}

namespace {

bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512cd");
}

bool has_avx2_fma() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// OpenBLAS 0.3.21's kernel sets that use the widest vectors the CPU has, or null when the one
// it chose already does.
const char* better_core(const char* chosen) {
  const bool avx512_core = std::strcmp(chosen, "SkylakeX") == 0 ||
                           std::strcmp(chosen, "Cooperlake") == 0 ||
                           std::strcmp(chosen, "SapphireRapids") == 0;
  if (has_avx512() && !avx512_core) return "SkylakeX";
  if (std::strcmp(chosen, "Prescott") == 0 && has_avx2_fma()) return "Haswell";
  return nullptr;
}

}  // namespace

void ensure_fast_blas(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE")) return;
  const char* better = better_core(openblas_get_corename());
  if (!better) return;
  setenv("OPENBLAS_CORETYPE", better, 1);
  execv("/proc/self/exe", argv);  // returns only on failure: then run on, just slower
}

}  // namespace trainer
