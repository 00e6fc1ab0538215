#pragma once

namespace trainer {

// Measures the FLOP/s of a large sgemm on the current thread count (best of a few runs):
// the MFU denominator on the CPU backend.
double measure_sgemm_flops(int n = 1536, int repeats = 3);

}  // namespace trainer
