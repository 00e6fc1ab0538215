#include "trainer/blas_setup.h"

#include <cblas.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace trainer {

const char* blas_core_name() {
  return openblas_get_corename();
}

void ensure_fast_blas(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE")) return;
  if (std::strcmp(openblas_get_corename(), "Prescott") != 0) return;
  const char* better = nullptr;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    better = "SkylakeX";
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    better = "Haswell";
  if (!better) return;
  setenv("OPENBLAS_CORETYPE", better, 1);
  execv("/proc/self/exe", argv);  // returns only on failure: then run on, just slower
}

}  // namespace trainer
