// Causal grouped-query attention and ring attention's parts, fused over register tiles
// (kernels/cpu/tile_product.h), keeping no T x T matrix: the forward keeps each row's
// log-sum-exp, and the backward recomputes the probabilities block by block from it
// (FlashAttention-2's scheme). Causal attention is the one part whose keys are the queries' own.
//
// Forward packs every key/value head's keys and values once, for all threads, then hands out
// (query head, block of kBlock query rows) tasks: the block's scores (each group of rows over
// the keys up to its diagonal), their softmax and the product with the values stay in cache.
// Backward splits over (batch, key/value head) and meets each block of query rows with the keys
// block by block (see part_backward).
//
// Measured on W-L's shape (T 1024, 12 heads over 4 key/value heads, hs 64, 2 threads, one
// process, blocks of 64, against the kernels that kept the probabilities): forward 7.0 ms
// against 7.9 (no T x T store), backward 14.0 against 11.5 (a fifth product, QK^T again, and its
// exponentials); activations of W-L at micro-batch 1 plan 698 MB instead of 1273.
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/tile_product.h"

namespace trainer::cpu {
namespace {

// Query rows per block, and keys per block in the backward: a multiple of every lane count (a key
// block starts on a panel: six zmm panels of float, twelve of double) and of kTileRows (no
// block ends in a tile of fewer rows, which multiplies at about half the rate: with 64, each
// block's last 4 rows took 13% of the forward's tile time). On W-L's shape against 64 (three
// runs each, best of 30-40 calls): forward 7.60-7.69 ms against 7.90-8.11, backward 16.88-16.99
// against 17.98-18.07; 48 and 144 measured between the two.
constexpr int kBlock = 96;
static_assert(kBlock % kTileRows == 0 && kBlock % Simd<float>::lanes == 0 &&
              kBlock % Simd<double>::lanes == 0);

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

}  // namespace

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

// --- parts: ring attention's, and the causal attention as the one part ---------------------
// A part's keys are two runs of consecutive positions (TokenChunks): rows [0, chunk) and
// [chunk, T) (the causal part: one run, [0, T)). Query i sees a prefix of each run: those at
// positions up to its own. A block of query rows computes its scores only over the longest such
// prefix of each run, and masks the rest row by row.
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

int attention_backward_split(int kv_tasks, int group, int threads) {
  auto busy = [&](int tasks) {  // the share of the threads' time the static split keeps busy
    return double(tasks) / (double(threads) * ceil_div(tasks, threads));
  };
  int best = 1;
  for (int s = 2; s <= group; s++)
    if (group % s == 0 && busy(kv_tasks * s) > busy(kv_tasks * best) + 1e-9) best = s;
  return best;
}

template <class T>
void attention_part_forward(T* out, T* lse, const T* q, const T* kv, const AttentionPart& p) {
  const QkvLayout l(p.C, p.NH, p.NKV);
  const PartPanels<T> pp(p);
  const int hs = l.hs, T_ = p.T, C = p.C, L = pp.lanes;
  const int64_t W = l.width, SW = pp.row_width;
  const T scale = T(1) / std::sqrt(T(hs));
  const auto& runs = pp.runs;
  const int blocks = ceil_div(T_, kBlock), heads = p.B * p.NH;
  // Every key/value head's keys and values, packed once and read by all the threads (each
  // panel is written whole, padding included, so the buffers start uninitialised).
  const std::unique_ptr<T[]> keys(new T[size_t(p.B) * p.NKV * pp.transposed_size()]),
      values(new T[size_t(p.B) * p.NKV * pp.columns_size()]);
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int bkv = 0; bkv < p.B * p.NKV; bkv++) {
      const int64_t row0 = int64_t(bkv / p.NKV) * T_ * W;
      const int h = bkv % p.NKV * l.group;  // the key/value head's first query head
      pp.pack_transposed(keys.get() + bkv * pp.transposed_size(), kv + row0 + l.key_column(h), W);
      pp.pack_columns(values.get() + bkv * pp.columns_size(), kv + row0 + l.value_column(h), W);
    }
    std::vector<T> S(size_t(kBlock) * SW), O(size_t(kBlock) * pp.padded_hs), part_lse(kBlock),
        inv_sum(kBlock);
    // Tasks are (query head, block of query rows), handed out one at a time so that the threads
    // end together even when one runs slower: key/value head by key/value head (its panels stay
    // in L2 from one task to the next), each head's costliest blocks first (a causal block's
    // rows see more keys the later it sits), so the last tasks are small ones.
#pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < heads * blocks; task++) {
      const int bkv = task / (l.group * blocks), in_kv = task % (l.group * blocks);
      const int r0 = (blocks - 1 - in_kv / l.group) * kBlock;
      const int b = bkv / p.NKV, h = bkv % p.NKV * l.group + in_kv % l.group, bh = b * p.NH + h;
      const int64_t row0 = int64_t(b) * T_ * W;
      const T* Q = q + row0 + l.query_column(h);
      const T* K = keys.get() + bkv * pp.transposed_size();
      const T* V = values.get() + bkv * pp.columns_size();
      T* Out = out + int64_t(b) * T_ * C + int64_t(h) * hs;
      T* Lse = lse + int64_t(bh) * T_;
      const int r1 = std::min(T_, r0 + kBlock);
      const std::array<int, 2> width = run_widths(p, runs, r0, r1);
      for (int i = r0; i < r1; i += kTileRows) {
        const int n = std::min(kTileRows, r1 - i);
        const std::array<int, 2> w = run_widths(p, runs, i, i + n);
        for (int k = 0; k < 2; k++)
          if (w[k] > 0)
            product_rows<T>(n, Q + i * W, W, 1, hs, K + pp.transposed[k], int64_t(hs) * L,
                            ceil_div(w[k], L), S.data() + (i - r0) * SW + pp.column[k], SW, scale,
                            false);
      }
      // Each row's softmax over its visible keys: exp(s - max) in place of the scores, 0
      // elsewhere in the products' columns; the normaliser is applied to the row's output.
      std::fill(part_lse.begin(), part_lse.end(), T(-INFINITY));
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
        inv_sum[i - r0] = T(1) / sum;
        part_lse[i - r0] = mx + std::log(sum);
      }
      // This part's output of each row; rows that see none of its keys are not read below.
      for (int i = r0; i < r1; i += kTileRows) {
        const int n = std::min(kTileRows, r1 - i);
        const std::array<int, 2> w = run_widths(p, runs, i, i + n);
        for (int k = 0; k < 2; k++)
          if (w[k] > 0)
            product_rows<T>(n, S.data() + (i - r0) * SW + pp.column[k], SW, 1, w[k],
                            V + pp.columns[k], int64_t(pp.length(k)) * L, pp.head_panels,
                            O.data() + int64_t(i - r0) * pp.padded_hs, pp.padded_hs, T(1),
                            k == 1 && w[0] > 0);
      }
      // The online softmax: out and lse so far (over earlier parts) and this part's, weighted
      // by their shares of the combined normaliser.
      for (int i = r0; i < r1; i++) {
        const T lp = part_lse[i - r0];
        T* o = Out + int64_t(i) * C;
        const T* op = O.data() + int64_t(i - r0) * pp.padded_hs;
        if (p.first) {
          Lse[i] = lp;
          const T inv = std::isinf(lp) ? T(0) : inv_sum[i - r0];
          for (int e = 0; e < hs; e++) o[e] = inv * op[e];
          continue;
        }
        if (std::isinf(lp)) continue;
        const T lo = Lse[i], hi = std::max(lo, lp);
        const T combined = hi + std::log(std::exp(lo - hi) + std::exp(lp - hi));
        const T keep = std::exp(lo - combined), add = std::exp(lp - combined) * inv_sum[i - r0];
        for (int e = 0; e < hs; e++) o[e] = keep * o[e] + add * op[e];
        Lse[i] = combined;
      }
    }
  }
}

namespace {

// The gradients of one part (see attention_part_backward), added to dq and dkv, or written over
// their columns (`overwrite`, the causal attention, where this is the only part). Threads split
// over key/value heads: each owns its dK and dV (and its group's dQ), so no two write one
// gradient. Each block of kBlock query rows meets the keys block by block (FlashAttention-2's
// tiling): a pair's scores, probabilities and their gradients are kBlock x kBlock and stay in
// L1/L2 with the rows of Q, dO and dQ they meet; only the packed keys and values and the dK and
// dV accumulators span the sequence.
template <class T>
void part_backward(T* dq, T* dkv, const T* dout, const T* q, const T* kv, const T* out,
                   const T* lse, const AttentionPart& p, bool overwrite) {
  const QkvLayout l(p.C, p.NH, p.NKV);
  const PartPanels<T> pp(p);
  const int hs = l.hs, T_ = p.T, C = p.C, L = pp.lanes, hsp = pp.padded_hs;
  const int64_t W = l.width;
  const T scale = T(1) / std::sqrt(T(hs));
  const auto& runs = pp.runs;
  // Each task takes a slice of a key/value head's query heads; with more than one slice a head,
  // each slice accumulates its dK and dV in `slices` (rows as the tiles write them), summed in
  // slice order after the loop; with one, in the thread's own dK and dV.
  const int split = attention_backward_split(p.B * p.NKV, l.group, omp_get_max_threads());
  const int64_t slice_elems = 2 * int64_t(T_) * hsp;  // a slice's dK rows, then its dV rows
  std::vector<T> slices(split > 1 ? size_t(p.B) * p.NKV * split * slice_elems : 0);
  // D = dO . O of each row and query head ([b][i][h]), in one pass over whole rows in order:
  // read head by head inside the blocks below, these rows came from memory and the products
  // waited for them (8% of the backward in a profile of W-L's shape).
  const std::unique_ptr<T[]> dots(new T[size_t(p.B) * T_ * p.NH]);
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t row = 0; row < int64_t(p.B) * T_; row++)
      for (int h = 0; h < p.NH; h++)
        dots[row * p.NH + h] = dot_row(dout + row * C + h * hs, out + row * C + h * hs, hs);
    std::vector<T> keys_t(pp.transposed_size()), keys(pp.columns_size()),
        values_t(pp.transposed_size()), P(size_t(kBlock) * kBlock), dP(P.size()),
        dq_rows(size_t(kBlock) * hsp), queries(dq_rows.size()), douts(dq_rows.size()),
        dK(split > 1 ? 0 : pp.columns_size()), dV(dK.size());
    std::vector<int> seen(kBlock);
#pragma omp for schedule(static)
    for (int task = 0; task < p.B * p.NKV * split; task++) {
      const int bkv = task / split, slice = task % split;
      const int b = bkv / p.NKV, kvh = bkv % p.NKV;
      const int64_t row0 = int64_t(b) * T_ * W;
      const T *K = kv + row0 + l.keys + int64_t(kvh) * hs,
              *V = kv + row0 + l.values + int64_t(kvh) * hs;
      pp.pack_transposed(keys_t.data(), K, W);
      pp.pack_columns(keys.data(), K, W);
      pp.pack_transposed(values_t.data(), V, W);
      T* dK_acc = split > 1 ? slices.data() + task * slice_elems : dK.data();
      T* dV_acc = split > 1 ? dK_acc + int64_t(T_) * hsp : dV.data();
      std::fill_n(dK_acc, int64_t(T_) * hsp, T(0));
      std::fill_n(dV_acc, int64_t(T_) * hsp, T(0));
      for (int g = slice * l.group / split; g < (slice + 1) * l.group / split; g++) {
        const int h = kvh * l.group + g;
        const T* Q = q + row0 + l.query_column(h);
        T* dQ = dq + row0 + l.query_column(h);
        const T* dO = dout + int64_t(b) * T_ * C + int64_t(h) * hs;
        const T* D = dots.get() + int64_t(b) * T_ * p.NH + h;  // row i's at D[i * NH]
        const T* Lse = lse + (int64_t(b) * p.NH + h) * T_;
        for (int r0 = 0; r0 < T_; r0 += kBlock) {
          const int r1 = std::min(T_, r0 + kBlock), n = r1 - r0;
          pack_column_panels(queries.data(), Q + r0 * W, W, n, hs);
          pack_column_panels(douts.data(), dO + int64_t(r0) * C, C, n, hs);
          std::fill(dq_rows.begin(), dq_rows.end(), T(0));
          for (int k = 0; k < 2; k++)
            for (int c0 = runs[k].begin; c0 < runs[k].end; c0 += kBlock) {
              const int nk = std::min(kBlock, runs[k].end - c0);
              // How many of the block's keys each row sees; the products cover `widest`.
              int widest = 0;
              for (int i = r0; i < r1; i++) {
                seen[i - r0] = std::clamp(
                    runs[k].visible(p.queries.position(i)) - (c0 - runs[k].begin), 0, nk);
                widest = std::max(widest, seen[i - r0]);
              }
              if (widest == 0) continue;
              // How many keys row i sees, and the most any of rows [i, i + m) sees.
              auto seen_by = [&](int i) { return seen[i - r0]; };
              auto group_width = [&](int i, int m) {
                return *std::max_element(seen.begin() + (i - r0), seen.begin() + (i - r0 + m));
              };
              const T* kt = keys_t.data() + pp.transposed[k] + int64_t(c0 - runs[k].begin) * hs;
              const T* vt = values_t.data() + pp.transposed[k] + int64_t(c0 - runs[k].begin) * hs;
              const T* kc = keys.data() + pp.columns[k] + int64_t(c0 - runs[k].begin) * L;
              const int64_t kc_stride = int64_t(pp.length(k)) * L;
              // S = scale Q K^T and dP = dO V^T over the keys each group of rows sees.
              for (int i = r0; i < r1; i += kTileRows) {
                const int m = std::min(kTileRows, r1 - i), w = group_width(i, m);
                if (w == 0) continue;
                const int64_t at = int64_t(i - r0) * kBlock;
                product_rows<T>(m, Q + i * W, W, 1, hs, kt, int64_t(hs) * L, ceil_div(w, L),
                                P.data() + at, kBlock, scale, false);
                product_rows<T>(m, dO + int64_t(i) * C, C, 1, hs, vt, int64_t(hs) * L,
                                ceil_div(w, L), dP.data() + at, kBlock, T(1), false);
              }
              // P = exp(S - lse) (the whole attention's probabilities) and dS = P (dP - D) in
              // place of dP, D = dO . O; 0 past what the row sees.
              for (int i = r0; i < r1; i++) {
                T *pr = P.data() + int64_t(i - r0) * kBlock,
                  *d = dP.data() + int64_t(i - r0) * kBlock;
                const int s = seen_by(i);
                softmax_backward_from_scores(pr, d, s, Lse[i], D[int64_t(i) * p.NH]);
                std::fill(pr + s, pr + widest, T(0));
                std::fill(d + s, d + widest, T(0));
              }
              // dQ += scale dS K.
              for (int i = r0; i < r1; i += kTileRows) {
                const int m = std::min(kTileRows, r1 - i), w = group_width(i, m);
                if (w > 0)
                  product_rows<T>(m, dP.data() + int64_t(i - r0) * kBlock, kBlock, 1, w, kc,
                                  kc_stride, pp.head_panels, dq_rows.data() + int64_t(i - r0) * hsp,
                                  hsp, scale, true);
              }
              // dK += scale dS^T Q and dV += P^T dO, each group of keys over the rows from the
              // first that sees one of them (the rest of the rows are zeros there).
              for (int j = 0; j < widest; j += kTileRows) {
                const int m = std::min(kTileRows, widest - j);
                int first = 0;
                while (seen[first] <= j) first++;
                const int64_t key = c0 + j;
                product_rows<T>(m, dP.data() + int64_t(first) * kBlock + j, 1, kBlock, n - first,
                                queries.data() + int64_t(first) * L, int64_t(n) * L, pp.head_panels,
                                dK_acc + key * hsp, hsp, scale, true);
                product_rows<T>(m, P.data() + int64_t(first) * kBlock + j, 1, kBlock, n - first,
                                douts.data() + int64_t(first) * L, int64_t(n) * L, pp.head_panels,
                                dV_acc + key * hsp, hsp, T(1), true);
              }
            }
          for (int i = r0; i < r1; i++) {
            const T* rows = dq_rows.data() + int64_t(i - r0) * hsp;
            T* d = dQ + int64_t(i) * W;
            if (overwrite)
              std::copy_n(rows, hs, d);
            else
              for (int e = 0; e < hs; e++) d[e] += rows[e];
          }
        }
      }
      if (split > 1) continue;  // summed below
      T *dKout = dkv + row0 + l.keys + int64_t(kvh) * hs,
        *dVout = dkv + row0 + l.values + int64_t(kvh) * hs;
      for (int j = 0; j < T_; j++) {
        const T *k = dK.data() + int64_t(j) * hsp, *v = dV.data() + int64_t(j) * hsp;
        if (overwrite) {
          std::copy_n(k, hs, dKout + j * W);
          std::copy_n(v, hs, dVout + j * W);
        } else {
          for (int e = 0; e < hs; e++) {
            dKout[j * W + e] += k[e];
            dVout[j * W + e] += v[e];
          }
        }
      }
    }
    if (split > 1) {
      // Row j of key/value head bkv's dK (or dV: rows T_ + j) is the sum of its slices' rows.
#pragma omp for schedule(static)
      for (int64_t row = 0; row < int64_t(p.B) * p.NKV * 2 * T_; row++) {
        const int bkv = int(row / (2 * T_)), r = int(row % (2 * T_));
        const int b = bkv / p.NKV, kvh = bkv % p.NKV, j = r % T_;
        T* dst = dkv + int64_t(b) * T_ * W + int64_t(j) * W + (r < T_ ? l.keys : l.values) +
                 int64_t(kvh) * hs;
        const T* src = slices.data() + int64_t(bkv) * split * slice_elems + int64_t(r) * hsp;
        for (int e = 0; e < hs; e++) {
          T sum = overwrite ? T(0) : dst[e];
          for (int sl = 0; sl < split; sl++) sum += src[sl * slice_elems + e];
          dst[e] = sum;
        }
      }
    }
  }
}

// Causal attention over a whole sequence is one part: the queries' own keys, at the same
// positions.
AttentionPart causal_part(int B, int T_, int C, int NH, int NKV, bool first) {
  const TokenChunks whole{T_, 0, 0};
  return {B, T_, C, NH, NKV, whole, whole, first};
}

}  // namespace

template <class T>
void attention_part_backward(T* dq, T* dkv, const T* dout, const T* q, const T* kv, const T* out,
                             const T* lse, const AttentionPart& p) {
  part_backward(dq, dkv, dout, q, kv, out, lse, p, false);
}

template <class T>
void attention_forward(T* out, T* lse, const T* qkv, int B, int T_, int C, int NH, int NKV) {
  attention_part_forward(out, lse, qkv, qkv, causal_part(B, T_, C, NH, NKV, true));
}

template <class T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const T* lse, int B,
                        int T_, int C, int NH, int NKV) {
  part_backward(dqkv, dqkv, dout, qkv, qkv, out, lse, causal_part(B, T_, C, NH, NKV, false), true);
}

#define INSTANTIATE(T)                                                                           \
  template void attention_forward<T>(T*, T*, const T*, int, int, int, int, int);                 \
  template void attention_backward<T>(T*, const T*, const T*, const T*, const T*, int, int, int, \
                                      int, int);                                                 \
  template void attention_inference<T>(T*, const T*, int, int, int, int, int);                   \
  template void attention_part_forward<T>(T*, T*, const T*, const T*, const AttentionPart&);     \
  template void attention_part_backward<T>(T*, T*, const T*, const T*, const T*, const T*,       \
                                           const T*, const AttentionPart&);
INSTANTIATE(float)
INSTANTIATE(double)

}  // namespace trainer::cpu
