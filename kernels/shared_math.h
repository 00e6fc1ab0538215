#pragma once
// Element-wise math shared by the CPU and CUDA backends, compiled for the host and (under nvcc)
// for the device, so that the CPU tests exercise the same formulas the GPU runs: rounding to
// bf16, the counter-based random bits of stochastic rounding and of dropout, GELU, SiLU, the
// rotation of RoPE, and one AdamW element. Everything works on raw bits or plain arithmetic.
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TRAINER_HD __host__ __device__ inline
#else
#define TRAINER_HD inline
#endif

namespace trainer {

// The bits of a float and back (std::bit_cast is C++20, and device code is C++17).
TRAINER_HD uint32_t float_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}
TRAINER_HD float bits_float(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

// 64 random bits as a pure function of (seed, index): SplitMix64 of their combination.
TRAINER_HD uint64_t random_bits(uint64_t seed, uint64_t index) {
  uint64_t z = seed * 0x9e3779b97f4a7c15ull + index + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// fp32 bits -> bf16 bits, round to nearest, ties to even; NaN stays a (quiet) NaN.
TRAINER_HD uint16_t bf16_bits_nearest(uint32_t u) {
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  const uint32_t lsb = (u >> 16) & 1;
  return uint16_t((u + 0x7fffu + lsb) >> 16);
}

// fp32 bits -> bf16 bits rounded up with probability equal to the dropped fraction (`random`
// supplies 16 uniform bits), so that the expected value is exact. inf and NaN as they are.
TRAINER_HD uint16_t bf16_bits_stochastic(uint32_t u, uint32_t random) {
  if ((u & 0x7f800000u) == 0x7f800000u) return bf16_bits_nearest(u);
  return uint16_t((u + (random & 0xffffu)) >> 16);
}

// Dropout's mask: whether element `index` survives, a pure function of (seed, index) so that
// every backend drops the same elements and backward re-derives forward's mask. The seed is
// offset so that a run using one seed for dropout and for stochastic rounding gets unrelated
// bits; the top 24 random bits form an integer u uniform in [0, 2^24), kept when u >= p 2^24:
// probability 1 - p to 2^-24. Both sides are exact floats (u < 2^24; the product only shifts
// p's exponent), so the CPU and the GPU compare the same numbers.
TRAINER_HD bool dropout_keeps(uint64_t seed, uint64_t index, float p) {
  const uint64_t bits = random_bits(seed ^ 0xd1b54a32d192ed03ull, index);
  return float(uint32_t(bits >> 40)) >= p * 16777216.0f;
}

// GELU, tanh approximation: gelu(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).
// The caller supplies tanh(u) (each backend has its own fast tanh).
template <class T>
TRAINER_HD T gelu_tanh_arg(T x) {
  return T(0.7978845608028654) * (x + T(0.044715) * x * x * x);
}
template <class T>
TRAINER_HD T gelu_from_tanh(T x, T th) {
  return T(0.5) * x * (T(1) + th);
}
// d gelu / dx given th = tanh(gelu_tanh_arg(x)).
template <class T>
TRAINER_HD T gelu_grad_from_tanh(T x, T th) {
  const T sech2 = T(1) - th * th;
  const T du = T(0.7978845608028654) * (T(1) + T(3 * 0.044715) * x * x);
  return T(0.5) * (T(1) + th) + T(0.5) * x * sech2 * du;
}

// SiLU, the gate of SwiGLU: silu(g) = g sigmoid(g). The caller supplies sig = sigmoid(g) =
// 1 / (1 + exp(-g)) (each backend has its own fast exp).
template <class T>
TRAINER_HD T silu_from_sigmoid(T g, T sig) {
  return g * sig;
}
// d silu / dg = sig + g sig (1 - sig).
template <class T>
TRAINER_HD T silu_grad_from_sigmoid(T g, T sig) {
  return sig * (T(1) + g * (T(1) - sig));
}

// RoPE: the pair (x0, x1) rotated by the angle whose cosine and sine are c, s (Meta's Llama
// multiplies x0 + i x1 by e^(i angle)). Backward is the rotation by minus the angle, (c, -s):
// the transpose of this one.
template <class T>
TRAINER_HD void rotate_pair(T& x0, T& x1, T c, T s) {
  const T a = x0, b = x1;
  x0 = a * c - b * s;
  x1 = a * s + b * c;
}

// One AdamW element with decoupled weight decay. c1, c2 are the bias corrections
// 1 / (1 - beta^step); gs scales the gradient first (clipping, 1 / loss scale).
template <class T>
struct AdamWConsts {
  T b1, b2, c1, c2, lr, eps, wd, gs;
  bool sgd = false;     // sgd_element instead
  bool frozen = false;  // 1-bit Adam after warm-up: the gradient is the momentum, v frozen
};
// The constants of one update from its arguments (AdamWArgs, kernels/kernels.h), on the host, in
// T: the CPU and CUDA backends compute the bias corrections alike.
template <class T, class Args>
AdamWConsts<T> adamw_consts(const Args& a) {
  const T b1 = a.beta1, b2 = a.beta2;
  const int64_t variance_step = a.variance_step ? a.variance_step : a.step;
  return {b1,
          b2,
          T(1) / (T(1) - std::pow(b1, T(a.step))),
          T(1) / (T(1) - std::pow(b2, T(variance_step))),
          a.lr,
          a.eps,
          a.weight_decay,
          a.grad_scale,
          a.sgd,
          a.variance_step > 0};
}
// Momentum SGD with decoupled weight decay, b1 the momentum (PyTorch's SGD with dampening 0,
// the decay applied as AdamW's): linear in the gradient, so that an average of updates is the
// update of the average (what local SGD's equivalence with data parallelism rests on).
template <class T>
TRAINER_HD void sgd_element(T& param, T grad, T& m, const AdamWConsts<T>& a) {
  m = a.b1 * m + grad * a.gs;
  param -= a.lr * (m + a.wd * param);
}
// 1-bit Adam after its warm-up: grad is the momentum, exchanged; v stays frozen.
template <class T, class Sqrt>
TRAINER_HD void frozen_adam_element(T& param, T grad, T& m, T v, const AdamWConsts<T>& a,
                                    Sqrt sqrt) {
  m = grad * a.gs;
  param -= a.lr * ((m * a.c1) / (sqrt(v * a.c2) + a.eps) + a.wd * param);
}
template <class T, class Sqrt>
TRAINER_HD void adam_element(T& param, T grad, T& m, T& v, const AdamWConsts<T>& a, Sqrt sqrt) {
  const T g = grad * a.gs;
  const T mi = a.b1 * m + (T(1) - a.b1) * g;
  const T vi = a.b2 * v + (T(1) - a.b2) * g * g;
  m = mi;
  v = vi;
  param -= a.lr * ((mi * a.c1) / (sqrt(vi * a.c2) + a.eps) + a.wd * param);
}
// The update a.sgd and a.frozen select. A loop that should vectorize picks the element function
// once outside it instead (a branch in the loop body keeps the compiler from vectorizing).
template <class T, class Sqrt>
TRAINER_HD void adamw_element(T& param, T grad, T& m, T& v, const AdamWConsts<T>& a, Sqrt sqrt) {
  if (a.sgd) return sgd_element(param, grad, m, a);
  if (a.frozen) return frozen_adam_element(param, grad, m, v, a, sqrt);
  adam_element(param, grad, m, v, a, sqrt);
}

}  // namespace trainer
