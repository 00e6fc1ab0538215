#include "kernels/gemm_plan.h"

namespace trainer::gemm_plan {
namespace {

GemmCall gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, GemmOperand A,
              GemmOperand B, float beta, GemmOperand C, int batch = 1, DPtr bias = {}) {
  return {trans_a, trans_b, m, n, k, alpha, A, B, beta, C, batch, bias, GemmEpilogue::none, {}};
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

}  // namespace trainer::gemm_plan
