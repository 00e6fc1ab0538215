#include "kernels/blocked_attention.h"

#include <algorithm>
#include <cmath>

namespace trainer {

std::vector<QueryBlock> query_blocks(const AttentionShape& s) {
  std::vector<QueryBlock> blocks;
  for (int q0 = 0; q0 < s.T; q0 += s.block) blocks.push_back({q0, std::min(s.block, s.T - q0)});
  return blocks;
}

AttentionScratchSizes attention_scratch_sizes(const AttentionShape& s) {
  const int64_t widest = QueryBlock{0, s.T}.stride();
  return {s.elems(), s.heads() * s.T, s.heads() * std::min(s.block, s.T) * widest};
}

namespace gemm_plan {
namespace {

// Operands of the head-major (B, NH, T, hs) tensors: row-major T x hs per batch entry is the
// column-major hs x T, ld hs; `row` picks the first row.
GemmOperand heads(DPtr x, const AttentionShape& sh, int row = 0) {
  return {x + int64_t(row) * sh.hs(), sh.hs(), int64_t(sh.T) * sh.hs()};
}
// A block's (nq, L) row-major matrices: column-major L x nq, ld the block's stride.
GemmOperand rows(DPtr x, QueryBlock blk) {
  return {x, blk.stride(), int64_t(blk.nq) * blk.stride()};
}
float scale(const AttentionShape& sh) {
  return float(1.0 / std::sqrt(double(sh.hs())));
}
GemmCall call(bool ta, bool tb, int m, int n, int k, float alpha, GemmOperand A, GemmOperand B,
              float beta, GemmOperand C, const AttentionShape& sh) {
  return {ta, tb, m, n, k, alpha, A, B, beta, C, int(sh.heads()), {}, GemmEpilogue::none, {}};
}

}  // namespace

GemmCall block_scores(DPtr s, DPtr q, DPtr k, QueryBlock blk, const AttentionShape& sh) {
  // s^T (L x nq) = K (stored hs x L, transposed) Q_blk^T (hs x nq)
  return call(true, false, blk.keys(), blk.nq, sh.hs(), scale(sh), heads(k, sh),
              heads(q, sh, blk.q0), 0.0f, rows(s, blk), sh);
}

GemmCall block_output(DPtr o, DPtr p, DPtr v, QueryBlock blk, const AttentionShape& sh) {
  // o_blk^T (hs x nq) = V^T (hs x L) P^T (stored L x nq)
  return call(false, false, sh.hs(), blk.nq, blk.keys(), 1.0f, heads(v, sh), rows(p, blk), 0.0f,
              heads(o, sh, blk.q0), sh);
}

GemmCall block_backward_values(DPtr dv, DPtr p, DPtr dout, QueryBlock blk,
                               const AttentionShape& sh) {
  // dV^T (hs x L) += dO_blk^T (hs x nq) P (stored as P^T, transposed)
  return call(false, true, sh.hs(), blk.keys(), blk.nq, 1.0f, heads(dout, sh, blk.q0), rows(p, blk),
              1.0f, heads(dv, sh), sh);
}

GemmCall block_backward_probs(DPtr dp, DPtr dout, DPtr v, QueryBlock blk,
                              const AttentionShape& sh) {
  // dP^T (L x nq) = V (stored hs x L, transposed) dO_blk^T (hs x nq)
  return call(true, false, blk.keys(), blk.nq, sh.hs(), 1.0f, heads(v, sh), heads(dout, sh, blk.q0),
              0.0f, rows(dp, blk), sh);
}

GemmCall block_backward_queries(DPtr dq, DPtr ds, DPtr k, QueryBlock blk,
                                const AttentionShape& sh) {
  // dQ_blk^T (hs x nq) = scale K^T (hs x L) dS^T (stored L x nq)
  return call(false, false, sh.hs(), blk.nq, blk.keys(), scale(sh), heads(k, sh), rows(ds, blk),
              0.0f, heads(dq, sh, blk.q0), sh);
}

GemmCall block_backward_keys(DPtr dk, DPtr ds, DPtr q, QueryBlock blk, const AttentionShape& sh) {
  // dK^T (hs x L) += scale Q_blk^T (hs x nq) dS (stored as dS^T, transposed)
  return call(false, true, sh.hs(), blk.keys(), blk.nq, scale(sh), heads(q, sh, blk.q0),
              rows(ds, blk), 1.0f, heads(dk, sh), sh);
}

}  // namespace gemm_plan

void blocked_attention_forward(AttentionSteps& x, const AttentionScratch& w, DPtr out, DPtr lse,
                               DPtr qkv, const AttentionShape& s) {
  const int64_t width = 3 * int64_t(s.C);
  x.to_heads(w.q, qkv, width, 0, s);
  x.to_heads(w.k, qkv, width, s.C, s);
  x.to_heads(w.v, qkv, width, 2 * s.C, s);
  for (QueryBlock blk : query_blocks(s)) {
    x.gemm(gemm_plan::block_scores(w.s, w.q, w.k, blk, s));
    x.softmax_rows(w.p, lse, w.s, blk, s);
    x.gemm(gemm_plan::block_output(w.o, w.p, w.v, blk, s));
  }
  x.from_heads(out, s.C, 0, w.o, s);
}

void blocked_attention_backward(AttentionSteps& x, const AttentionScratch& w, DPtr dqkv, DPtr dout,
                                DPtr qkv, DPtr out, DPtr lse, const AttentionShape& s) {
  const int64_t width = 3 * int64_t(s.C);
  x.to_heads(w.q, qkv, width, 0, s);
  x.to_heads(w.k, qkv, width, s.C, s);
  x.to_heads(w.v, qkv, width, 2 * s.C, s);
  x.to_heads(w.o, dout, s.C, 0, s);
  x.row_dots(w.d, dout, out, s);
  x.zero(w.dk, s.elems());
  x.zero(w.dv, s.elems());
  for (QueryBlock blk : query_blocks(s)) {
    x.gemm(gemm_plan::block_scores(w.s, w.q, w.k, blk, s));
    x.probs_rows(w.p, w.s, lse, blk, s);
    x.gemm(gemm_plan::block_backward_values(w.dv, w.p, w.o, blk, s));
    x.gemm(gemm_plan::block_backward_probs(w.s, w.o, w.v, blk, s));  // dP over the scores
    x.dsoftmax_rows(w.p, w.s, w.d, blk, s);                          // dS over P
    x.gemm(gemm_plan::block_backward_queries(w.dq, w.p, w.k, blk, s));
    x.gemm(gemm_plan::block_backward_keys(w.dk, w.p, w.q, blk, s));
  }
  x.from_heads(dqkv, width, 0, w.dq, s);
  x.from_heads(dqkv, width, s.C, w.dk, s);
  x.from_heads(dqkv, width, 2 * s.C, w.dv, s);
}

}  // namespace trainer
