// Causal grouped-query attention, fused over register tiles (kernels/cpu/tile_product.h).
// Forward splits work over (batch, query head) pairs across threads; each thread packs its
// head's keys and values once, then takes the queries in blocks of 64 rows: the block's scores
// (over the keys up to each group of rows' diagonal), their softmax and the product with the
// values stay in cache, and only the probabilities go out to `att` for the backward. Backward
// splits over (batch, key/value head): the thread owning a key/value head runs all the query
// heads of its group block by block and accumulates their dK and dV, so no two threads write
// one gradient, and no T x T gradient of the scores is ever stored.
#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/tile_product.h"

namespace trainer::cpu {
namespace {

constexpr int kBlock = 64;

// Where the heads sit in a row of qkv: NH query heads, then NKV key heads, then NKV value heads.
struct QkvLayout {
  int hs, group;                // head size; query heads per key/value head
  int64_t width, keys, values;  // row length; columns where the key and value heads start
  QkvLayout(int C, int NH, int NKV)
      : hs(C / NH),
        group(NH / NKV),
        width(C + 2 * int64_t(NKV) * (C / NH)),
        keys(C),
        values(C + int64_t(NKV) * (C / NH)) {}
  int64_t query_column(int h) const { return int64_t(h) * hs; }
  int64_t key_column(int h) const { return keys + int64_t(h / group) * hs; }
  int64_t value_column(int h) const { return values + int64_t(h / group) * hs; }
};

int ceil_div(int a, int b) {
  return (a + b - 1) / b;
}

// The per-thread buffers of one head's fused attention (kernels/cpu/tile_product.h): keys or
// values packed once per head as panels, and one block of kBlock query rows' scores (padded to
// whole panels) and outputs (padded to whole panels of the head size).
template <class T>
struct HeadPanels {
  static constexpr int lanes = Simd<T>::lanes;
  int T_, hs, padded_T, padded_hs, head_panels;
  HeadPanels(int length, int head_size)
      : T_(length),
        hs(head_size),
        padded_T(ceil_div(length, lanes) * lanes),
        padded_hs(ceil_div(head_size, lanes) * lanes),
        head_panels(padded_hs / lanes) {}
  size_t transposed_size() const { return size_t(padded_T) * hs; }  // T x hs, transposed
  size_t columns_size() const { return size_t(padded_hs) * T_; }    // T x hs, by columns
  size_t block_rows_size() const { return size_t(kBlock) * padded_T; }
  size_t block_out_size() const { return size_t(kBlock) * padded_hs; }
  T* block_row(std::vector<T>& v, int i) const { return v.data() + int64_t(i) * padded_T; }
  T* block_out_row(std::vector<T>& v, int i) const { return v.data() + int64_t(i) * padded_hs; }
};

}  // namespace

template <class T>
void attention_forward(T* out, T* att, const T* qkv, int B, int T_, int C, int NH, int NKV) {
  const QkvLayout l(C, NH, NKV);
  const HeadPanels<T> p(T_, l.hs);
  const int hs = l.hs, L = p.lanes;
  const int64_t W = l.width;
  const T scale = T(1) / std::sqrt(T(hs));
#pragma omp parallel
  {
    std::vector<T> keys(p.transposed_size()), values(p.columns_size()), scores(p.block_rows_size()),
        rows_out(p.block_out_size());
#pragma omp for schedule(static)
    for (int bh = 0; bh < B * NH; bh++) {
      const int b = bh / NH, h = bh % NH;
      const T* row0 = qkv + int64_t(b) * T_ * W;
      const T* Q = row0 + l.query_column(h);
      pack_transposed_panels(keys.data(), row0 + l.key_column(h), W, T_, hs);
      pack_column_panels(values.data(), row0 + l.value_column(h), W, T_, hs);
      T* A = att + int64_t(bh) * T_ * T_;
      T* O = out + int64_t(b) * T_ * C + int64_t(h) * hs;
      for (int r0 = 0; r0 < T_; r0 += kBlock) {
        const int r1 = std::min(T_, r0 + kBlock);
        // Scores, each group of rows over the key panels up to its last row's diagonal.
        for (int i = r0; i < r1; i += kTileRows) {
          const int rows = std::min(kTileRows, r1 - i);
          product_rows<T>(rows, Q + i * W, W, 1, hs, keys.data(), int64_t(hs) * L,
                          ceil_div(i + rows, L), p.block_row(scores, i - r0), p.padded_T, scale,
                          false);
        }
        // Probabilities into att, 0 above the diagonal (read below, and by the backward).
        for (int i = r0; i < r1; i++) {
          T* s = p.block_row(scores, i - r0);
          T* a = A + int64_t(i) * T_;
          const T inv = T(1) / exp_shifted(s, i + 1, row_max(s, i + 1));
#pragma omp simd
          for (int j = 0; j <= i; j++) a[j] = s[j] * inv;
          std::fill(a + i + 1, a + T_, T(0));
        }
        // out = P V, each group of rows over the keys up to its last row.
        for (int i = r0; i < r1; i += kTileRows) {
          const int rows = std::min(kTileRows, r1 - i);
          product_rows<T>(rows, A + int64_t(i) * T_, T_, 1, i + rows, values.data(),
                          int64_t(T_) * L, p.head_panels, p.block_out_row(rows_out, i - r0),
                          p.padded_hs, T(1), false);
        }
        for (int i = r0; i < r1; i++)
          std::copy_n(p.block_out_row(rows_out, i - r0), hs, O + int64_t(i) * C);
      }
    }
  }
}

template <class T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* att, int B, int T_, int C,
                        int NH, int NKV) {
  const QkvLayout l(C, NH, NKV);
  const HeadPanels<T> p(T_, l.hs);
  const int hs = l.hs, L = p.lanes;
  const int64_t W = l.width;
  const T scale = T(1) / std::sqrt(T(hs));
#pragma omp parallel
  {
    std::vector<T> keys(p.columns_size()), values(p.transposed_size()), dS(p.block_rows_size()),
        rows_out(p.block_out_size()), queries(p.block_out_size()), douts(p.block_out_size()),
        dK(p.columns_size()), dV(p.columns_size());
#pragma omp for schedule(static)
    for (int bkv = 0; bkv < B * NKV; bkv++) {
      const int b = bkv / NKV, kv = bkv % NKV;
      const int64_t row0 = int64_t(b) * T_ * W;
      const T *K = qkv + row0 + l.keys + int64_t(kv) * hs,
              *V = qkv + row0 + l.values + int64_t(kv) * hs;
      pack_column_panels(keys.data(), K, W, T_, hs);
      pack_transposed_panels(values.data(), V, W, T_, hs);
      // dK and dV rows as the tiles write them (row-major, padded_hs wide), summed over the
      // group's query heads.
      std::fill(dK.begin(), dK.end(), T(0));
      std::fill(dV.begin(), dV.end(), T(0));
      for (int g = 0; g < l.group; g++) {
        const int h = kv * l.group + g;
        const T* Q = qkv + row0 + l.query_column(h);
        T* dQ = dqkv + row0 + l.query_column(h);
        const T* A = att + (int64_t(b) * NH + h) * T_ * T_;
        const T* dO = dout + int64_t(b) * T_ * C + int64_t(h) * hs;
        for (int r0 = 0; r0 < T_; r0 += kBlock) {
          const int r1 = std::min(T_, r0 + kBlock), n = r1 - r0;
          pack_column_panels(queries.data(), Q + r0 * W, W, n, hs);
          pack_column_panels(douts.data(), dO + int64_t(r0) * C, C, n, hs);
          // dP = dout V^T, then the softmax backward in place: dS = P (dP - P . dP). Entries
          // above the diagonal inside the block are zeroed because the products below read them.
          for (int i = r0; i < r1; i += kTileRows) {
            const int rows = std::min(kTileRows, r1 - i);
            product_rows<T>(rows, dO + int64_t(i) * C, C, 1, hs, values.data(), int64_t(hs) * L,
                            ceil_div(i + rows, L), p.block_row(dS, i - r0), p.padded_T, T(1),
                            false);
          }
          for (int i = r0; i < r1; i++) {
            const T* a = A + int64_t(i) * T_;
            T* d = p.block_row(dS, i - r0);
            softmax_backward_row(d, a, i + 1, dot_row(a, d, i + 1));
            std::fill(d + i + 1, d + r1, T(0));
          }
          // dQ = scale dS K over the causal prefix.
          for (int i = r0; i < r1; i += kTileRows) {
            const int rows = std::min(kTileRows, r1 - i);
            product_rows<T>(rows, p.block_row(dS, i - r0), p.padded_T, 1, i + rows, keys.data(),
                            int64_t(T_) * L, p.head_panels, p.block_out_row(rows_out, i - r0),
                            p.padded_hs, scale, false);
          }
          for (int i = r0; i < r1; i++)
            std::copy_n(p.block_out_row(rows_out, i - r0), hs, dQ + int64_t(i) * W);
          // dK += scale dS^T Q and dV += P^T dout: key j receives from the block's rows i >= j.
          for (int j = 0; j < r1; j += kTileRows) {
            const int keys_here = std::min(kTileRows, r1 - j), k0 = std::max(r0, j);
            product_rows<T>(keys_here, p.block_row(dS, k0 - r0) + j, 1, p.padded_T, r1 - k0,
                            queries.data() + int64_t(k0 - r0) * L, int64_t(n) * L, p.head_panels,
                            dK.data() + int64_t(j) * p.padded_hs, p.padded_hs, scale, true);
            product_rows<T>(keys_here, A + int64_t(k0) * T_ + j, 1, T_, r1 - k0,
                            douts.data() + int64_t(k0 - r0) * L, int64_t(n) * L, p.head_panels,
                            dV.data() + int64_t(j) * p.padded_hs, p.padded_hs, T(1), true);
          }
        }
      }
      T *dKout = dqkv + row0 + l.keys + int64_t(kv) * hs,
        *dVout = dqkv + row0 + l.values + int64_t(kv) * hs;
      for (int j = 0; j < T_; j++) {
        std::copy_n(dK.data() + int64_t(j) * p.padded_hs, hs, dKout + j * W);
        std::copy_n(dV.data() + int64_t(j) * p.padded_hs, hs, dVout + j * W);
      }
    }
  }
}

// Straight loops, one (query, head) pair at a time: generation runs one new query per step,
// where blocking gains nothing.
template <class T>
void attention_inference(T* out, const T* qkv, int T_, int q0, int C, int NH, int NKV) {
  const QkvLayout l(C, NH, NKV);
  const int hs = l.hs;
  const int64_t W = l.width;
  const T scale = T(1) / std::sqrt(T(hs));
  const int queries = T_ - q0;
#pragma omp parallel
  {
    std::vector<T> p(size_t(std::max(T_, 1)));  // one query's scores, then probabilities
#pragma omp for schedule(static)
    for (int64_t ih = 0; ih < int64_t(queries) * NH; ih++) {
      const int i = q0 + int(ih / NH), h = int(ih % NH);
      const T* q = qkv + int64_t(i) * W + l.query_column(h);
      T mx = -INFINITY;
      for (int j = 0; j <= i; j++) {
        const T* k = qkv + int64_t(j) * W + l.key_column(h);
        T dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int e = 0; e < hs; e++) dot += q[e] * k[e];
        p[j] = dot * scale;
        mx = std::max(mx, p[j]);
      }
      const T sum = exp_shifted(p.data(), i + 1, mx);
      T* o = out + int64_t(i - q0) * C + int64_t(h) * hs;
      std::fill(o, o + hs, T(0));
      for (int j = 0; j <= i; j++) {
        const T* v = qkv + int64_t(j) * W + l.value_column(h);
        const T w = p[j] / sum;
#pragma omp simd
        for (int e = 0; e < hs; e++) o[e] += w * v[e];
      }
    }
  }
}

// --- ring attention's parts ----------------------------------------------------------------
// A part's keys are two runs of consecutive positions (TokenChunks): rows [0, chunk) and
// [chunk, T). Query i sees a prefix of each run: those at positions up to its own. A block of
// query rows computes its scores only over the longest such prefix of each run, and masks the
// rest row by row.
namespace {

struct KeyRun {
  int begin, end, start;  // rows [begin, end) of the part's keys, at positions start, start + 1...
  // How many of the run's keys a query at `position` sees.
  int visible(int position) const { return std::clamp(position - start + 1, 0, end - begin); }
};

std::array<KeyRun, 2> key_runs(const AttentionPart& p) {
  const int split = std::min(p.keys.chunk, p.T);
  return {KeyRun{0, split, p.keys.start0}, KeyRun{split, p.T, p.keys.start1}};
}

// For query rows [r0, r1): the widest visible prefix of each run (the columns its products
// cover).
std::array<int, 2> run_widths(const AttentionPart& p, const std::array<KeyRun, 2>& runs, int r0,
                              int r1) {
  std::array<int, 2> w{0, 0};
  for (int i = r0; i < r1; i++)
    for (int k = 0; k < 2; k++) w[k] = std::max(w[k], runs[k].visible(p.queries.position(i)));
  return w;
}

// One head's keys and values for a part, packed run by run (kernels/cpu/tile_product.h): run k's
// scores start at column `column[k]` of a block row (whole panels each), its transposed panels
// at `transposed[k]` and its column panels at `columns[k]`.
template <class T>
struct PartPanels {
  static constexpr int lanes = Simd<T>::lanes;
  std::array<KeyRun, 2> runs;
  std::array<int64_t, 2> column, transposed, columns;
  int64_t row_width;  // a block row's scores: both runs, padded
  int hs, padded_hs, head_panels;
  PartPanels(const AttentionPart& p)
      : runs(key_runs(p)),
        hs(p.C / p.NH),
        padded_hs(ceil_div(p.C / p.NH, lanes) * lanes),
        head_panels(padded_hs / lanes) {
    const int64_t padded0 = int64_t(ceil_div(runs[0].end - runs[0].begin, lanes)) * lanes;
    column = {0, padded0};
    row_width = padded0 + int64_t(ceil_div(runs[1].end - runs[1].begin, lanes)) * lanes;
    transposed = {0, padded0 * hs};
    columns = {0, int64_t(runs[0].end - runs[0].begin) * padded_hs};
  }
  int length(int k) const { return runs[k].end - runs[k].begin; }
  size_t transposed_size() const { return size_t(row_width) * hs; }
  size_t columns_size() const { return size_t(runs[1].end) * padded_hs; }
  // Rows [begin, end) of a run of keys or values (leading dimension ld), packed.
  void pack_transposed(T* panels, const T* a, int64_t ld) const {
    for (int k = 0; k < 2; k++)
      pack_transposed_panels(panels + transposed[k], a + runs[k].begin * ld, ld, length(k), hs);
  }
  void pack_columns(T* panels, const T* a, int64_t ld) const {
    for (int k = 0; k < 2; k++)
      pack_column_panels(panels + columns[k], a + runs[k].begin * ld, ld, length(k), hs);
  }
};

}  // namespace

int64_t attention_part_pairs(const AttentionPart& p) {
  const auto runs = key_runs(p);
  int64_t pairs = 0;
  for (int i = 0; i < p.T; i++)
    for (const KeyRun& r : runs) pairs += r.visible(p.queries.position(i));
  return pairs * p.B * p.NH;
}

template <class T>
void attention_part_forward(T* out, T* lse, const T* q, const T* kv, const AttentionPart& p) {
  const QkvLayout l(p.C, p.NH, p.NKV);
  const PartPanels<T> pp(p);
  const int hs = l.hs, T_ = p.T, C = p.C, L = pp.lanes;
  const int64_t W = l.width, SW = pp.row_width;
  const T scale = T(1) / std::sqrt(T(hs));
  const auto& runs = pp.runs;
#pragma omp parallel
  {
    std::vector<T> keys(pp.transposed_size()), values(pp.columns_size()), S(size_t(kBlock) * SW),
        O(size_t(kBlock) * pp.padded_hs);
#pragma omp for schedule(static)
    for (int bh = 0; bh < p.B * p.NH; bh++) {
      const int b = bh / p.NH, h = bh % p.NH;
      const int64_t row0 = int64_t(b) * T_ * W;
      const T* Q = q + row0 + l.query_column(h);
      pp.pack_transposed(keys.data(), kv + row0 + l.key_column(h), W);
      pp.pack_columns(values.data(), kv + row0 + l.value_column(h), W);
      T* Out = out + int64_t(b) * T_ * C + int64_t(h) * hs;
      T* Lse = lse + int64_t(bh) * T_;
      for (int r0 = 0; r0 < T_; r0 += kBlock) {
        const int r1 = std::min(T_, r0 + kBlock), rows = r1 - r0;
        const std::array<int, 2> width = run_widths(p, runs, r0, r1);
        for (int i = r0; i < r1; i += kTileRows) {
          const int n = std::min(kTileRows, r1 - i);
          const std::array<int, 2> w = run_widths(p, runs, i, i + n);
          for (int k = 0; k < 2; k++)
            if (w[k] > 0)
              product_rows<T>(n, Q + i * W, W, 1, hs, keys.data() + pp.transposed[k],
                              int64_t(hs) * L, ceil_div(w[k], L),
                              S.data() + (i - r0) * SW + pp.column[k], SW, scale, false);
        }
        // Each row's softmax over its visible keys: probabilities (normalised within the part)
        // in place of the scores, 0 elsewhere in the products' columns.
        std::vector<T> part_lse(size_t(rows), -INFINITY);
        for (int i = r0; i < r1; i++) {
          T* s = S.data() + int64_t(i - r0) * SW;
          const int pos = p.queries.position(i);
          T mx = -INFINITY;
          for (int k = 0; k < 2; k++)
            mx = std::max(mx, row_max(s + pp.column[k], runs[k].visible(pos)));
          T sum = 0;
          for (int k = 0; k < 2; k++) {
            const int seen = runs[k].visible(pos);
            sum += exp_shifted(s + pp.column[k], seen, mx);
            std::fill(s + pp.column[k] + seen, s + pp.column[k] + width[k], T(0));
          }
          if (sum == 0) continue;  // no key of the part is visible
          for (int k = 0; k < 2; k++) scale_row(s + pp.column[k], runs[k].visible(pos), T(1) / sum);
          part_lse[i - r0] = mx + std::log(sum);
        }
        // This part's output of each row; rows that see none of its keys are not read below.
        for (int i = r0; i < r1; i += kTileRows) {
          const int n = std::min(kTileRows, r1 - i);
          const std::array<int, 2> w = run_widths(p, runs, i, i + n);
          for (int k = 0; k < 2; k++)
            if (w[k] > 0)
              product_rows<T>(n, S.data() + (i - r0) * SW + pp.column[k], SW, 1, w[k],
                              values.data() + pp.columns[k], int64_t(pp.length(k)) * L,
                              pp.head_panels, O.data() + int64_t(i - r0) * pp.padded_hs,
                              pp.padded_hs, T(1), k == 1 && w[0] > 0);
        }
        // The online softmax: out and lse so far (over earlier parts) and this part's, weighted
        // by their shares of the combined normaliser.
        for (int i = r0; i < r1; i++) {
          const T lp = part_lse[i - r0];
          T* o = Out + int64_t(i) * C;
          const T* op = O.data() + int64_t(i - r0) * pp.padded_hs;
          if (p.first) {
            Lse[i] = lp;
            for (int e = 0; e < hs; e++) o[e] = std::isinf(lp) ? T(0) : op[e];
            continue;
          }
          if (std::isinf(lp)) continue;
          const T lo = Lse[i], hi = std::max(lo, lp);
          const T combined = hi + std::log(std::exp(lo - hi) + std::exp(lp - hi));
          const T keep = std::exp(lo - combined), add = std::exp(lp - combined);
          for (int e = 0; e < hs; e++) o[e] = keep * o[e] + add * op[e];
          Lse[i] = combined;
        }
      }
    }
  }
}

template <class T>
void attention_part_backward(T* dq, T* dkv, const T* dout, const T* q, const T* kv, const T* out,
                             const T* lse, const AttentionPart& p) {
  const QkvLayout l(p.C, p.NH, p.NKV);
  const PartPanels<T> pp(p);
  const int hs = l.hs, T_ = p.T, C = p.C, L = pp.lanes, hsp = pp.padded_hs;
  const int64_t W = l.width, SW = pp.row_width;
  const T scale = T(1) / std::sqrt(T(hs));
  const auto& runs = pp.runs;
#pragma omp parallel
  {
    std::vector<T> keys_t(pp.transposed_size()), keys(pp.columns_size()),
        values_t(pp.transposed_size()), P(size_t(kBlock) * SW), dP(P.size()),
        rows_out(size_t(kBlock) * hsp), queries(rows_out.size()), douts(rows_out.size()),
        dK(pp.columns_size()), dV(pp.columns_size());
    // Threads split over key/value heads: each accumulates its own dK and dV (and its group's
    // dQ), so no two write one gradient.
#pragma omp for schedule(static)
    for (int bkv = 0; bkv < p.B * p.NKV; bkv++) {
      const int b = bkv / p.NKV, kvh = bkv % p.NKV;
      const int64_t row0 = int64_t(b) * T_ * W;
      const T *K = kv + row0 + l.keys + int64_t(kvh) * hs,
              *V = kv + row0 + l.values + int64_t(kvh) * hs;
      pp.pack_transposed(keys_t.data(), K, W);
      pp.pack_columns(keys.data(), K, W);
      pp.pack_transposed(values_t.data(), V, W);
      std::fill(dK.begin(), dK.end(), T(0));
      std::fill(dV.begin(), dV.end(), T(0));
      for (int g = 0; g < l.group; g++) {
        const int h = kvh * l.group + g;
        const T* Q = q + row0 + l.query_column(h);
        T* dQ = dq + row0 + l.query_column(h);
        const T *O = out + int64_t(b) * T_ * C + int64_t(h) * hs,
                *dO = dout + int64_t(b) * T_ * C + int64_t(h) * hs;
        const T* Lse = lse + (int64_t(b) * p.NH + h) * T_;
        for (int r0 = 0; r0 < T_; r0 += kBlock) {
          const int r1 = std::min(T_, r0 + kBlock), n = r1 - r0;
          const std::array<int, 2> width = run_widths(p, runs, r0, r1);
          pack_column_panels(queries.data(), Q + r0 * W, W, n, hs);
          pack_column_panels(douts.data(), dO + int64_t(r0) * C, C, n, hs);
          for (int i = r0; i < r1; i += kTileRows) {
            const int m = std::min(kTileRows, r1 - i);
            const std::array<int, 2> w = run_widths(p, runs, i, i + m);
            for (int k = 0; k < 2; k++)
              if (w[k] > 0) {
                const int64_t at = (i - r0) * SW + pp.column[k];
                product_rows<T>(m, Q + i * W, W, 1, hs, keys_t.data() + pp.transposed[k],
                                int64_t(hs) * L, ceil_div(w[k], L), P.data() + at, SW, scale,
                                false);
                product_rows<T>(m, dO + int64_t(i) * C, C, 1, hs,
                                values_t.data() + pp.transposed[k], int64_t(hs) * L,
                                ceil_div(w[k], L), dP.data() + at, SW, T(1), false);
              }
          }
          // P = exp(S - lse) over the visible keys (the whole attention's probabilities), and
          // dS = P (dP - D) with D = dO . O, in place of dP; 0 elsewhere in the block's columns.
          for (int i = r0; i < r1; i++) {
            T* pr = P.data() + int64_t(i - r0) * SW;
            T* d = dP.data() + int64_t(i - r0) * SW;
            const int pos = p.queries.position(i);
            const T D = dot_row(dO + int64_t(i) * C, O + int64_t(i) * C, hs);
            for (int k = 0; k < 2; k++) {
              const int64_t j0 = pp.column[k];
              const int seen = runs[k].visible(pos);
              exp_shifted(pr + j0, seen, Lse[i]);
              softmax_backward_row(d + j0, pr + j0, seen, D);
              std::fill(pr + j0 + seen, pr + j0 + width[k], T(0));
              std::fill(d + j0 + seen, d + j0 + width[k], T(0));
            }
          }
          // dQ += scale dS K.
          for (int i = r0; i < r1; i += kTileRows) {
            const int m = std::min(kTileRows, r1 - i);
            const std::array<int, 2> w = run_widths(p, runs, i, i + m);
            if (w[0] + w[1] == 0) continue;
            T* rows = rows_out.data() + int64_t(i - r0) * hsp;
            for (int k = 0; k < 2; k++)
              if (w[k] > 0)
                product_rows<T>(m, dP.data() + (i - r0) * SW + pp.column[k], SW, 1, w[k],
                                keys.data() + pp.columns[k], int64_t(pp.length(k)) * L,
                                pp.head_panels, rows, hsp, scale, k == 1 && w[0] > 0);
            for (int r = 0; r < m; r++)
              for (int e = 0; e < hs; e++) dQ[(i + r) * W + e] += rows[r * hsp + e];
          }
          // dK += scale dS^T Q and dV += P^T dO over the keys some row of the block sees.
          for (int k = 0; k < 2; k++)
            for (int j = 0; j < width[k]; j += kTileRows) {
              const int m = std::min(kTileRows, width[k] - j);
              const int64_t key = runs[k].begin + j;
              product_rows<T>(m, dP.data() + pp.column[k] + j, 1, SW, n, queries.data(),
                              int64_t(n) * L, pp.head_panels, dK.data() + key * hsp, hsp, scale,
                              true);
              product_rows<T>(m, P.data() + pp.column[k] + j, 1, SW, n, douts.data(),
                              int64_t(n) * L, pp.head_panels, dV.data() + key * hsp, hsp, T(1),
                              true);
            }
        }
      }
      T *dKout = dkv + row0 + l.keys + int64_t(kvh) * hs,
        *dVout = dkv + row0 + l.values + int64_t(kvh) * hs;
      for (int j = 0; j < T_; j++)
        for (int e = 0; e < hs; e++) {
          dKout[j * W + e] += dK[j * hsp + e];
          dVout[j * W + e] += dV[j * hsp + e];
        }
    }
  }
}

#define INSTANTIATE(T)                                                                            \
  template void attention_forward<T>(T*, T*, const T*, int, int, int, int, int);                  \
  template void attention_backward<T>(T*, const T*, const T*, const T*, int, int, int, int, int); \
  template void attention_inference<T>(T*, const T*, int, int, int, int, int);                    \
  template void attention_part_forward<T>(T*, T*, const T*, const T*, const AttentionPart&);      \
  template void attention_part_backward<T>(T*, T*, const T*, const T*, const T*, const T*,        \
                                           const T*, const AttentionPart&);
INSTANTIATE(float)
INSTANTIATE(double)

}  // namespace trainer::cpu
