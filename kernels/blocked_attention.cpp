#include "kernels/blocked_attention.h"

#include <algorithm>
#include <cmath>

namespace trainer {

std::vector<QueryBlock> query_blocks(const AttentionShape& s) {
  std::vector<QueryBlock> blocks;
  for (int q0 = 0; q0 < s.T; q0 += s.block)
    blocks.push_back({q0, std::min(s.block, s.T - q0), s.group()});
  return blocks;
}

AttentionScratchSizes attention_scratch_sizes(const AttentionShape& s) {
  const int64_t widest = QueryBlock{0, s.T}.stride();
  return {s.elems(), s.kv_elems(), s.heads() * s.T, s.heads() * std::min(s.block, s.T) * widest};
}

namespace gemm_plan {
namespace {

// Operands of the head-major tensors: row-major (rows x hs) per batch entry is the column-major
// hs x rows, ld hs. Key/value side: T rows; query side: T * group rows, of which the block's
// start at row q0 * group.
GemmOperand kv_heads(DPtr x, const AttentionShape& sh) {
  return {x, sh.hs(), int64_t(sh.T) * sh.hs()};
}
GemmOperand query_heads(DPtr x, const AttentionShape& sh, QueryBlock blk) {
  return {x + int64_t(blk.q0) * blk.group * sh.hs(), sh.hs(), int64_t(sh.T) * sh.group() * sh.hs()};
}
// A block's (rows, L) row-major matrices: column-major L x rows, ld the block's stride.
GemmOperand rows(DPtr x, QueryBlock blk) {
  return {x, blk.stride(), int64_t(blk.rows()) * blk.stride()};
}
float scale(const AttentionShape& sh) {
  return float(1.0 / std::sqrt(double(sh.hs())));
}
GemmCall call(bool ta, bool tb, int m, int n, int k, float alpha, GemmOperand A, GemmOperand B,
              float beta, GemmOperand C, const AttentionShape& sh) {
  return {ta, tb, m, n, k, alpha, A, B, beta, C, int(sh.kv_heads()), {}, GemmEpilogue::none, {}};
}

}  // namespace

GemmCall block_scores(DPtr s, DPtr q, DPtr k, QueryBlock blk, const AttentionShape& sh) {
  // s^T (L x rows) = K (stored hs x L, transposed) Q_blk^T (hs x rows)
  return call(true, false, blk.keys(), blk.rows(), sh.hs(), scale(sh), kv_heads(k, sh),
              query_heads(q, sh, blk), 0.0f, rows(s, blk), sh);
}

GemmCall block_output(DPtr o, DPtr p, DPtr v, QueryBlock blk, const AttentionShape& sh) {
  // o_blk^T (hs x rows) = V^T (hs x L) P^T (stored L x rows)
  return call(false, false, sh.hs(), blk.rows(), blk.keys(), 1.0f, kv_heads(v, sh), rows(p, blk),
              0.0f, query_heads(o, sh, blk), sh);
}

GemmCall block_backward_values(DPtr dv, DPtr p, DPtr dout, QueryBlock blk,
                               const AttentionShape& sh) {
  // dV^T (hs x L) += dO_blk^T (hs x rows) P (stored as P^T, transposed): summed over the group
  return call(false, true, sh.hs(), blk.keys(), blk.rows(), 1.0f, query_heads(dout, sh, blk),
              rows(p, blk), 1.0f, kv_heads(dv, sh), sh);
}

GemmCall block_backward_probs(DPtr dp, DPtr dout, DPtr v, QueryBlock blk,
                              const AttentionShape& sh) {
  // dP^T (L x rows) = V (stored hs x L, transposed) dO_blk^T (hs x rows)
  return call(true, false, blk.keys(), blk.rows(), sh.hs(), 1.0f, kv_heads(v, sh),
              query_heads(dout, sh, blk), 0.0f, rows(dp, blk), sh);
}

GemmCall block_backward_queries(DPtr dq, DPtr ds, DPtr k, QueryBlock blk,
                                const AttentionShape& sh) {
  // dQ_blk^T (hs x rows) = scale K^T (hs x L) dS^T (stored L x rows)
  return call(false, false, sh.hs(), blk.rows(), blk.keys(), scale(sh), kv_heads(k, sh),
              rows(ds, blk), 0.0f, query_heads(dq, sh, blk), sh);
}

GemmCall block_backward_keys(DPtr dk, DPtr ds, DPtr q, QueryBlock blk, const AttentionShape& sh) {
  // dK^T (hs x L) += scale Q_blk^T (hs x rows) dS (stored as dS^T, transposed): summed over the
  // group
  return call(false, true, sh.hs(), blk.keys(), blk.rows(), scale(sh), query_heads(q, sh, blk),
              rows(ds, blk), 1.0f, kv_heads(dk, sh), sh);
}

}  // namespace gemm_plan

namespace {

// Copies Q, K and V out of qkv into their head-major scratch.
void qkv_to_heads(AttentionSteps& x, const AttentionScratch& w, DPtr qkv, const AttentionShape& s) {
  x.to_heads(w.q, HeadSide::queries, qkv, s.width(), 0, s);
  x.to_heads(w.k, HeadSide::keys_values, qkv, s.width(), s.key_column(), s);
  x.to_heads(w.v, HeadSide::keys_values, qkv, s.width(), s.value_column(), s);
}

}  // namespace

void blocked_attention_forward(AttentionSteps& x, const AttentionScratch& w, DPtr out, DPtr lse,
                               DPtr qkv, const AttentionShape& s) {
  qkv_to_heads(x, w, qkv, s);
  for (QueryBlock blk : query_blocks(s)) {
    x.gemm(gemm_plan::block_scores(w.s, w.q, w.k, blk, s));
    x.softmax_rows(w.p, lse, w.s, blk, s);
    x.gemm(gemm_plan::block_output(w.o, w.p, w.v, blk, s));
  }
  x.from_heads(out, s.C, 0, w.o, HeadSide::queries, s);
}

void blocked_attention_backward(AttentionSteps& x, const AttentionScratch& w, DPtr dqkv, DPtr dout,
                                DPtr qkv, DPtr out, DPtr lse, const AttentionShape& s) {
  qkv_to_heads(x, w, qkv, s);
  x.to_heads(w.o, HeadSide::queries, dout, s.C, 0, s);
  x.row_dots(w.d, dout, out, s);
  x.zero(w.dk, s.kv_elems());
  x.zero(w.dv, s.kv_elems());
  for (QueryBlock blk : query_blocks(s)) {
    x.gemm(gemm_plan::block_scores(w.s, w.q, w.k, blk, s));
    x.probs_rows(w.p, w.s, lse, blk, s);
    x.gemm(gemm_plan::block_backward_values(w.dv, w.p, w.o, blk, s));
    x.gemm(gemm_plan::block_backward_probs(w.s, w.o, w.v, blk, s));  // dP over the scores
    x.dsoftmax_rows(w.p, w.s, w.d, blk, s);                          // dS over P
    x.gemm(gemm_plan::block_backward_queries(w.dq, w.p, w.k, blk, s));
    x.gemm(gemm_plan::block_backward_keys(w.dk, w.p, w.q, blk, s));
  }
  x.from_heads(dqkv, s.width(), 0, w.dq, HeadSide::queries, s);
  x.from_heads(dqkv, s.width(), s.key_column(), w.dk, HeadSide::keys_values, s);
  x.from_heads(dqkv, s.width(), s.value_column(), w.dv, HeadSide::keys_values, s);
}

}  // namespace trainer
