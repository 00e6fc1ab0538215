#include "kernels/gemm_plan.h"

#include <cmath>

namespace trainer::gemm_plan {
namespace {

GemmCall gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, GemmOperand A,
              GemmOperand B, float beta, GemmOperand C, int batch = 1, DPtr bias = {}) {
  return {trans_a, trans_b, m, n, k, alpha, A, B, beta, C, batch, bias, GemmEpilogue::none, {}};
}

struct Heads {
  int hs, C3;
  int64_t TT;
  float scale;
};
Heads heads(int T, int C, int NH) {
  const int hs = C / NH;
  return {hs, 3 * C, int64_t(T) * T, 1.0f / std::sqrt(float(hs))};
}

}  // namespace

GemmCall linear_forward(DPtr out, DPtr inp, DPtr weight, DPtr bias, int N, int IC, int OC) {
  // out^T (OC x N) = W (stored IC x OC, transposed) inp^T (IC x N)
  return gemm(true, false, OC, N, IC, 1.0f, {weight, IC}, {inp, IC}, 0.0f, {out, OC}, 1, bias);
}

GemmCall linear_backward_input(DPtr dinp, DPtr dout, DPtr weight, int N, int IC, int OC) {
  // dinp^T (IC x N) = W^T (stored IC x OC) dout^T (OC x N)
  return gemm(false, false, IC, N, OC, 1.0f, {weight, IC}, {dout, OC}, 0.0f, {dinp, IC});
}

GemmCall linear_gelu_forward(DPtr pre, DPtr out, DPtr inp, DPtr weight, DPtr bias, int N, int IC,
                             int OC) {
  GemmCall c = linear_forward(out, inp, weight, bias, N, IC, OC);
  c.epilogue = GemmEpilogue::gelu;
  c.aux = {pre, OC};  // pre^T (OC x N), laid out as out^T
  return c;
}

GemmCall linear_backward_input_gelu(DPtr dinp, DPtr dout, DPtr weight, DPtr pre, int N, int IC,
                                    int OC) {
  GemmCall c = linear_backward_input(dinp, dout, weight, N, IC, OC);
  c.epilogue = GemmEpilogue::dgelu;
  c.aux = {pre, IC};  // pre^T (IC x N), laid out as dinp^T
  return c;
}

GemmCall linear_backward_weight(DPtr dweight, DPtr dout, DPtr inp, int N, int IC, int OC) {
  // dW^T (IC x OC) += inp^T (IC x N) dout (stored OC x N, transposed)
  return gemm(false, true, IC, OC, N, 1.0f, {inp, IC}, {dout, OC}, 1.0f, {dweight, IC});
}

std::vector<GemmCall> attention_scores(DPtr att, DPtr qkv, int B, int T, int C, int NH) {
  const Heads h = heads(T, C, NH);
  std::vector<GemmCall> calls;
  for (int b = 0; b < B; b++) {
    const DPtr Q = qkv + int64_t(b) * T * h.C3, K = Q + C, S = att + int64_t(b) * NH * h.TT;
    // S^T (T x T) = K (stored hs x T, transposed) Q^T (hs x T): row-major S[i][j] = scale q_i.k_j
    calls.push_back(gemm(true, false, T, T, h.hs, h.scale, {K, h.C3, h.hs}, {Q, h.C3, h.hs}, 0.0f,
                         {S, T, h.TT}, NH));
  }
  return calls;
}

std::vector<GemmCall> attention_output(DPtr out, DPtr att, DPtr qkv, int B, int T, int C, int NH) {
  const Heads h = heads(T, C, NH);
  std::vector<GemmCall> calls;
  for (int b = 0; b < B; b++) {
    const DPtr V = qkv + int64_t(b) * T * h.C3 + 2 * C, P = att + int64_t(b) * NH * h.TT;
    const DPtr O = out + int64_t(b) * T * C;
    // out^T (hs x T) = V^T (hs x T) P^T (T x T)
    calls.push_back(gemm(false, false, h.hs, T, T, 1.0f, {V, h.C3, h.hs}, {P, T, h.TT}, 0.0f,
                         {O, C, h.hs}, NH));
  }
  return calls;
}

std::vector<GemmCall> attention_backward_values(DPtr dqkv, DPtr datt, DPtr dout, DPtr qkv, DPtr att,
                                                int B, int T, int C, int NH) {
  const Heads h = heads(T, C, NH);
  std::vector<GemmCall> calls;
  for (int b = 0; b < B; b++) {
    const DPtr V = qkv + int64_t(b) * T * h.C3 + 2 * C, dV = dqkv + int64_t(b) * T * h.C3 + 2 * C;
    const DPtr dO = dout + int64_t(b) * T * C, P = att + int64_t(b) * NH * h.TT,
               dP = datt + int64_t(b) * NH * h.TT;
    // dP^T (T x T) = V (stored hs x T, transposed) dO^T (hs x T): row-major dP = dO V^T
    calls.push_back(gemm(true, false, T, T, h.hs, 1.0f, {V, h.C3, h.hs}, {dO, C, h.hs}, 0.0f,
                         {dP, T, h.TT}, NH));
    // dV^T (hs x T) = dO^T (hs x T) P (stored as P^T, transposed): row-major dV = P^T dO
    calls.push_back(gemm(false, true, h.hs, T, T, 1.0f, {dO, C, h.hs}, {P, T, h.TT}, 0.0f,
                         {dV, h.C3, h.hs}, NH));
  }
  return calls;
}

std::vector<GemmCall> attention_backward_queries_keys(DPtr dqkv, DPtr datt, DPtr qkv, int B, int T,
                                                      int C, int NH) {
  const Heads h = heads(T, C, NH);
  std::vector<GemmCall> calls;
  for (int b = 0; b < B; b++) {
    const DPtr Q = qkv + int64_t(b) * T * h.C3, K = Q + C;
    const DPtr dQ = dqkv + int64_t(b) * T * h.C3, dK = dQ + C, dS = datt + int64_t(b) * NH * h.TT;
    // dQ^T (hs x T) = scale K^T (hs x T) dS^T (stored T x T): row-major dQ = scale dS K
    calls.push_back(gemm(false, false, h.hs, T, T, h.scale, {K, h.C3, h.hs}, {dS, T, h.TT}, 0.0f,
                         {dQ, h.C3, h.hs}, NH));
    // dK^T (hs x T) = scale Q^T (hs x T) dS (stored as dS^T, transposed): dK = scale dS^T Q
    calls.push_back(gemm(false, true, h.hs, T, T, h.scale, {Q, h.C3, h.hs}, {dS, T, h.TT}, 0.0f,
                         {dK, h.C3, h.hs}, NH));
  }
  return calls;
}

}  // namespace trainer::gemm_plan
