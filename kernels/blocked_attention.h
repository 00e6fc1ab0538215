#pragma once
// Causal attention by blocks of queries, for the GPU: no T x T matrix is kept. Forward keeps
// each row's log-sum-exp (B, NH, T); backward recomputes each block's probabilities from it, as
// FlashAttention does, but the products are cuBLASLt GEMMs (tensor cores, kernels/gemm_plan.h)
// and the row work is small kernels, so every step is also run on the CPU in the tests
// (tests/test_blocked_attention.cpp) against the CPU backend's attention.
//
// Per query block [q0, q0 + nq), only keys [0, L = q0 + nq) are visible: the causal half of the
// products is never computed. Q, K, V, O and dO are first copied head-major, (B, NH, T, hs), so
// that one strided batch covers every sequence and head.
#include <cstdint>
#include <vector>

#include "kernels/gemm_plan.h"
#include "kernels/shared_math.h"

namespace trainer {

struct AttentionShape {
  int B, T, C, NH;
  int block = 128;  // queries per block: scratch grows with it, launches shrink
  int hs() const { return C / NH; }
  int64_t heads() const { return int64_t(B) * NH; }     // batch entries of every GEMM
  int64_t elems() const { return int64_t(B) * T * C; }  // one head-major copy
};

// One block of queries and the keys it sees.
struct QueryBlock {
  int q0, nq;
  TRAINER_HD int keys() const { return q0 + nq; }
  // The row stride of the block's (nq, keys) matrices: a multiple of 8, so that every row of a
  // 16-bit matrix starts 16-byte aligned (the fast GEMM kernels' need) whatever T is.
  TRAINER_HD int stride() const { return (keys() + 7) / 8 * 8; }
};
std::vector<QueryBlock> query_blocks(const AttentionShape& s);

// Where element (b, h, t, d) of a head-major tensor sits in a token-major (B, T, width) one whose
// heads start at column `column0`.
TRAINER_HD int64_t token_major_index(int64_t head_major, int T, int hs, int NH, int64_t width,
                                     int64_t column0) {
  const int64_t d = head_major % hs, t = (head_major / hs) % T, bh = head_major / (int64_t(hs) * T);
  const int64_t h = bh % NH, b = bh / NH;
  return (b * T + t) * width + column0 + h * hs + d;
}

// The row operations, for row r of a block: batch entry bh = r / nq, query i = q0 + r % nq, whose
// scores s[0, L) (already scaled; the row starts r * stride() in) have keys j <= i visible. Their
// log-sum-exp is m + log(sum_j exp(s_j - m)) with m the largest; a probability is exp(s_j - lse) (0
// when j > i).
TRAINER_HD int query_of_row(int64_t r, QueryBlock blk) {
  return blk.q0 + int(r % blk.nq);
}
TRAINER_HD int64_t head_of_row(int64_t r, QueryBlock blk) {
  return r / blk.nq;
}

// The device work besides the GEMMs; a backend implements it (the CUDA one in kernels/cuda, the
// tests on the CPU). Buffers hold whatever dtype the caller allocated (see AttentionScratch).
class AttentionSteps {
 public:
  virtual ~AttentionSteps() = default;
  virtual void gemm(const GemmCall& call) = 0;
  // dst (B, NH, T, hs) = the columns [column0, column0 + C) of src (B, T, width).
  virtual void to_heads(DPtr dst, DPtr src, int64_t width, int64_t column0,
                        const AttentionShape& s) = 0;
  // The reverse (dst's dtype may differ: a cast).
  virtual void from_heads(DPtr dst, int64_t width, int64_t column0, DPtr src,
                          const AttentionShape& s) = 0;
  // For the heads() * nq rows of the block, s (row stride blk.stride()): lse[bh * T + i] and p
  // (same layout) = the causal softmax of s.
  virtual void softmax_rows(DPtr p, DPtr lse, DPtr s, QueryBlock blk, const AttentionShape& sh) = 0;
  // p = exp(s - lse) for j <= i, else 0 (forward's probabilities, recomputed).
  virtual void probs_rows(DPtr p, DPtr s, DPtr lse, QueryBlock blk, const AttentionShape& sh) = 0;
  // p (holding P) becomes dS = P * (dP - D_i), 0 for j > i; dp holds dP (layout as s).
  virtual void dsoftmax_rows(DPtr p, DPtr dp, DPtr D, QueryBlock blk, const AttentionShape& sh) = 0;
  // D[bh * T + t] = sum over the head's hs columns of dout * out (both (B, T, C)).
  virtual void row_dots(DPtr D, DPtr dout, DPtr out, const AttentionShape& s) = 0;
  virtual void zero(DPtr p, int64_t n) = 0;
};

// Working memory: q, k, v, o, dq in the activation dtype, elems() each (o holds dO in backward);
// dk, dv accumulators and d in fp32 (d: heads() * T); s (fp32) and p (activation dtype) hold
// heads() * min(block, T) * T rounded up to 8 each.
struct AttentionScratch {
  DPtr q, k, v, o, dq, dk, dv, s, p, d;
};
// Elements each field needs (forward uses q, k, v, o, s, p).
struct AttentionScratchSizes {
  int64_t head_major, rows, block;  // q..dv; d; s and p
};
AttentionScratchSizes attention_scratch_sizes(const AttentionShape& s);

// out (B, T, C) and lse (B, NH, T, fp32) from qkv (B, T, 3C).
void blocked_attention_forward(AttentionSteps& x, const AttentionScratch& w, DPtr out, DPtr lse,
                               DPtr qkv, const AttentionShape& s);
// dqkv (B, T, 3C) = the gradient, from the forward's out and lse.
void blocked_attention_backward(AttentionSteps& x, const AttentionScratch& w, DPtr dqkv, DPtr dout,
                                DPtr qkv, DPtr out, DPtr lse, const AttentionShape& s);

namespace gemm_plan {
// The products of one query block over head-major q, k, v (scale = 1/sqrt(hs) where it applies):
// s = scale Q_blk K^T; o_blk = P V; dv += P^T dO_blk; dp = dO_blk V^T; dq_blk = scale dS K;
// dk += scale dS^T Q_blk. s, p, dp, dS: (heads, nq, L) row-major, rows blk.stride() apart.
GemmCall block_scores(DPtr s, DPtr q, DPtr k, QueryBlock blk, const AttentionShape& sh);
GemmCall block_output(DPtr o, DPtr p, DPtr v, QueryBlock blk, const AttentionShape& sh);
GemmCall block_backward_values(DPtr dv, DPtr p, DPtr dout, QueryBlock blk,
                               const AttentionShape& sh);
GemmCall block_backward_probs(DPtr dp, DPtr dout, DPtr v, QueryBlock blk, const AttentionShape& sh);
GemmCall block_backward_queries(DPtr dq, DPtr ds, DPtr k, QueryBlock blk, const AttentionShape& sh);
GemmCall block_backward_keys(DPtr dk, DPtr ds, DPtr q, QueryBlock blk, const AttentionShape& sh);
}  // namespace gemm_plan

}  // namespace trainer
