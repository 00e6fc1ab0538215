#pragma once

namespace trainer {

// OpenBLAS 0.3.21 (Debian 12) picks its kernels from the CPU model when it is loaded, and it
// does not know current x86 CPUs: on some it falls back to Prescott (measured: 34 vs 223 GFLOP/s
// sgemm on 2 threads against its AVX-512 kernels), on AMD Zen 4/5 to the AVX2 Haswell kernels
// (measured on a Zen 5: 201 vs 375 GFLOP/s, W-S 897 vs 1545 tokens/s). The only fix is the
// OPENBLAS_CORETYPE variable before start-up: when it is unset and the CPU has wider vectors
// than the chosen kernels use (AVX-512, or AVX2 + FMA under Prescott), this sets it and
// re-executes the program with the same arguments. A user's own OPENBLAS_CORETYPE is kept.
void ensure_fast_blas(char** argv);

// The kernel set OpenBLAS is using ("SkylakeX", "Haswell", ...).
const char* blas_core_name();

}  // namespace trainer
