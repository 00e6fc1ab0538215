// The GPU backend's matrix products (kernels/gemm_plan.h: transposes, leading dimensions, batch
// strides of each column-major cuBLASLt call) executed here by a naive column-major GEMM in
// double, against the CPU backend's linear layer and attention: the index arithmetic the GPU
// relies on, checked without a GPU. Double precision throughout: agreement to 1e-12.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/blocked_attention.h"
#include "kernels/gemm_plan.h"
#include "kernels/shared_math.h"
#include "test_util.h"

namespace trainer {
namespace {

constexpr double kTol = 1e-12;

// C_b = alpha op(A_b) op(B_b) + beta C_b (+ bias), element (r, c) of a stored matrix at r + c ld,
// then the epilogue on it (with the aux matrix, stored like C).
void run_naive(const GemmCall& g) {
  for (int b = 0; b < g.batch; b++) {
    const double* A = g.A.p.as<double>() + b * g.A.stride;
    const double* B = g.B.p.as<double>() + b * g.B.stride;
    double* C = g.C.p.as<double>() + b * g.C.stride;
    for (int i = 0; i < g.m; i++)
      for (int j = 0; j < g.n; j++) {
        double acc = 0;
        for (int l = 0; l < g.k; l++) {
          const double a = g.trans_a ? A[l + int64_t(i) * g.A.ld] : A[i + int64_t(l) * g.A.ld];
          const double x = g.trans_b ? B[j + int64_t(l) * g.B.ld] : B[l + int64_t(j) * g.B.ld];
          acc += a * x;
        }
        double& c = C[i + int64_t(j) * g.C.ld];
        const double z = g.alpha * acc + (g.beta != 0 ? g.beta * c : 0.0) +
                         (g.bias ? g.bias.as<double>()[i] : 0.0);
        double* aux = g.aux.p ? g.aux.p.as<double>() + i + int64_t(j) * g.aux.ld : nullptr;
        switch (g.epilogue) {
          case GemmEpilogue::none:
            c = z;
            break;
          case GemmEpilogue::gelu:
            *aux = z;
            c = gelu_from_tanh(z, std::tanh(gelu_tanh_arg(z)));
            break;
          case GemmEpilogue::dgelu:
            c = gelu_grad_from_tanh(*aux, std::tanh(gelu_tanh_arg(*aux))) * z;
            break;
        }
      }
  }
}

std::vector<double> random(size_t n, uint64_t seed) {
  return test::random_vector<double>(n, seed);
}

TEST(GemmPlan, LinearForwardAndBackwardAreTheCpuBackends) {
  test::Device d;
  const int N = 7, IC = 5, OC = 6;
  auto x = random(N * IC, 1), w = random(OC * IC, 2), bias = random(OC, 3), dy = random(N * OC, 4);
  auto dw0 = random(OC * IC, 5);
  std::vector<double> y(N * OC), dx(N * IC), dw = dw0;
  run_naive(gemm_plan::linear_forward(host_ptr(y.data()), host_ptr(x.data()), host_ptr(w.data()),
                                      host_ptr(bias.data()), N, IC, OC));
  run_naive(gemm_plan::linear_backward_input(host_ptr(dx.data()), host_ptr(dy.data()),
                                             host_ptr(w.data()), N, IC, OC));
  run_naive(gemm_plan::linear_backward_weight(host_ptr(dw.data()), host_ptr(dy.data()),
                                              host_ptr(x.data()), N, IC, OC));
  DPtr y_ref = d.upload(std::vector<double>(N * OC)),
       dx_ref = d.upload(std::vector<double>(N * IC));
  DPtr dw_ref = d.upload(dw0), db_ref = d.upload(std::vector<double>(OC));
  d.k->matmul_forward(y_ref, d.upload(x), d.upload(w), d.upload(bias), N, IC, OC);
  d.k->matmul_backward(dx_ref, dw_ref, db_ref, d.upload(dy), d.upload(x), d.upload(w), N, IC, OC);
  EXPECT_TRUE(test::all_close(y, d.download<double>(y_ref, N * OC), kTol, kTol));
  EXPECT_TRUE(test::all_close(dx, d.download<double>(dx_ref, N * IC), kTol, kTol));
  EXPECT_TRUE(test::all_close(dw, d.download<double>(dw_ref, OC * IC), kTol, kTol));  // += kept
}

// The MLP's fused pair: fc with its GELU, and fcproj's input gradient through that GELU.
TEST(GemmPlan, LinearWithGeluEpiloguesAreTheCpusLinearAndGelu) {
  test::Device d;
  const int N = 5, IC = 4, OC = 8;  // fc: IC -> OC, then fcproj: OC -> IC
  auto x = random(N * IC, 1), w = random(OC * IC, 2), bias = random(OC, 3), dy = random(N * IC, 4);
  auto w2 = random(IC * OC, 5);
  std::vector<double> pre(N * OC), act(N * OC), dpre(N * OC);
  run_naive(gemm_plan::linear_gelu_forward(host_ptr(pre.data()), host_ptr(act.data()),
                                           host_ptr(x.data()), host_ptr(w.data()),
                                           host_ptr(bias.data()), N, IC, OC));
  run_naive(gemm_plan::linear_backward_input_gelu(host_ptr(dpre.data()), host_ptr(dy.data()),
                                                  host_ptr(w2.data()), host_ptr(pre.data()), N, OC,
                                                  IC));
  DPtr pre_ref = d.upload(std::vector<double>(N * OC)),
       act_ref = d.upload(std::vector<double>(N * OC));
  DPtr dact_ref = d.upload(std::vector<double>(N * OC)),
       dw2 = d.upload(std::vector<double>(IC * OC));
  d.k->matmul_forward(pre_ref, d.upload(x), d.upload(w), d.upload(bias), N, IC, OC);
  d.k->gelu_forward(act_ref, pre_ref, N * OC);
  d.k->matmul_backward(dact_ref, dw2, DPtr{}, d.upload(dy), act_ref, d.upload(w2), N, OC, IC);
  d.k->gelu_backward(dact_ref, pre_ref, dact_ref, N * OC);
  EXPECT_TRUE(test::all_close(pre, d.download<double>(pre_ref, N * OC), kTol, kTol));
  EXPECT_TRUE(test::all_close(act, d.download<double>(act_ref, N * OC), kTol, kTol));
  EXPECT_TRUE(test::all_close(dpre, d.download<double>(dact_ref, N * OC), kTol, kTol));
  // The default (unfused) Kernels calls the model makes compute the same.
  DPtr pre2 = d.upload(std::vector<double>(N * OC)), act2 = d.upload(std::vector<double>(N * OC));
  DPtr dpre2 = d.upload(std::vector<double>(N * OC)), dw2b = d.upload(std::vector<double>(IC * OC));
  d.k->matmul_gelu_forward(pre2, act2, d.upload(x), d.upload(w), d.upload(bias), N, IC, OC);
  d.k->matmul_backward_gelu(dpre2, dw2b, DPtr{}, d.upload(dy), act2, d.upload(w2), pre2, N, OC, IC);
  EXPECT_TRUE(test::all_close(act, d.download<double>(act2, N * OC), kTol, kTol));
  EXPECT_TRUE(test::all_close(dpre, d.download<double>(dpre2, N * OC), kTol, kTol));
  EXPECT_TRUE(test::all_close(d.download<double>(dw2, IC * OC), d.download<double>(dw2b, IC * OC),
                              kTol, kTol));
}

// The blocked attention's steps on the CPU, in double, each as its comment in
// kernels/blocked_attention.h says (the GPU runs the same sequence of calls and GEMM plans).
class NaiveAttentionSteps final : public AttentionSteps {
 public:
  void gemm(const GemmCall& c) override {
    run_naive(c);
    gemms++;
  }
  // Head-major element e's place in the token-major tensor.
  static int64_t token_major(int64_t e, HeadSide side, int64_t width, int64_t column0,
                             const AttentionShape& s) {
    const int group = side == HeadSide::queries ? s.group() : 1;
    return token_major_index(e, s.T, s.hs(), s.NKV, group, width, column0);
  }
  static int64_t elems(HeadSide side, const AttentionShape& s) {
    return side == HeadSide::queries ? s.elems() : s.kv_elems();
  }
  void to_heads(DPtr dst, HeadSide side, DPtr src, int64_t width, int64_t column0,
                const AttentionShape& s) override {
    for (int64_t e = 0; e < elems(side, s); e++)
      dst.as<double>()[e] = src.as<double>()[token_major(e, side, width, column0, s)];
  }
  void from_heads(DPtr dst, int64_t width, int64_t column0, DPtr src, HeadSide side,
                  const AttentionShape& s) override {
    for (int64_t e = 0; e < elems(side, s); e++)
      dst.as<double>()[token_major(e, side, width, column0, s)] = src.as<double>()[e];
  }
  template <class F>
  void each_row(QueryBlock blk, const AttentionShape& sh, F&& f) {
    for (int64_t r = 0; r < sh.heads() * blk.nq; r++)
      f(r * blk.stride(), head_of_row(r, blk) * sh.T + query_of_row(r, blk), query_of_row(r, blk));
  }
  void softmax_rows(DPtr p, DPtr lse, DPtr s, QueryBlock blk, const AttentionShape& sh) override {
    each_row(blk, sh, [&](int64_t at, int64_t stat, int i) {
      const double* x = s.as<double>() + at;
      const double m = *std::max_element(x, x + i + 1);
      double sum = 0;
      for (int j = 0; j <= i; j++) sum += std::exp(x[j] - m);
      lse.as<double>()[stat] = m + std::log(sum);
    });
    probs_rows(p, s, lse, blk, sh);
  }
  void probs_rows(DPtr p, DPtr s, DPtr lse, QueryBlock blk, const AttentionShape& sh) override {
    each_row(blk, sh, [&](int64_t at, int64_t stat, int i) {
      for (int j = 0; j < blk.keys(); j++)
        p.as<double>()[at + j] =
            j <= i ? std::exp(s.as<double>()[at + j] - lse.as<double>()[stat]) : 0.0;
    });
  }
  void dsoftmax_rows(DPtr p, DPtr dp, DPtr D, QueryBlock blk, const AttentionShape& sh) override {
    each_row(blk, sh, [&](int64_t at, int64_t stat, int i) {
      for (int j = 0; j < blk.keys(); j++) {
        double& x = p.as<double>()[at + j];
        x = j <= i ? x * (dp.as<double>()[at + j] - D.as<double>()[stat]) : 0.0;
      }
    });
  }
  void row_dots(DPtr D, DPtr dout, DPtr out, const AttentionShape& s) override {
    for (int64_t r = 0; r < s.heads() * s.T; r++) {
      double sum = 0;
      for (int d = 0; d < s.hs(); d++) {
        const int64_t at = token_major_index(r * s.hs() + d, s.T, s.hs(), s.NH, 1, s.C, 0);
        sum += dout.as<double>()[at] * out.as<double>()[at];
      }
      D.as<double>()[r] = sum;
    }
  }
  void zero(DPtr p, int64_t n) override { std::fill_n(p.as<double>(), n, 0.0); }
  int gemms = 0;
};

// Blocks of 4 over T = 10 (the last one short) and one block over all of T: the CPU backend's
// attention (its own blocks and tiles) to 1e-12, forward (output and log-sum-exps) and backward;
// multi-head (NKV = NH), grouped (NKV = NH / 2, NH / 3) and multi-query (NKV = 1) over NH = 6.
TEST(GemmPlan, BlockedAttentionIsTheCpusAttention) {
  test::Device d;
  // hs = 4: the GEMMs' fp32 alpha, 1/sqrt(hs), is exact, as 1e-12 needs.
  const int B = 2, T = 10, C = 24, NH = 6, hs = C / NH;
  const int64_t BT = int64_t(B) * T;
  for (int NKV : {NH, NH / 2, NH / 3, 1}) {
    const int64_t width = C + 2 * int64_t(NKV) * hs;
    auto qkv = random(BT * width, 1), dout = random(BT * C, 2);
    DPtr qkv_d = d.upload(qkv), dout_d = d.upload(dout);
    DPtr out_ref = d.upload(std::vector<double>(BT * C)),
         lse_ref = d.upload(std::vector<double>(BT * NH));
    DPtr dqkv_ref = d.upload(std::vector<double>(BT * width));
    d.k->attention_forward(out_ref, lse_ref, qkv_d, B, T, C, NH, NKV);
    d.k->attention_backward(dqkv_ref, dout_d, qkv_d, out_ref, lse_ref, B, T, C, NH, NKV);
    const auto expected_out = d.download<double>(out_ref, BT * C);
    const auto expected_lse = d.download<double>(lse_ref, BT * NH);
    const auto expected_dqkv = d.download<double>(dqkv_ref, BT * width);

    for (int block : {4, T, 128}) {
      SCOPED_TRACE(testing::Message() << "NKV " << NKV << ", block " << block);
      const AttentionShape shape{B, T, C, NH, NKV, block};
      const AttentionScratchSizes n = attention_scratch_sizes(shape);
      auto buf = [&](int64_t elems) { return d.upload(std::vector<double>(elems, 77.0)); };
      const AttentionScratch w{buf(n.head_major),    buf(n.kv_head_major), buf(n.kv_head_major),
                               buf(n.head_major),    buf(n.head_major),    buf(n.kv_head_major),
                               buf(n.kv_head_major), buf(n.block),         buf(n.block),
                               buf(n.rows)};
      DPtr out = buf(BT * C), lse = buf(n.rows), dqkv = buf(BT * width);
      NaiveAttentionSteps steps;
      blocked_attention_forward(steps, w, out, lse, qkv_d, shape);
      EXPECT_EQ(steps.gemms, 2 * int(query_blocks(shape).size()));
      blocked_attention_backward(steps, w, dqkv, dout_d, qkv_d, out, lse, shape);
      EXPECT_TRUE(test::all_close(expected_out, d.download<double>(out, BT * C), kTol, kTol));
      EXPECT_TRUE(test::all_close(expected_lse, d.download<double>(lse, n.rows), kTol, kTol));
      // Every element of dqkv written (the buffers started at 77).
      EXPECT_TRUE(test::all_close(expected_dqkv, d.download<double>(dqkv, BT * width), kTol, kTol));
      // The log-sum-exp of row (b, h, t) over the scores it sees, from scratch: query head h
      // against key head h / (NH / NKV).
      const std::vector<double> lse_host = d.download<double>(lse, n.rows);
      for (int64_t r = 0; r < n.rows; r += 7) {
        const int t = int(r % T), h = int(r / T % NH), b = int(r / T / NH);
        const int64_t key = C + int64_t(h / (NH / NKV)) * hs;
        double sum = 0;
        for (int j = 0; j <= t; j++) {
          double dot = 0;
          for (int e = 0; e < hs; e++)
            dot += qkv[(int64_t(b) * T + t) * width + h * hs + e] *
                   qkv[(int64_t(b) * T + j) * width + key + e];
          sum += std::exp(dot / std::sqrt(double(hs)));
        }
        EXPECT_NEAR(lse_host[size_t(r)], std::log(sum), kTol) << "row " << r;
      }
    }
  }
}

// The head-major index: with groups, query head k * group + g of token (b, t) sits at element
// (b, k, t, g, d); a group of one is the (B, NH, T, hs) layout.
TEST(GemmPlan, HeadMajorIndexPutsAGroupsQueryHeadsInAdjacentRows) {
  const int T = 3, hs = 2, NK = 2, group = 3, width = 20, column0 = 1;
  for (int b = 0; b < 2; b++)
    for (int k = 0; k < NK; k++)
      for (int t = 0; t < T; t++)
        for (int g = 0; g < group; g++)
          for (int e = 0; e < hs; e++) {
            const int64_t head_major = (((int64_t(b) * NK + k) * T + t) * group + g) * hs + e;
            EXPECT_EQ(token_major_index(head_major, T, hs, NK, group, width, column0),
                      (int64_t(b) * T + t) * width + column0 + (k * group + g) * hs + e);
            const int64_t mha = ((int64_t(b) * NK * group + k * group + g) * T + t) * hs + e;
            EXPECT_EQ(token_major_index(mha, T, hs, NK * group, 1, width, column0),
                      (int64_t(b) * T + t) * width + column0 + (k * group + g) * hs + e);
          }
}

}  // namespace
}  // namespace trainer
