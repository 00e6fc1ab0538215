// Every CPU kernel in fp32 against a naive double-precision reference, forward and backward.
// Tolerances: fp32 has a unit roundoff of 6e-8; the longest sums here have a few hundred terms
// of O(1) values, so relative errors stay below 1e-5; we allow rtol 1e-4 and a small atol for
// values that cancel to near zero.
#include <cblas.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <limits>
#include <type_traits>

#include "kernels/cpu/panel_gemm.h"
#include "kernels/half.h"
#include "model/architectures.h"
#include "model/context_parallel.h"
#include "stored_values.h"
#include "test_util.h"

namespace trainer::test {
namespace {

TEST(Kernels, EncoderForwardBackward) {
  Device d;
  const int B = 2, T = 5, C = 8, V = 7;
  std::vector<int32_t> tokens = {1, 3, 3, 0, 6, 6, 6, 2, 1, 5};
  auto wte = random_vector(V * C, 1), wpe = random_vector(T * C, 2);
  auto dout = random_vector(B * T * C, 3);
  DPtr out = d.upload(std::vector<float>(B * T * C));
  d.k->encoder_forward(out, tokens.data(), d.upload(wte), d.upload(wpe), B, T, C, {0, V, V});
  std::vector<double> want(B * T * C), dwte_want(V * C, 0.5), dwpe_want(T * C, 0.5);
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++)
      for (int c = 0; c < C; c++) {
        const int i = (b * T + t) * C + c;
        want[i] = wte[tokens[b * T + t] * C + c] + wpe[t * C + c];
        dwte_want[tokens[b * T + t] * C + c] += dout[i];
        dwpe_want[t * C + c] += dout[i];
      }
  EXPECT_TRUE(all_close(d.download<float>(out, want.size()), want, kRtol, kAtol));
  // Backward accumulates into existing gradients (here 0.5 everywhere).
  DPtr dwte = d.upload(std::vector<float>(V * C, 0.5f)),
       dwpe = d.upload(std::vector<float>(T * C, 0.5f));
  d.k->encoder_backward(dwte, dwpe, d.upload(dout), tokens.data(), B, T, C, {0, V, V});
  EXPECT_TRUE(all_close(d.download<float>(dwte, V * C), dwte_want, kRtol, kAtol));
  EXPECT_TRUE(all_close(d.download<float>(dwpe, T * C), dwpe_want, kRtol, kAtol));
}

TEST(Kernels, LayerNormForwardBackward) {
  Device d;
  const int N = 37, C = 48;
  auto x = random_vector(N * C, 4, 2.0), w = random_vector(C, 5), b = random_vector(C, 6);
  auto dout = random_vector(N * C, 7);
  DPtr out = d.upload(std::vector<float>(N * C)), mean = d.upload(std::vector<float>(N)),
       rstd = d.upload(std::vector<float>(N));
  DPtr xd = d.upload(x), wd = d.upload(w), bd = d.upload(b);
  d.k->layernorm_forward(out, mean, rstd, xd, wd, bd, N, C);

  std::vector<double> want(N * C), mean_want(N), rstd_want(N);
  std::vector<double> dx_want(N * C, 0.25), dw_want(C, 0.25), db_want(C, 0.25);
  for (int n = 0; n < N; n++) {
    double m = 0, v = 0;
    for (int c = 0; c < C; c++) m += x[n * C + c];
    m /= C;
    for (int c = 0; c < C; c++) v += (x[n * C + c] - m) * (x[n * C + c] - m);
    v /= C;
    const double s = 1 / std::sqrt(v + 1e-5);
    mean_want[n] = m;
    rstd_want[n] = s;
    // y = xhat * w + b, xhat = (x - m) s:
    // dx = s * (g - mean(g) - xhat * mean(g * xhat)) with g = dout * w.
    double gm = 0, gxm = 0;
    for (int c = 0; c < C; c++) {
      const double xhat = (x[n * C + c] - m) * s, g = dout[n * C + c] * w[c];
      want[n * C + c] = xhat * w[c] + b[c];
      gm += g / C;
      gxm += g * xhat / C;
      dw_want[c] += dout[n * C + c] * xhat;
      db_want[c] += dout[n * C + c];
    }
    for (int c = 0; c < C; c++) {
      const double xhat = (x[n * C + c] - m) * s, g = dout[n * C + c] * w[c];
      dx_want[n * C + c] += s * (g - gm - xhat * gxm);
    }
  }
  EXPECT_TRUE(all_close(d.download<float>(out, N * C), want, kRtol, kAtol));
  EXPECT_TRUE(all_close(d.download<float>(mean, N), mean_want, kRtol, kAtol));
  EXPECT_TRUE(all_close(d.download<float>(rstd, N), rstd_want, kRtol, kAtol));

  DPtr dx = d.upload(std::vector<float>(N * C, 0.25f)), dw = d.upload(std::vector<float>(C, 0.25f)),
       db = d.upload(std::vector<float>(C, 0.25f));
  d.k->layernorm_backward(dx, dw, db, d.upload(dout), xd, wd, mean, rstd, N, C);
  EXPECT_TRUE(all_close(d.download<float>(dx, N * C), dx_want, kRtol, kAtol));
  EXPECT_TRUE(all_close(d.download<float>(dw, C), dw_want, kRtol, kAtol));
  EXPECT_TRUE(all_close(d.download<float>(db, C), db_want, kRtol, kAtol));
}

TEST(Kernels, MatmulForwardBackward) {
  Device d;
  const int N = 45, IC = 33, OC = 70;
  auto x = random_vector(N * IC, 8), w = random_vector(OC * IC, 9), bias = random_vector(OC, 10);
  auto dout = random_vector(N * OC, 11);
  for (bool with_bias : {true, false}) {
    DPtr out = d.upload(std::vector<float>(N * OC));
    DPtr xd = d.upload(x), wd = d.upload(w);
    d.k->matmul_forward(out, xd, wd, with_bias ? d.upload(bias) : DPtr{}, N, IC, OC);
    std::vector<double> want(N * OC), dx_want(N * IC), dw_want(OC * IC, 1.0), db_want(OC, 1.0);
    for (int n = 0; n < N; n++)
      for (int o = 0; o < OC; o++) {
        double s = with_bias ? bias[o] : 0.0;
        for (int i = 0; i < IC; i++) s += double(x[n * IC + i]) * w[o * IC + i];
        want[n * OC + o] = s;
        db_want[o] += dout[n * OC + o];
        for (int i = 0; i < IC; i++) {
          dx_want[n * IC + i] += double(dout[n * OC + o]) * w[o * IC + i];
          dw_want[o * IC + i] += double(dout[n * OC + o]) * x[n * IC + i];
        }
      }
    EXPECT_TRUE(all_close(d.download<float>(out, N * OC), want, kRtol, kAtol));
    // dinp is overwritten (start from garbage), dweight and dbias accumulate (start from 1).
    DPtr dx = d.upload(std::vector<float>(N * IC, 7.0f));
    DPtr dw = d.upload(std::vector<float>(OC * IC, 1.0f)),
         db = d.upload(std::vector<float>(OC, 1.0f));
    d.k->matmul_backward(dx, dw, with_bias ? db : DPtr{}, d.upload(dout), xd, wd, N, IC, OC);
    EXPECT_TRUE(all_close(d.download<float>(dx, N * IC), dx_want, kRtol, kAtol));
    EXPECT_TRUE(all_close(d.download<float>(dw, OC * IC), dw_want, kRtol, kAtol));
    if (with_bias) {
      EXPECT_TRUE(all_close(d.download<float>(db, OC), db_want, kRtol, kAtol));
    }
  }
}

// The layers' float multiplies go through the panel GEMM where the build has AVX-512, and
// through OpenBLAS otherwise: the matmul's bits are one or the other's, which differ.
TEST(Kernels, MatmulUsesThePanelGemmWithAvx512) {
  Device d;
  const int N = 60, IC = 700, OC = 90;
  auto x = random_vector(N * IC, 8), w = random_vector(OC * IC, 9);
  DPtr out = d.upload(std::vector<float>(N * OC));
  d.k->matmul_forward(out, d.upload(x), d.upload(w), DPtr{}, N, IC, OC);
  std::vector<float> panel(N * OC), openblas(N * OC);
  cpu::panel_gemm<float>(false, true, N, OC, IC, 1.0f, x.data(), IC, w.data(), IC, 0.0f,
                         panel.data(), OC);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, IC, 1.0f, x.data(), IC, w.data(), IC,
              0.0f, openblas.data(), OC);
  ASSERT_NE(panel, openblas);  // else this test could not tell them apart
  EXPECT_EQ(d.download<float>(out, N * OC), cpu::kVectorBytes == 64 ? panel : openblas);
}

TEST(Kernels, GeluForwardBackward) {
  Device d;
  const int n = 1000;
  auto x = random_vector(n, 14, 3.0), dout = random_vector(n, 15);
  std::vector<double> want(n), dwant(n);
  const double s = std::sqrt(2 / M_PI);
  for (int i = 0; i < n; i++) {
    const double u = s * (x[i] + 0.044715 * std::pow(x[i], 3)), th = std::tanh(u);
    want[i] = 0.5 * x[i] * (1 + th);
    dwant[i] = dout[i] *
               (0.5 * (1 + th) + 0.5 * x[i] * (1 - th * th) * s * (1 + 3 * 0.044715 * x[i] * x[i]));
  }
  DPtr out = d.upload(std::vector<float>(n)), xd = d.upload(x),
       dx = d.upload(std::vector<float>(n, 4.0f));
  d.k->gelu_forward(out, xd, n);
  d.k->gelu_backward(dx, xd, d.upload(dout), n);
  EXPECT_TRUE(all_close(d.download<float>(out, n), want, kRtol, kAtol));
  EXPECT_TRUE(all_close(d.download<float>(dx, n), dwant, kRtol, kAtol));
}

TEST(Kernels, Residual) {
  Device d;
  auto a = random_vector(100, 16), b = random_vector(100, 17);
  std::vector<double> want(100);
  for (int i = 0; i < 100; i++) want[i] = double(a[i]) + b[i];
  DPtr out = d.upload(std::vector<float>(100));
  d.k->residual_forward(out, d.upload(a), d.upload(b), 100);
  EXPECT_TRUE(all_close(d.download<float>(out, 100), want, kRtol, kAtol));
}

TEST(Kernels, SoftmaxCrossEntropyOverPaddedVocab) {
  Device d;
  const int N = 9, V = 50, Vp = 64;
  auto logits = random_vector(N * Vp, 18, 3.0);
  for (int n = 0; n < N; n++)  // padded columns hold garbage that must not matter
    for (int v = V; v < Vp; v++) logits[n * Vp + v] = 1e4f;
  std::vector<int32_t> targets = {0, 49, 3, 3, 17, 25, 1, 48, 10};
  const float dloss = 0.37f;
  std::vector<double> probs(N * Vp, 0.0), losses(N), grad(N * Vp, 0.0);
  double mean = 0;
  for (int n = 0; n < N; n++) {
    double mx = -1e300, sum = 0;
    for (int v = 0; v < V; v++) mx = std::max(mx, double(logits[n * Vp + v]));
    for (int v = 0; v < V; v++) sum += std::exp(logits[n * Vp + v] - mx);
    for (int v = 0; v < V; v++) {
      probs[n * Vp + v] = std::exp(logits[n * Vp + v] - mx) / sum;
      grad[n * Vp + v] = (probs[n * Vp + v] - (v == targets[n])) * dloss;
    }
    losses[n] = -std::log(probs[n * Vp + targets[n]]);
    mean += losses[n] / N;
  }
  DPtr ld = d.upload(logits), lossd = d.upload(std::vector<float>(N));
  const std::vector<float> logits_before = d.download<float>(ld, N * Vp);
  const CrossEntropyForward ce = softmax_crossentropy<float>(d, lossd, ld, targets, V, Vp);
  EXPECT_NEAR(ce.mean, mean, 1e-5 * mean);
  EXPECT_TRUE(all_close(d.download<float>(lossd, N), losses, kRtol, kAtol));
  // The forward only reads the logits: the backward recomputes the softmax from them.
  EXPECT_EQ(d.download<float>(ld, N * Vp), logits_before);
  d.k->crossentropy_backward(ld, ce.rowmax, ce.sumexp, targets.data(), dloss, N, {0, V, Vp});
  EXPECT_TRUE(all_close(d.download<float>(ld, N * Vp), grad, kRtol, 1e-7));

  // Vocab-parallel: two slices of 32 columns each (the second with 18 real ones), combining
  // only the per-row statistics as the tensor-parallel ranks do (each rank's exp-sums rebased on
  // the group's max, then summed), give the same loss and gradients as one rank holding every
  // column.
  std::vector<VocabSlice> slices = {{0, 32, 32}, {32, V - 32, 32}};
  std::vector<DPtr> parts, rowmax, sumexp, target;
  std::vector<std::vector<float>> local_max(2);
  for (int r = 0; r < 2; r++) {
    std::vector<float> part(N * 32);
    for (int n = 0; n < N; n++)
      for (int i = 0; i < 32; i++) part[n * 32 + i] = logits[n * Vp + 32 * r + i];
    parts.push_back(d.upload(part));
    rowmax.push_back(d.upload(std::vector<float>(N)));
    sumexp.push_back(d.upload(std::vector<float>(N)));
    target.push_back(d.upload(std::vector<float>(N)));
    d.k->crossentropy_stats(rowmax[r], sumexp[r], target[r], parts[r], targets.data(), N,
                            slices[r]);
    local_max[r] = d.download<float>(rowmax[r], N);
  }
  std::vector<float> gmax(N), gsum(N, 0), gtarget(N, 0);
  for (int n = 0; n < N; n++) gmax[n] = std::max(local_max[0][n], local_max[1][n]);
  for (int r = 0; r < 2; r++) {
    d.k->crossentropy_rebase(rowmax[r], sumexp[r], d.upload(gmax), N);
    EXPECT_EQ(d.download<float>(rowmax[r], N), gmax);
    auto se = d.download<float>(sumexp[r], N), tl = d.download<float>(target[r], N);
    for (int n = 0; n < N; n++) {
      gsum[n] += se[n];
      gtarget[n] += tl[n];
    }
  }
  for (int r = 0; r < 2; r++) {
    DPtr part_losses = d.upload(std::vector<float>(N)), sums = d.upload(gsum);
    const double part_mean =
        d.k->crossentropy_loss(part_losses, rowmax[r], sums, d.upload(gtarget), N);
    EXPECT_NEAR(part_mean, mean, 1e-5 * mean);
    d.k->crossentropy_backward(parts[r], rowmax[r], sums, targets.data(), dloss, N, slices[r]);
    auto got = d.download<float>(parts[r], N * 32);
    std::vector<double> want_part(N * 32);
    for (int n = 0; n < N; n++)
      for (int i = 0; i < 32; i++) want_part[n * 32 + i] = grad[n * Vp + 32 * r + i];
    EXPECT_TRUE(all_close(got, want_part, kRtol, 1e-7)) << "slice " << r;
  }
  // A rank whose slice holds no real column (a small vocabulary split over tp) adds nothing: its
  // max is the lowest float, its sum 0 before and after the rebase, and its gradients are 0.
  const VocabSlice empty{V, 0, 32};
  DPtr part = d.upload(std::vector<float>(N * 32, 1e4f)), m = d.upload(std::vector<float>(N)),
       se = d.upload(std::vector<float>(N)), tl = d.upload(std::vector<float>(N));
  d.k->crossentropy_stats(m, se, tl, part, targets.data(), N, empty);
  EXPECT_EQ(d.download<float>(m, N), std::vector<float>(N, std::numeric_limits<float>::lowest()));
  EXPECT_EQ(d.download<float>(se, N), std::vector<float>(N, 0.0f));
  EXPECT_EQ(d.download<float>(tl, N), std::vector<float>(N, 0.0f));
  d.k->crossentropy_rebase(m, se, d.upload(gmax), N);
  EXPECT_EQ(d.download<float>(se, N), std::vector<float>(N, 0.0f));
  d.k->crossentropy_backward(part, m, d.upload(gsum), targets.data(), dloss, N, empty);
  EXPECT_EQ(d.download<float>(part, N * 32), std::vector<float>(N * 32, 0.0f));
}

// The softmax cross-entropy in one pass (a forward that a backward follows, no group combining
// the statistics in between) leaves the statistics and gradients of the two passes bit for bit:
// fp32 and fp64 in place, bf16 staged through fp32; rows of several vectors and a tail, targets
// at both ends, and a slice of the vocabulary that holds only some of them.
TEST(Kernels, SoftmaxCrossEntropyInOnePassIsTheTwoPassesBitForBit) {
  Device d;
  const int N = 7, Vp = 1024;
  const std::vector<float> logits = random_vector(N * Vp, 19, 4.0);
  const std::vector<int32_t> targets = {0, 999, 17, 512, 3, 998, 640};
  const float dloss = 0.37f / N;
  for (DType dt : {DType::f32, DType::f64, DType::bf16})
    for (VocabSlice v : {VocabSlice{0, 1000, Vp}, VocabSlice{200, 600, Vp}}) {
      const DType stats = dt == DType::f64 ? DType::f64 : DType::f32;
      auto run = [&](bool one_pass) {
        DPtr x = d.k->alloc(N * Vp, dt), rowmax = d.k->alloc(N, stats),
             sumexp = d.k->alloc(N, stats), target = d.k->alloc(N, stats);
        d.k->upload_f32(x, logits.data(), N * Vp);
        if (one_pass) {
          d.k->crossentropy_stats_and_backward(rowmax, sumexp, target, x, targets.data(), dloss, N,
                                               v);
        } else {
          d.k->crossentropy_stats(rowmax, sumexp, target, x, targets.data(), N, v);
          d.k->crossentropy_backward(x, rowmax, sumexp, targets.data(), dloss, N, v);
        }
        std::vector<std::vector<double>> out;
        for (auto [p, n] : {std::pair{x, N * Vp}, {rowmax, N}, {sumexp, N}, {target, N}}) {
          std::vector<double> host(n);
          if (p.dtype == DType::f64) {
            d.k->copy_to_host(host.data(), p, n);
          } else {
            std::vector<float> f(n);
            d.k->download_f32(f.data(), p, n);
            std::copy(f.begin(), f.end(), host.begin());
          }
          out.push_back(host);
          d.k->free(p);
        }
        return out;
      };
      const auto two = run(false), one = run(true);
      const std::string where =
          std::string(dtype_name(dt)) + ", slice from " + std::to_string(v.start);
      EXPECT_EQ(one[0], two[0]) << "gradients, " << where;
      EXPECT_EQ(one[1], two[1]) << "row maxima, " << where;
      EXPECT_EQ(one[2], two[2]) << "exp-sums, " << where;
      EXPECT_EQ(one[3], two[3]) << "target logits, " << where;
      // And they are gradients: each row's real columns sum to 0 where the slice holds its
      // target (the softmax's 1 less the target's), and the padding is 0.
      for (int n = 0; n < N; n++) {
        double sum = 0;
        for (int i = 0; i < v.valid; i++) sum += one[0][size_t(n) * Vp + i];
        if (v.holds(targets[n])) {
          EXPECT_NEAR(sum, 0.0, 1e-2 * dloss) << "row " << n << ", " << where;
        }
        for (int i = v.valid; i < Vp; i++) ASSERT_EQ(one[0][size_t(n) * Vp + i], 0.0) << where;
      }
    }
}

TEST(Kernels, VocabParallelEncoderSumsToTheWholeEmbedding) {
  Device d;
  const int B = 2, T = 3, C = 4, V = 7, Vp = 8;
  std::vector<int32_t> tokens = {0, 3, 4, 6, 6, 1};
  auto wte = random_vector(Vp * C, 31), wpe = random_vector(T * C, 32);
  DPtr whole = d.upload(std::vector<float>(B * T * C));
  d.k->encoder_forward(whole, tokens.data(), d.upload(wte), d.upload(wpe), B, T, C, {0, V, Vp});
  std::vector<float> sum(B * T * C, 0.0f);
  for (int r = 0; r < 2; r++) {  // rows [0, 4) with the position embedding, [4, 8) without
    std::vector<float> rows(wte.begin() + r * 4 * C, wte.begin() + (r + 1) * 4 * C);
    DPtr out = d.upload(std::vector<float>(B * T * C));
    d.k->encoder_forward(out, tokens.data(), d.upload(rows), r == 0 ? d.upload(wpe) : DPtr{}, B, T,
                         C, {4 * r, std::min(4, V - 4 * r), 4});
    auto part = d.download<float>(out, B * T * C);
    for (size_t i = 0; i < sum.size(); i++) sum[i] += part[i];
  }
  EXPECT_EQ(sum, d.download<float>(whole, B * T * C));
}

TEST(Kernels, SumSquaresIsDeterministicAndExact) {
  Device d;
  // Chunks (a 64th each) shorter than the 32 lanes, exactly 3 x 32, and with a ragged tail.
  for (int n : {1, 63, 64, 1000, 64 * 32 * 3, 100003}) {
    auto x = random_vector(n, 19);
    double want = 0;
    for (float v : x) want += double(v) * v;
    DPtr xd = d.upload(x);
    const double got = d.k->sum_squares(xd, n);
    EXPECT_NEAR(got, want, 1e-12 * want) << n;
    EXPECT_EQ(got, d.k->sum_squares(xd, n));
    // The same sum, bit for bit, on one thread and on three.
    for (int t : {1, 3}) {
      const OmpThreads threads(t);
      EXPECT_EQ(got, d.k->sum_squares(xd, n)) << n << " on " << t << " threads";
    }
  }
}

// A large buffer is zeroed in 4 MB slices across the threads: every element of the range goes,
// the last partial slice's included, and none outside it (4- and 8-byte elements).
TEST(Kernels, ZeroClearsExactlyItsRange) {
  Device d;
  auto check = [&]<class T>(T) {
    const int64_t n = (int64_t(9) << 20) / int64_t(sizeof(T)) + 3;
    DPtr p = d.upload(std::vector<T>(size_t(n) + 2, T(1)));
    d.k->zero(p + 1, n);
    const auto v = d.download<T>(p, size_t(n) + 2);
    EXPECT_EQ(v.front(), T(1));
    EXPECT_EQ(v.back(), T(1));
    EXPECT_EQ(std::count(v.begin() + 1, v.end() - 1, T(0)), n) << sizeof(T);
  };
  check(0.0f);
  check(0.0);
}

// Over ranges: exactly the per-range sums added in order (the gradient norm before and after
// it became one call), and the sum over the union of the ranges in double.
TEST(Kernels, SumSquaresOverRangesIsThePerRangeSum) {
  Device d;
  auto x = random_vector(5000, 29);
  DPtr xd = d.upload(x);
  const std::vector<Range> ranges = {{0, 1}, {7, 100}, {200, 0}, {300, 4000}, {4999, 1}};
  double per_range = 0, want = 0;
  for (const Range& r : ranges) {
    per_range += d.k->sum_squares(xd + r.offset, r.count);
    for (int64_t i = r.offset; i < r.offset + r.count; i++) want += double(x[i]) * x[i];
  }
  EXPECT_EQ(d.k->sum_squares(xd, ranges), per_range);
  EXPECT_NEAR(d.k->sum_squares(xd, ranges), want, 1e-12 * want);
  EXPECT_EQ(d.k->sum_squares(xd, std::vector<Range>{}), 0.0);
}

TEST(Kernels, AdamWMatchesReference) {
  Device d;
  const int n = 257;
  auto p = random_vector(n, 20), g = random_vector(n, 21), m = random_vector(n, 22, 0.1);
  auto v = random_vector(n, 23, 0.1);
  for (auto& x : v) x = x * x;
  const AdamWArgs a{1e-2f, 0.9f, 0.98f, 1e-6f, 0.1f, 7, 0.5f};
  std::vector<double> pw(n), mw(n), vw(n);
  for (int i = 0; i < n; i++) {
    const double gi = double(g[i]) * 0.5;
    mw[i] = 0.9 * m[i] + 0.1 * gi;
    vw[i] = 0.98 * v[i] + 0.02 * gi * gi;
    const double mhat = mw[i] / (1 - std::pow(0.9, 7)), vhat = vw[i] / (1 - std::pow(0.98, 7));
    pw[i] = p[i] - 1e-2 * (mhat / (std::sqrt(vhat) + 1e-6) + 0.1 * p[i]);
  }
  DPtr pd = d.upload(p), md = d.upload(m), vd = d.upload(v);
  d.k->adamw_update(pd, d.upload(g), md, vd, n, a);
  EXPECT_TRUE(all_close(d.download<float>(pd, n), pw, kRtol, kAtol));
  EXPECT_TRUE(all_close(d.download<float>(md, n), mw, kRtol, kAtol));
  EXPECT_TRUE(all_close(d.download<float>(vd, n), vw, kRtol, 1e-7));
}

// Momentum SGD (the flag on the same kernel): m = mu m + g s, w -= lr (m + wd w); v untouched.
TEST(Kernels, SgdMatchesReference) {
  Device d;
  const int n = 257;
  auto p = random_vector(n, 30), g = random_vector(n, 31), m = random_vector(n, 32, 0.1);
  const auto v = random_vector(n, 33, 0.1);
  AdamWArgs a{1e-2f, 0.8f, 0.98f, 1e-6f, 0.1f, 7, 0.5f};
  a.sgd = true;
  std::vector<double> pw(n), mw(n);
  for (int i = 0; i < n; i++) {
    mw[i] = 0.8 * m[i] + 0.5 * double(g[i]);
    pw[i] = p[i] - 1e-2 * (mw[i] + 0.1 * p[i]);
  }
  DPtr pd = d.upload(p), md = d.upload(m), vd = d.upload(v);
  d.k->adamw_update(pd, d.upload(g), md, vd, n, a);
  EXPECT_TRUE(all_close(d.download<float>(pd, n), pw, kRtol, kAtol));
  EXPECT_TRUE(all_close(d.download<float>(md, n), mw, kRtol, kAtol));
  EXPECT_EQ(d.download<float>(vd, n), v);
}

// 1-bit Adam after its warm-up: the gradient is the momentum already exchanged (it replaces m,
// scaled), v stays as it was, and its bias correction is the one of the step it froze at.
TEST(Kernels, FrozenVarianceAdamMatchesReference) {
  Device d;
  const int n = 257;
  auto p = random_vector(n, 40), g = random_vector(n, 41), m = random_vector(n, 42, 0.1);
  auto v = random_vector(n, 43, 0.1);
  for (float& x : v) x = std::abs(x) + 1e-3f;
  AdamWArgs a{1e-2f, 0.8f, 0.98f, 1e-6f, 0.1f, 17, 0.5f};
  a.variance_step = 5;
  std::vector<double> pw(n), mw(n);
  const double c1 = 1 / (1 - std::pow(0.8, 17)), c2 = 1 / (1 - std::pow(0.98, 5));
  for (int i = 0; i < n; i++) {
    mw[i] = 0.5 * double(g[i]);
    pw[i] = p[i] - 1e-2 * (mw[i] * c1 / (std::sqrt(v[i] * c2) + 1e-6) + 0.1 * p[i]);
  }
  DPtr pd = d.upload(p), md = d.upload(m), vd = d.upload(v);
  d.k->adamw_update(pd, d.upload(g), md, vd, n, a);
  EXPECT_TRUE(all_close(d.download<float>(pd, n), pw, kRtol, kAtol));
  EXPECT_TRUE(all_close(d.download<float>(md, n), mw, kRtol, kAtol));
  EXPECT_EQ(d.download<float>(vd, n), v);
}

// The CPU's MFU peak is the best rate it has been seen to reach: a floor (configured or
// measured by bursts) that its own matmul and attention calls raise and nothing lowers. The
// rate a caller measures around a call (which includes the call's own timing) can never
// exceed it.
TEST(Kernels, CpuPeakIsTheBestRateSeen) {
  Device d;
  EXPECT_EQ(d.k->peak_flops(DType::f32), 0.0);  // nothing measured or seen yet
  d.k->set_peak_flops(1e3);
  EXPECT_EQ(d.k->peak_flops(DType::f32), 1e3);
  const int N = 256, IC = 256, OC = 256;
  DPtr out = d.upload(std::vector<float>(N * OC)), x = d.upload(random_vector(N * IC, 1)),
       w = d.upload(random_vector(OC * IC, 2));
  const auto t0 = std::chrono::steady_clock::now();
  d.k->matmul_forward(out, x, w, DPtr{}, N, IC, OC);
  const double seen = 2.0 * N * IC * OC /
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(d.k->peak_flops(DType::f32), seen);
  const double after_matmul = d.k->peak_flops(DType::f32);
  d.k->set_peak_flops(1.0);  // a lower floor does not lower it
  EXPECT_EQ(d.k->peak_flops(DType::f32), after_matmul);
  // Attention counts the causal half: the rate it reports is at least the caller's rate for it.
  const int B = 2, T = 128, C = 64, NH = 4;
  DPtr qkv = d.upload(random_vector(B * T * 3 * C, 3)), y = d.upload(std::vector<float>(B * T * C)),
       lse = d.upload(std::vector<float>(B * NH * T));
  Device fresh;
  const auto t1 = std::chrono::steady_clock::now();
  fresh.k->attention_forward(y, lse, qkv, B, T, C, NH);
  const double attention_rate =
      2.0 * 2.0 * B * C * (T * (T + 1) / 2.0) /
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  EXPECT_GE(fresh.k->peak_flops(DType::f32), attention_rate);
  const double measured = fresh.k->measure_peak_flops();
  EXPECT_GT(measured, 1e8);  // any CPU that runs this sgemm does more than 0.1 GFLOP/s
  EXPECT_GE(fresh.k->peak_flops(DType::f32), measured);
}

// --- Llama-style kernels: in fp32 and on 16-bit storage (stored_values.h) -----------------
template <class S>
class LlamaKernels : public ::testing::Test {};
TYPED_TEST_SUITE(LlamaKernels, StorageTypes);

// RMSNorm: y = x rstd w, rstd = 1 / sqrt(mean(x^2) + eps); with xhat = x rstd and g = dout w,
// dx = rstd (g - xhat mean(g xhat)), dw = sum over rows of dout xhat. rstd is fp32 whatever the
// activations; dinp and dweight accumulate (start from 0.25).
TYPED_TEST(LlamaKernels, RmsNormForwardBackward) {
  using S = TypeParam;
  Device d;
  const int N = 37, C = 48;
  const float eps = 1e-5f;
  const auto x = stored<S>(random_vector(N * C, 4, 2.0)), w = stored<S>(random_vector(C, 5)),
             dout = stored<S>(random_vector(N * C, 7));
  const auto X = widened(x), W = widened(w), G = widened(dout);
  std::vector<double> want(N * C), rstd_want(N), dx_want(N * C, 0.25), dw_want(C, 0.25);
  for (int n = 0; n < N; n++) {
    double sq = 0;
    for (int c = 0; c < C; c++) sq += X[n * C + c] * X[n * C + c];
    const double r = 1 / std::sqrt(sq / C + double(eps));
    rstd_want[n] = r;
    double g_xhat = 0;
    for (int c = 0; c < C; c++) {
      const double xhat = X[n * C + c] * r;
      want[n * C + c] = xhat * W[c];
      g_xhat += G[n * C + c] * W[c] * xhat / C;
      dw_want[c] += G[n * C + c] * xhat;
    }
    for (int c = 0; c < C; c++)
      dx_want[n * C + c] += r * (G[n * C + c] * W[c] - X[n * C + c] * r * g_xhat);
  }
  DPtr out = d.upload(std::vector<S>(N * C)), rstd = d.upload(std::vector<float>(N));
  DPtr xd = d.upload(x), wd = d.upload(w);
  d.k->rmsnorm_forward(out, rstd, xd, wd, N, C, eps);
  const Tolerance tol = storage_tolerance<S>();
  EXPECT_TRUE(all_close(download_widened<S>(d, out, N * C), want, tol.rtol, tol.atol));
  EXPECT_TRUE(all_close(d.download<float>(rstd, N), rstd_want, kRtol, kAtol));
  DPtr dx = d.upload(stored<S>(std::vector<float>(N * C, 0.25f))),
       dw = d.upload(stored<S>(std::vector<float>(C, 0.25f)));
  d.k->rmsnorm_backward(dx, dw, d.upload(dout), xd, wd, rstd, N, C);
  EXPECT_TRUE(all_close(download_widened<S>(d, dx, N * C), dx_want, tol.rtol, tol.atol));
  EXPECT_TRUE(all_close(download_widened<S>(d, dw, C), dw_want, tol.rtol, tol.atol));
}

// Llama's table (model/architectures.h): angle(pos, i) = pos * 10000^(-2i / hs), stored as fp32
// (cos, sin) pairs.
std::vector<float> rope_table(int max_pos, int hs) {
  ModelConfig cfg;
  cfg.arch = Arch::llama;
  cfg.n_head = 1;
  cfg.d_model = hs;
  return trainer::rope_table(cfg, max_pos);
}

// Meta's apply_rotary_emb: (x[2i] + i x[2i+1]) * (cos + i sin) on each query and key head, at
// position pos0 + t; value heads untouched. Backward (the transpose) is checked in
// test_gradcheck.cpp; here it undoes the forward.
TYPED_TEST(LlamaKernels, RopeRotatesQueryAndKeyPairs) {
  using S = TypeParam;
  Device d;
  const int B = 2, T = 5, NH = 4, NKV = 2, hs = 6, pos0 = 3, W = (NH + 2 * NKV) * hs;
  const auto table = rope_table(16, hs);
  const auto qkv = stored<S>(random_vector(B * T * W, 15));
  const auto X = widened(qkv);
  std::vector<double> want = X;
  for (int bt = 0; bt < B * T; bt++)
    for (int h = 0; h < NH + NKV; h++)  // query then key heads
      for (int i = 0; i < hs / 2; i++) {
        const int pos = pos0 + bt % T, at = bt * W + h * hs + 2 * i;
        const double c = table[(pos * hs / 2 + i) * 2], s = table[(pos * hs / 2 + i) * 2 + 1];
        want[at] = X[at] * c - X[at + 1] * s;
        want[at + 1] = X[at] * s + X[at + 1] * c;
      }
  DPtr x = d.upload(qkv), cs = d.upload(table);
  d.k->rope_forward(x, cs, B, T, NH, NKV, hs, pos0);
  const Tolerance tol = storage_tolerance<S>();
  const auto rotated = download_widened<S>(d, x, B * T * W);
  EXPECT_TRUE(all_close(rotated, want, tol.rtol, tol.atol));
  for (int bt = 0; bt < B * T; bt++)  // value heads exactly as they were
    for (int e = (NH + NKV) * hs; e < W; e++) ASSERT_EQ(rotated[bt * W + e], X[bt * W + e]);
  // Backward rotates back: the identity, up to one more rounding.
  d.k->rope_backward(x, cs, B, T, NH, NKV, hs, pos0);
  const Tolerance twice = storage_tolerance<S>(2);
  EXPECT_TRUE(all_close(download_widened<S>(d, x, B * T * W), X, twice.rtol, twice.atol));
}

// A cached generation step rotates token t of a suffix at position pos0 + t: the same values as
// those rows of the whole sequence rotated from position 0.
TEST(Kernels, RopeAtAnOffsetIsTheLongerSequencesRows) {
  Device d;
  const int T = 8, pos0 = 3, NH = 2, NKV = 1, hs = 4, W = (NH + 2 * NKV) * hs;
  const auto table = rope_table(T, hs);
  const auto qkv = random_vector(T * W, 16);
  DPtr whole = d.upload(qkv), cs = d.upload(table);
  d.k->rope_forward(whole, cs, 1, T, NH, NKV, hs, 0);
  DPtr tail = d.upload(std::vector<float>(qkv.begin() + pos0 * W, qkv.end()));
  d.k->rope_forward(tail, cs, 1, T - pos0, NH, NKV, hs, pos0);
  const auto all = d.download<float>(whole, T * W);
  EXPECT_EQ(d.download<float>(tail, (T - pos0) * W),
            std::vector<float>(all.begin() + pos0 * W, all.end()));
}

// SwiGLU: out = silu(gate) up, silu(g) = g / (1 + e^-g); d gate = dout up silu'(g) with
// silu'(g) = sig (1 + g (1 - sig)), d up = dout silu(g).
TYPED_TEST(LlamaKernels, SwiGluForwardBackward) {
  using S = TypeParam;
  Device d;
  const int N = 13, F = 40;
  const auto gate_up = stored<S>(random_vector(N * 2 * F, 17, 3.0)),
             dout = stored<S>(random_vector(N * F, 18));
  const auto X = widened(gate_up), G = widened(dout);
  std::vector<double> want(N * F), dwant(N * 2 * F);
  for (int n = 0; n < N; n++)
    for (int f = 0; f < F; f++) {
      const double g = X[n * 2 * F + f], up = X[n * 2 * F + F + f], dy = G[n * F + f];
      const double sig = 1 / (1 + std::exp(-g));
      want[n * F + f] = g * sig * up;
      dwant[n * 2 * F + f] = dy * up * sig * (1 + g * (1 - sig));
      dwant[n * 2 * F + F + f] = dy * g * sig;
    }
  DPtr out = d.upload(std::vector<S>(N * F)), gu = d.upload(gate_up);
  DPtr dgu = d.upload(stored<S>(std::vector<float>(N * 2 * F, 6.0f)));  // overwritten
  d.k->swiglu_forward(out, gu, N, F);
  d.k->swiglu_backward(dgu, d.upload(dout), gu, N, F);
  const Tolerance tol = storage_tolerance<S>();
  EXPECT_TRUE(all_close(download_widened<S>(d, out, N * F), want, tol.rtol, tol.atol));
  EXPECT_TRUE(all_close(download_widened<S>(d, dgu, N * 2 * F), dwant, tol.rtol, tol.atol));
}

// Dropout keeps an element with probability 1 - p and scales it by 1 / (1 - p), rounded once to
// the storage type; the mask depends on (seed, offset + i) only.
TYPED_TEST(LlamaKernels, DropoutIsCounterBased) {
  using S = TypeParam;
  Device d;
  const int n = 100000;
  const float p = 0.3f;
  const auto x = stored<S>(random_vector(n, 19));
  auto dropped = [&](const std::vector<S>& v, float prob, uint64_t seed, int64_t offset) {
    DPtr buf = d.upload(v);
    d.k->dropout(buf, int64_t(v.size()), prob, seed, offset);
    return download_widened<S>(d, buf, v.size());
  };
  const auto X = widened(x);
  EXPECT_EQ(dropped(x, 0.0f, 1, 0), X);  // p = 0: a no-op
  const auto y = dropped(x, p, 42, 1000);
  const float scale = 1.0f / (1.0f - p);
  int zeros = 0;
  for (int i = 0; i < n; i++) {
    if (y[i] == 0) {
      zeros++;
      continue;
    }
    ASSERT_EQ(y[i], widened(stored<S>({float(X[i]) * scale}))[0]) << i;
  }
  // Binomial: the standard deviation of the dropped fraction is sqrt(p (1 - p) / n) = 0.0014.
  EXPECT_NEAR(double(zeros) / n, p, 0.01);
  EXPECT_EQ(dropped(x, p, 42, 1000), y);  // same seed, same mask
  EXPECT_NE(dropped(x, p, 43, 1000), y);
  // Element i is numbered offset + i: a suffix called with the offset moved is the same mask.
  const int k = 777;
  EXPECT_EQ(dropped(std::vector<S>(x.begin() + k, x.end()), p, 42, 1000 + k),
            std::vector<double>(y.begin() + k, y.end()));
  // Backward is the same call on the gradient: it zeroes exactly where forward did.
  const auto g = dropped(stored<S>(random_vector(n, 20, 1.0)), p, 42, 1000);
  for (int i = 0; i < n; i++) ASSERT_EQ(g[i] == 0, y[i] == 0) << i;
}

// GPT-2 without biases (bias = false): a null bias adds nothing and a null dbias is skipped;
// everything else is what a zero bias gives.
TEST(Kernels, LayerNormWithoutBias) {
  Device d;
  const int N = 9, C = 32;
  auto x = random_vector(N * C, 21, 2.0), w = random_vector(C, 22), dout = random_vector(N * C, 23);
  DPtr xd = d.upload(x), wd = d.upload(w), zero_bias = d.upload(std::vector<float>(C));
  std::vector<std::vector<float>> outs, dxs, dws;
  for (bool with_bias : {true, false}) {
    DPtr out = d.upload(std::vector<float>(N * C)), mean = d.upload(std::vector<float>(N)),
         rstd = d.upload(std::vector<float>(N));
    d.k->layernorm_forward(out, mean, rstd, xd, wd, with_bias ? zero_bias : DPtr{}, N, C);
    DPtr dx = d.upload(std::vector<float>(N * C)), dw = d.upload(std::vector<float>(C)),
         db = d.upload(std::vector<float>(C));
    d.k->layernorm_backward(dx, dw, with_bias ? db : DPtr{}, d.upload(dout), xd, wd, mean, rstd, N,
                            C);
    outs.push_back(d.download<float>(out, N * C));
    dxs.push_back(d.download<float>(dx, N * C));
    dws.push_back(d.download<float>(dw, C));
  }
  EXPECT_EQ(outs[1], outs[0]);
  EXPECT_EQ(dxs[1], dxs[0]);
  EXPECT_EQ(dws[1], dws[0]);
  // The bias-free output is the normalised input times the weight.
  const auto out = outs[1];
  for (int n = 0; n < N; n++) {
    double m = 0, v = 0;
    for (int c = 0; c < C; c++) m += x[n * C + c] / double(C);
    for (int c = 0; c < C; c++) v += (x[n * C + c] - m) * (x[n * C + c] - m) / C;
    for (int c = 0; c < C; c++)
      EXPECT_NEAR(out[n * C + c], (x[n * C + c] - m) / std::sqrt(v + 1e-5) * w[c],
                  kAtol + kRtol * std::abs(out[n * C + c]));
  }
}

}  // namespace
}  // namespace trainer::test
