// The GPU backend's matrix products (kernels/gemm_plan.h: transposes, leading dimensions, batch
// strides of each column-major cuBLASLt call) executed here by a naive column-major GEMM in
// double, against the CPU backend's linear layer and attention: the index arithmetic the GPU
// relies on, checked without a GPU. Double precision throughout: agreement to 1e-12.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

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

void run_naive(const std::vector<GemmCall>& calls) {
  for (const GemmCall& c : calls) run_naive(c);
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
                                                  host_ptr(w2.data()), host_ptr(pre.data()), N,
                                                  OC, IC));
  DPtr pre_ref = d.upload(std::vector<double>(N * OC)), act_ref = d.upload(std::vector<double>(N * OC));
  DPtr dact_ref = d.upload(std::vector<double>(N * OC)), dw2 = d.upload(std::vector<double>(IC * OC));
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
  d.k->matmul_backward_gelu(dpre2, dw2b, DPtr{}, d.upload(dy), act2, d.upload(w2), pre2, N, OC,
                            IC);
  EXPECT_TRUE(test::all_close(act, d.download<double>(act2, N * OC), kTol, kTol));
  EXPECT_TRUE(test::all_close(dpre, d.download<double>(dpre2, N * OC), kTol, kTol));
  EXPECT_TRUE(test::all_close(d.download<double>(dw2, IC * OC), d.download<double>(dw2b, IC * OC),
                              kTol, kTol));
}

// The causal softmax and its backward, as the GPU's kernels compute them (row r is query r % T).
void causal_softmax(std::vector<double>& att, int64_t rows, int T) {
  for (int64_t r = 0; r < rows; r++) {
    double* a = att.data() + r * T;
    const int i = int(r % T);
    double mx = a[0], sum = 0;
    for (int j = 0; j <= i; j++) mx = std::max(mx, a[j]);
    for (int j = 0; j <= i; j++) sum += std::exp(a[j] - mx);
    for (int j = 0; j < T; j++) a[j] = j <= i ? std::exp(a[j] - mx) / sum : 0.0;
  }
}
void causal_softmax_backward(std::vector<double>& datt, const std::vector<double>& att,
                             int64_t rows, int T) {
  for (int64_t r = 0; r < rows; r++) {
    const double* p = att.data() + r * T;
    double* d = datt.data() + r * T;
    const int i = int(r % T);
    double dot = 0;
    for (int j = 0; j <= i; j++) dot += p[j] * d[j];
    for (int j = 0; j < T; j++) d[j] = j <= i ? p[j] * (d[j] - dot) : 0.0;
  }
}

TEST(GemmPlan, AttentionForwardAndBackwardAreTheCpuBackends) {
  test::Device d;
  const int B = 3, T = 6, C = 12, NH = 3;
  const int64_t BT = int64_t(B) * T, rows = int64_t(B) * NH * T, att_n = rows * T;
  auto qkv = random(BT * 3 * C, 1), dout = random(BT * C, 2);
  std::vector<double> out(BT * C), att(att_n), dqkv(BT * 3 * C, 99.0), datt(att_n);
  run_naive(gemm_plan::attention_scores(host_ptr(att.data()), host_ptr(qkv.data()), B, T, C, NH));
  causal_softmax(att, rows, T);
  run_naive(gemm_plan::attention_output(host_ptr(out.data()), host_ptr(att.data()),
                                        host_ptr(qkv.data()), B, T, C, NH));
  run_naive(gemm_plan::attention_backward_values(host_ptr(dqkv.data()), host_ptr(datt.data()),
                                                 host_ptr(dout.data()), host_ptr(qkv.data()),
                                                 host_ptr(att.data()), B, T, C, NH));
  causal_softmax_backward(datt, att, rows, T);
  run_naive(gemm_plan::attention_backward_queries_keys(host_ptr(dqkv.data()), host_ptr(datt.data()),
                                                       host_ptr(qkv.data()), B, T, C, NH));

  DPtr out_ref = d.upload(std::vector<double>(BT * C)),
       att_ref = d.upload(std::vector<double>(att_n));
  DPtr dqkv_ref = d.upload(std::vector<double>(BT * 3 * C)),
       scratch = d.upload(std::vector<double>(att_n));
  DPtr qkv_d = d.upload(qkv);
  d.k->attention_forward(out_ref, att_ref, qkv_d, B, T, C, NH);
  d.k->attention_backward(dqkv_ref, scratch, d.upload(dout), qkv_d, att_ref, B, T, C, NH);
  EXPECT_TRUE(test::all_close(att, d.download<double>(att_ref, att_n), kTol, kTol));
  EXPECT_TRUE(test::all_close(out, d.download<double>(out_ref, BT * C), kTol, kTol));
  // Every element of dqkv written (it started at 99): dQ, dK and dV all equal the CPU's.
  EXPECT_TRUE(test::all_close(dqkv, d.download<double>(dqkv_ref, BT * 3 * C), kTol, kTol));
}

}  // namespace
}  // namespace trainer
