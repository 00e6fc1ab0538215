#pragma once

namespace trainer {

// OpenBLAS 0.3.21 (Debian 12) does not recognise some current x86 CPUs and falls back to its
// Prescott kernels, about 6x slower than its AVX-512 ones on the same machine (measured:
// 34 vs 223 GFLOP/s sgemm on 2 threads). OpenBLAS picks its kernels when it is loaded, so
// the only fix is the OPENBLAS_CORETYPE variable before start-up: when it is unset, the
// library reports Prescott and the CPU has AVX-512 (or AVX2 + FMA), this sets it and
// re-executes the program with the same arguments. A user's own OPENBLAS_CORETYPE is kept.
void ensure_fast_blas(char** argv);

// The kernel set OpenBLAS is using ("SkylakeX", "Haswell", ...).
const char* blas_core_name();

}  // namespace trainer
