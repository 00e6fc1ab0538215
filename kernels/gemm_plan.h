#pragma once
// The matrix products of the GPU backend as data: which column-major GEMM (cuBLAS's view) each
// row-major product of the model is, with transposes, leading dimensions and batch strides.
// Host-only, so that the CPU tests can execute every plan with a naive column-major GEMM and
// compare it with the CPU backend: the index arithmetic the GPU relies on is tested without one.
//
// A call means, for b in [0, batch):
//   Z_b(m, n) = alpha * op(A_b) op(B_b) + beta * C_b   [+ bias(m) added to every column]
// and then, by its epilogue:
//   none:  C_b = Z_b
//   gelu:  aux = Z_b (the pre-activation, kept for backward), C_b = gelu(Z_b)
//   dgelu: C_b = gelu'(aux) * Z_b (the GELU's backward applied to a product; aux is read)
// with aux(m, n) stored like C (element (r, c) at r + c * aux.ld; batch 1).
// where X_b starts `stride` elements after X_(b-1), element (r, c) of a stored matrix is at
// r + c * ld, and op(X) is X or its transpose. A row-major X (r x c, row stride ld) is the
// column-major X^T (c x r) with the same ld.
#include <cstdint>
#include <vector>

#include "kernels/dtype.h"

namespace trainer {

struct GemmOperand {
  DPtr p;
  int ld;              // leading dimension (elements)
  int64_t stride = 0;  // between batch entries (elements)
};

enum class GemmEpilogue { none, gelu, dgelu };

struct GemmCall {
  bool trans_a, trans_b;
  int m, n, k;
  float alpha;
  GemmOperand A, B;
  float beta;
  GemmOperand C;
  int batch = 1;
  DPtr bias;  // length m, or null
  GemmEpilogue epilogue = GemmEpilogue::none;
  GemmOperand aux = {};
};

namespace gemm_plan {

// out(N, OC) = inp(N, IC) @ weight(OC, IC)^T + bias
GemmCall linear_forward(DPtr out, DPtr inp, DPtr weight, DPtr bias, int N, int IC, int OC);
// dinp(N, IC) = dout(N, OC) @ weight(OC, IC)
GemmCall linear_backward_input(DPtr dinp, DPtr dout, DPtr weight, int N, int IC, int OC);
// The GELU that follows a linear layer fused into its GEMMs: pre(N, OC) = inp @ weight^T + bias,
// out = gelu(pre); and, for the layer after it (whose input was gelu(pre)), dinp = gelu'(pre) *
// (dout @ weight) with pre(N, IC).
GemmCall linear_gelu_forward(DPtr pre, DPtr out, DPtr inp, DPtr weight, DPtr bias, int N, int IC,
                             int OC);
GemmCall linear_backward_input_gelu(DPtr dinp, DPtr dout, DPtr weight, DPtr pre, int N, int IC,
                                    int OC);
// dweight(OC, IC) += dout(N, OC)^T @ inp(N, IC)
GemmCall linear_backward_weight(DPtr dweight, DPtr dout, DPtr inp, int N, int IC, int OC);

}  // namespace gemm_plan
}  // namespace trainer
