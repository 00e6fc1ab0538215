#pragma once
// Causal attention by blocks of queries, for the GPU: no T x T matrix is kept. Forward keeps
// each row's log-sum-exp (B, NH, T); backward recomputes each block's probabilities from it, as
// FlashAttention does, but the products are cuBLASLt GEMMs (tensor cores, kernels/gemm_plan.h)
// and the row work is small kernels, so every step is also run on the CPU in the tests
// (tests/test_gemm_plan.cpp) against the CPU backend's attention.
//
// Per query block [q0, q0 + nq), only keys [0, L = q0 + nq) are visible: the causal half of the
// products is never computed. Q, K, V, O and dO are first copied head-major, so that one strided
// batch covers every sequence and key/value head: K and V as (B, NKV, T, hs), and the query side
// (Q, O, dO, dQ) as (B, NKV, T, G, hs), where the G = NH / NKV query heads that share a key/value
// head are adjacent rows. A block's queries of one group are then one matrix of nq G rows, and
// one GEMM serves the whole group against its K and V (dK and dV sum over the group inside the
// GEMM), with K and V never repeated. With NKV = NH (G = 1) both are (B, NH, T, hs).
#include <cstdint>
#include <vector>

#include "kernels/gemm_plan.h"
#include "kernels/shared_math.h"

namespace trainer {

struct AttentionShape {
  int B, T, C, NH, NKV;  // NKV key/value heads, each shared by NH / NKV query heads
  int block = 128;       // queries per block: scratch grows with it, launches shrink
  int hs() const { return C / NH; }
  int group() const { return NH / NKV; }                         // query heads per key/value head
  int64_t width() const { return C + 2 * int64_t(NKV) * hs(); }  // a row of qkv
  int64_t key_column() const { return C; }                       // where qkv's key heads start
  int64_t value_column() const { return C + int64_t(NKV) * hs(); }
  int64_t heads() const { return int64_t(B) * NH; }      // query heads: the statistics' rows / T
  int64_t kv_heads() const { return int64_t(B) * NKV; }  // batch entries of every GEMM
  int64_t elems() const { return int64_t(B) * T * C; }   // one query-side head-major copy
  int64_t kv_elems() const { return int64_t(B) * T * NKV * hs(); }  // one key/value-side copy
};

// Which head-major layout a copy has (see the top of this file).
enum class HeadSide { queries, keys_values };

// One block of queries and the keys it sees. Each batch entry holds the block's queries of the
// `group` query heads sharing a key/value head: nq * group rows, query-major.
struct QueryBlock {
  int q0, nq;
  int group = 1;
  TRAINER_HD int rows() const { return nq * group; }  // per batch entry
  TRAINER_HD int keys() const { return q0 + nq; }
  // The row stride of the block's (nq, keys) matrices: a multiple of 8, so that every row of a
  // 16-bit matrix starts 16-byte aligned (the fast GEMM kernels' need) whatever T is.
  TRAINER_HD int stride() const { return (keys() + 7) / 8 * 8; }
};
std::vector<QueryBlock> query_blocks(const AttentionShape& s);

// Where element (b, k, t, g, d) of a head-major (B, NK, T, group, hs) tensor sits in a token-major
// (B, T, width) one whose heads start at column `column0`: head k * group + g there. The key/value
// side is group = 1; (B, NH, T, hs) is NK = NH, group = 1.
TRAINER_HD int64_t token_major_index(int64_t head_major, int T, int hs, int NK, int group,
                                     int64_t width, int64_t column0) {
  const int64_t d = head_major % hs, g = (head_major / hs) % group;
  const int64_t t = (head_major / (int64_t(hs) * group)) % T;
  const int64_t bk = head_major / (int64_t(hs) * group * T);
  const int64_t k = bk % NK, b = bk / NK;
  return (b * T + t) * width + column0 + (k * group + g) * hs + d;
}

// The row operations, for row r of a block: batch entry e = r / rows(), query i = q0 + (r %
// rows()) / group of query head g = r % group, whose scores s[0, L) (already scaled; the row
// starts r * stride() in) have keys j <= i visible. Their log-sum-exp is m + log(sum_j exp(s_j -
// m)) with m the largest; a probability is exp(s_j - lse) (0 when j > i).
TRAINER_HD int query_of_row(int64_t r, QueryBlock blk) {
  return blk.q0 + int(r % blk.rows()) / blk.group;
}
// The row's query head over all sequences, b * NH + h (h = k * group + g for e = b * NKV + k):
// per-row statistics are (B, NH, T), at head_of_row * T + query_of_row.
TRAINER_HD int64_t head_of_row(int64_t r, QueryBlock blk) {
  return r / blk.rows() * blk.group + r % blk.group;
}

// The device work besides the GEMMs; a backend implements it (the CUDA one in kernels/cuda, the
// tests on the CPU). Buffers hold whatever dtype the caller allocated (see AttentionScratch).
class AttentionSteps {
 public:
  virtual ~AttentionSteps() = default;
  virtual void gemm(const GemmCall& call) = 0;
  // dst (head-major, the layout of `side`) = the heads of src (B, T, width) starting at column
  // column0: NH of them for the query side, NKV for the key/value side.
  virtual void to_heads(DPtr dst, HeadSide side, DPtr src, int64_t width, int64_t column0,
                        const AttentionShape& s) = 0;
  // The reverse (dst's dtype may differ: a cast).
  virtual void from_heads(DPtr dst, int64_t width, int64_t column0, DPtr src, HeadSide side,
                          const AttentionShape& s) = 0;
  // For the heads() * nq rows of the block, s (row stride blk.stride()): lse[head_of_row * T +
  // i] and p (same layout) = the causal softmax of s.
  virtual void softmax_rows(DPtr p, DPtr lse, DPtr s, QueryBlock blk, const AttentionShape& sh) = 0;
  // p = exp(s - lse) for j <= i, else 0 (forward's probabilities, recomputed).
  virtual void probs_rows(DPtr p, DPtr s, DPtr lse, QueryBlock blk, const AttentionShape& sh) = 0;
  // p (holding P) becomes dS = P * (dP - D_i), 0 for j > i; dp holds dP (layout as s).
  virtual void dsoftmax_rows(DPtr p, DPtr dp, DPtr D, QueryBlock blk, const AttentionShape& sh) = 0;
  // D[bh * T + t] = sum over query head bh's hs columns of dout * out (both (B, T, C)).
  virtual void row_dots(DPtr D, DPtr dout, DPtr out, const AttentionShape& s) = 0;
  virtual void zero(DPtr p, int64_t n) = 0;
};

// Working memory: q, o, dq (query side, elems() each; o holds dO in backward) and k, v (kv_elems()
// each) in the activation dtype; dk, dv accumulators (kv_elems()) and d in fp32 (d: heads() * T);
// s (fp32) and p (activation dtype) hold heads() * min(block, T) * T rounded up to 8 each.
struct AttentionScratch {
  DPtr q, k, v, o, dq, dk, dv, s, p, d;
};
// Elements each field needs (forward uses q, k, v, o, s, p).
struct AttentionScratchSizes {
  int64_t head_major, kv_head_major, rows, block;  // q, o, dq; k, v, dk, dv; d; s and p
};
AttentionScratchSizes attention_scratch_sizes(const AttentionShape& s);

// out (B, T, C) and lse (B, NH, T, fp32) from qkv (B, T, width()).
void blocked_attention_forward(AttentionSteps& x, const AttentionScratch& w, DPtr out, DPtr lse,
                               DPtr qkv, const AttentionShape& s);
// dqkv (B, T, width()) = the gradient, from the forward's out and lse.
void blocked_attention_backward(AttentionSteps& x, const AttentionScratch& w, DPtr dqkv, DPtr dout,
                                DPtr qkv, DPtr out, DPtr lse, const AttentionShape& s);

namespace gemm_plan {
// The products of one query block over head-major q, k, v (scale = 1/sqrt(hs) where it applies),
// batched over the kv_heads() key/value heads, Q_blk being the rows() rows of a group's block:
// s = scale Q_blk K^T; o_blk = P V; dv += P^T dO_blk; dp = dO_blk V^T; dq_blk = scale dS K;
// dk += scale dS^T Q_blk. s, p, dp, dS: (kv_heads, rows, L) row-major, rows blk.stride() apart.
GemmCall block_scores(DPtr s, DPtr q, DPtr k, QueryBlock blk, const AttentionShape& sh);
GemmCall block_output(DPtr o, DPtr p, DPtr v, QueryBlock blk, const AttentionShape& sh);
GemmCall block_backward_values(DPtr dv, DPtr p, DPtr dout, QueryBlock blk,
                               const AttentionShape& sh);
GemmCall block_backward_probs(DPtr dp, DPtr dout, DPtr v, QueryBlock blk, const AttentionShape& sh);
GemmCall block_backward_queries(DPtr dq, DPtr ds, DPtr k, QueryBlock blk, const AttentionShape& sh);
GemmCall block_backward_keys(DPtr dk, DPtr ds, DPtr q, QueryBlock blk, const AttentionShape& sh);
}  // namespace gemm_plan

}  // namespace trainer
