#include "trainer/peak_flops.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <vector>

namespace trainer {

double measure_sgemm_flops(int n, int repeats) {
  std::vector<float> a(size_t(n) * n, 0.5f), b(size_t(n) * n, 0.25f), c(size_t(n) * n);
  double best = 1e30;
  for (int r = 0; r <= repeats; r++) {  // the first run warms up caches and threads
    auto t0 = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n,
                0.0f, c.data(), n);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best = std::min(best, s);
  }
  return 2.0 * double(n) * n * n / best;
}

}  // namespace trainer
