// Softmax + cross-entropy over one slice of the (padded) vocabulary, in three phases so that
// vocab-parallel ranks combine only per-row statistics. The exponentials overwrite the logits in
// place, become probabilities, and in backward the logit gradients: the (N, width) tensor exists
// once.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/fast_math.h"

namespace trainer::cpu {

template <class T>
void crossentropy_max(T* rowmax, const T* logits, int64_t N, VocabSlice v) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    const T* row = logits + n * v.width;
    rowmax[n] = std::max(row_max(row, v.valid), std::numeric_limits<T>::lowest());
  }
}

template <class T>
void crossentropy_sumexp(T* sumexp, T* target_logit, T* logits, const T* rowmax,
                         const int32_t* targets, int64_t N, VocabSlice v) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    T* row = logits + n * v.width;
    const T mx = rowmax[n];
    target_logit[n] = v.holds(targets[n]) ? row[targets[n] - v.start] : T(0);
    sumexp[n] = exp_shifted(row, v.valid, mx);
    std::fill(row + v.valid, row + v.width, T(0));
  }
}

template <class T>
double crossentropy_finish(T* losses, T* probs, const T* rowmax, const T* sumexp,
                           const T* target_logit, int64_t N, VocabSlice v) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    T* row = probs + n * v.width;
    scale_row(row, v.valid, T(1) / sumexp[n]);
    losses[n] = std::log(sumexp[n]) + rowmax[n] - target_logit[n];
  }
  double total = 0;
  for (int64_t n = 0; n < N; n++) total += double(losses[n]);
  return total / double(N);
}

template <class T>
void crossentropy_backward(T* probs, const int32_t* targets, float dloss, int64_t N, VocabSlice v) {
  const T d = T(dloss);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    T* row = probs + n * v.width;
#pragma omp simd
    for (int i = 0; i < v.valid; i++) row[i] *= d;
    if (v.holds(targets[n])) row[targets[n] - v.start] -= d;
  }
}

#define INSTANTIATE(T)                                                                             \
  template void crossentropy_max<T>(T*, const T*, int64_t, VocabSlice);                            \
  template void crossentropy_sumexp<T>(T*, T*, T*, const T*, const int32_t*, int64_t, VocabSlice); \
  template double crossentropy_finish<T>(T*, T*, const T*, const T*, const T*, int64_t,            \
                                         VocabSlice);                                              \
  template void crossentropy_backward<T>(T*, const int32_t*, float, int64_t, VocabSlice);
INSTANTIATE(float)
INSTANTIATE(double)

}  // namespace trainer::cpu
