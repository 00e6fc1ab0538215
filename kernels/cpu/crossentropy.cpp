// Fused softmax + cross-entropy over the padded vocabulary: the probabilities overwrite the
// logits in place and become the logit gradients in backward, so the (N, Vp) tensor exists once.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/fast_math.h"

namespace trainer::cpu {

template <class T>
double softmax_crossentropy_forward(T* losses, T* logits, const int32_t* targets, int64_t N, int V,
                                    int Vp) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    T* row = logits + n * Vp;
    T mx = row[0];
#pragma omp simd reduction(max : mx)
    for (int v = 1; v < V; v++) mx = std::max(mx, row[v]);
    const T target_logit = row[targets[n]];
    T sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int v = 0; v < V; v++) {
      row[v] = fast_exp(row[v] - mx);
      sum += row[v];
    }
    const T inv = T(1) / sum;
#pragma omp simd
    for (int v = 0; v < V; v++) row[v] *= inv;
    std::fill(row + V, row + Vp, T(0));
    losses[n] = std::log(sum) + mx - target_logit;
  }
  double total = 0;
  for (int64_t n = 0; n < N; n++) total += double(losses[n]);
  return total / double(N);
}

template <class T>
void softmax_crossentropy_backward(T* probs, const int32_t* targets, float dloss, int64_t N, int V,
                                   int Vp) {
  const T d = T(dloss);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    T* row = probs + n * Vp;
#pragma omp simd
    for (int v = 0; v < V; v++) row[v] *= d;
    row[targets[n]] -= d;
  }
}

template double softmax_crossentropy_forward<float>(float*, float*, const int32_t*, int64_t, int,
                                                    int);
template double softmax_crossentropy_forward<double>(double*, double*, const int32_t*, int64_t, int,
                                                     int);
template void softmax_crossentropy_backward<float>(float*, const int32_t*, float, int64_t, int,
                                                   int);
template void softmax_crossentropy_backward<double>(double*, const int32_t*, float, int64_t, int,
                                                    int);

}  // namespace trainer::cpu
