#include "comm/compression.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>

#include "kernels/half.h"

namespace trainer {
namespace {

constexpr int64_t kChunk = 256;  // elements per scale (int8, onebit)
int64_t chunks(int64_t n) {
  return (n + kChunk - 1) / kChunk;
}

// What an encoding dropped, kept for the next exchange: residual = corrected - sent (residual
// may be corrected). A non-finite value (an fp16 overflow, a fault: the step is skipped) leaves
// no residual: kept, it would make every later step's values non-finite too.
void keep_dropped(float* residual, const float* corrected, const float* sent, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    const float r = corrected[i] - sent[i];
    residual[i] = std::isfinite(r) ? r : 0.0f;
  }
}

// Error feedback around an exchange: the residual is added before compressing, and what this
// rank's compressed contribution did not carry becomes the next residual.
class FeedbackCompressor : public Compressor {
 public:
  FeedbackCompressor(bool error_feedback, int64_t n)
      : error_feedback_(error_feedback), residual_(n, 0.0f), mine_(n) {}
  void all_reduce(Communicator& group, float* g, int64_t n) final {
    // With feedback the residual first holds the corrected gradients, then what was dropped.
    if (error_feedback_)
      for (int64_t i = 0; i < n; i++) residual_[i] = g[i] += residual_[i];
    exchange(group, g, n, mine_.data());
    if (error_feedback_) keep_dropped(residual_.data(), residual_.data(), mine_.data(), n);
  }
  std::vector<float> residual() const override { return residual_; }
  void save_state(float* out) const final {
    if (error_feedback_) out = std::copy(residual_.begin(), residual_.end(), out);
    save_method_state(out);
  }
  int64_t state_size() const final {
    return (error_feedback_ ? int64_t(residual_.size()) : 0) + method_state_size();
  }
  void set_state(const float* values) final {
    if (error_feedback_) std::copy(values, values + residual_.size(), residual_.begin());
    load_method_state(values + (error_feedback_ ? residual_.size() : 0));
  }

 protected:
  virtual int64_t method_state_size() const { return 0; }
  virtual void save_method_state(float*) const {}
  virtual void load_method_state(const float*) {}
  // g(n): this rank's (corrected) gradients in, the sum over the group out; mine(n): what this
  // rank's compressed contribution decodes to.
  virtual void exchange(Communicator& group, float* g, int64_t n, float* mine) = 0;

 private:
  bool error_feedback_;
  std::vector<float> residual_, mine_;
};

// fp16 / bf16: cast, all-reduce in 16 bits (summed in fp32 and rounded), widen.
template <class H>
class CastCompressor final : public FeedbackCompressor {
 public:
  using FeedbackCompressor::FeedbackCompressor;

 private:
  void exchange(Communicator& group, float* g, int64_t n, float* mine) override {
    std::vector<H> h(n);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
      if constexpr (std::is_same_v<H, bf16>) {
        h[i] = to_bf16(g[i]);
        mine[i] = to_float(h[i]);
      } else {
        const _Float16 x = _Float16(g[i]);  // = to_f16, in F16C instructions
        h[i] = std::bit_cast<f16>(x);
        mine[i] = float(x);
      }
    }
    group.all_reduce(host_ptr(h.data()), n, ReduceOp::sum);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) g[i] = to_float(h[i]);
  }
};

// Methods whose messages cannot be summed on the wire. Exact elements are taken out first and
// all-reduced as they are; the message packs the rest. Then, in a group of two (or for top-k),
// every rank's message is all-gathered and each rank decodes and adds them all, in rank order:
// (p - 1) messages a rank, which grows with the group. In a larger group (int8, onebit), the
// exchange is in two phases whose bytes do not (1-bit Adam's compressed all-reduce, Tang et al.
// 2021): the values are cut into p parts at chunk boundaries, each encoded on its own; part j of
// every rank's message goes to rank j (a scatter), which decodes and sums them in rank order,
// adds its own residual of that part (server-side error feedback), encodes the sum again and
// keeps what that dropped; the parts' sums are all-gathered and decoded by every rank. A rank
// sends 2 (p - 1) / p messages' worth, as a ring all-reduce does (in a group of two, the same as
// the all-gather, which is exact, so it is kept there).
class GatherCompressor : public FeedbackCompressor {
 public:
  GatherCompressor(bool error_feedback, int64_t n, const std::vector<ExactRange>& exact,
                   GroupPlace group, bool by_parts)
      : FeedbackCompressor(error_feedback, n), exact_(n, 0), group_(group) {
    for (const ExactRange& r : exact)
      std::fill(exact_.begin() + r.offset, exact_.begin() + r.offset + r.count, 1);
    packed_ = n - std::count(exact_.begin(), exact_.end(), 1);
    if (by_parts && group.size > 2) {
      const int64_t c = chunks(packed_);
      for (int j = 0; j <= group.size; j++)
        part_.push_back(std::min(packed_, c * j / group.size * kChunk));
      if (error_feedback) server_residual_.assign(size_t(part_len(group.rank)), 0.0f);
    }
  }
  // Besides its own residual, on the part it sums for the group a rank holds what encoding that
  // sum dropped: the group's residuals add up to everything not yet delivered.
  std::vector<float> residual() const override {
    std::vector<float> r = FeedbackCompressor::residual();
    if (server_residual_.empty()) return r;
    const int64_t lo = part_[group_.rank], hi = part_[group_.rank + 1];
    for (int64_t i = 0, j = 0; i < int64_t(exact_.size()) && j < hi; i++)
      if (!exact_[i] && j++ >= lo) r[i] += server_residual_[j - 1 - lo];
    return r;
  }

 protected:
  int64_t packed() const { return packed_; }  // the elements the message carries
  // v(n) zeroed at the message's elements `at` (ascending, in the message's order).
  void zero_packed(const std::vector<int32_t>& at, float* v) const {
    if (packed_ == int64_t(exact_.size())) {
      for (int32_t j : at) v[j] = 0;
      return;
    }
    size_t next = 0;
    for (int64_t i = 0, j = 0; i < int64_t(exact_.size()) && next < at.size(); i++)
      if (!exact_[i] && j++ == at[next]) {
        v[i] = 0;
        next++;
      }
  }
  virtual int64_t message_bytes(int64_t n) const = 0;
  virtual void encode(const float* g, int64_t n, std::byte* msg) = 0;
  virtual void add_decoded(const std::byte* msg, int64_t n, float* out) const = 0;

 private:
  int64_t method_state_size() const override { return int64_t(server_residual_.size()); }
  void save_method_state(float* s) const override {
    std::copy(server_residual_.begin(), server_residual_.end(), s);
  }
  void load_method_state(const float* s) override {
    std::copy_n(s, server_residual_.size(), server_residual_.begin());
  }
  int64_t part_len(int j) const { return part_[j + 1] - part_[j]; }

  void exchange(Communicator& group, float* g, int64_t n, float* mine) override {
    if (group.size() != group_.size || group.rank() != group_.rank)
      throw std::logic_error(
          fmt::format("GatherCompressor: made for rank {} of {}, exchanging as rank {} of {}",
                      group_.rank, group_.size, group.rank(), group.size()));
    if (packed_ == n) return exchange_packed(group, g, n, mine);
    std::vector<float> rest, exact, rest_mine(packed_);
    for (int64_t i = 0; i < n; i++) (exact_[i] ? exact : rest).push_back(g[i]);
    for (int64_t i = 0; i < n; i++)
      if (exact_[i]) mine[i] = g[i];
    group.all_reduce(host_ptr(exact.data()), int64_t(exact.size()), ReduceOp::sum);
    if (packed_ > 0) exchange_packed(group, rest.data(), packed_, rest_mine.data());
    for (int64_t i = 0, e = 0, r = 0; i < n; i++) {
      if (exact_[i]) {
        g[i] = exact[e++];
      } else {
        mine[i] = rest_mine[r];
        g[i] = rest[r++];
      }
    }
  }
  void exchange_packed(Communicator& group, float* g, int64_t n, float* mine) {
    if (!part_.empty()) return exchange_by_parts(group, g, mine);
    const int64_t bytes = message_bytes(n);
    std::vector<std::byte> all(bytes * group.size());
    std::byte* own = all.data() + bytes * group.rank();
    encode(g, n, own);
    std::fill(mine, mine + n, 0.0f);
    add_decoded(own, n, mine);
    group.all_gather(host_ptr(own), host_ptr(all.data()), bytes);
    std::fill(g, g + n, 0.0f);
    for (int r = 0; r < group.size(); r++) add_decoded(all.data() + bytes * r, n, g);
  }
  void exchange_by_parts(Communicator& group, float* g, float* mine) {
    const int p = group_.size, me = group_.rank;
    constexpr int kTag = 7301;
    // Every part encoded on its own (their chunks are the whole message's): part j for rank j.
    std::vector<int64_t> at(p + 1, 0);
    for (int j = 0; j < p; j++) at[j + 1] = at[j] + message_bytes(part_len(j));
    std::vector<std::byte> out(size_t(at[p]));
    std::fill(mine, mine + packed_, 0.0f);
    for (int j = 0; j < p; j++) {
      encode(g + part_[j], part_len(j), out.data() + at[j]);
      add_decoded(out.data() + at[j], part_len(j), mine + part_[j]);
    }
    // The scatter: each rank's message of this rank's part.
    const int64_t len = part_len(me), bytes = message_bytes(len);
    std::vector<std::byte> in(size_t(bytes * p));
    std::copy_n(out.data() + at[me], bytes, in.data() + bytes * me);
    std::vector<Request> pending;
    for (int r = 0; r < p; r++)
      if (r != me) {
        pending.push_back(group.irecv(host_ptr(in.data() + bytes * r), bytes, r, kTag));
        pending.push_back(group.isend(host_ptr(out.data() + at[r]), at[r + 1] - at[r], r, kTag));
      }
    for (Request& q : pending) q.wait();
    // The part's sum, in rank order, with what its last encoding dropped; encoded again.
    std::vector<float> sum(size_t(len), 0.0f);
    for (int r = 0; r < p; r++) add_decoded(in.data() + bytes * r, len, sum.data());
    int64_t widest = 0;
    for (int j = 0; j < p; j++) widest = std::max(widest, at[j + 1] - at[j]);
    std::vector<std::byte> all(size_t(widest * p));
    std::byte* own = all.data() + widest * me;
    if (!server_residual_.empty())
      for (int64_t i = 0; i < len; i++) sum[i] += server_residual_[i];
    encode(sum.data(), len, own);
    if (!server_residual_.empty()) {
      std::vector<float> sent(size_t(len), 0.0f);
      add_decoded(own, len, sent.data());
      keep_dropped(server_residual_.data(), sum.data(), sent.data(), len);
    }
    // The sums, gathered: every rank decodes the same messages.
    group.all_gather(host_ptr(own), host_ptr(all.data()), widest);
    std::fill(g, g + packed_, 0.0f);
    for (int j = 0; j < p; j++) add_decoded(all.data() + widest * j, part_len(j), g + part_[j]);
  }
  std::vector<char> exact_;  // per element: summed exactly
  int64_t packed_;
  GroupPlace group_;
  std::vector<int64_t> part_;           // the two-phase exchange's parts (p + 1 bounds), or none
  std::vector<float> server_residual_;  // of this rank's part
};

// int8 with one absmax scale per chunk: [scales: float x chunks][values: int8 x n].
class Int8Compressor final : public GatherCompressor {
 public:
  Int8Compressor(bool error_feedback, int64_t n, const std::vector<ExactRange>& exact,
                 GroupPlace group, bool two_phase)
      : GatherCompressor(error_feedback, n, exact, group, two_phase) {}

 private:
  int64_t message_bytes(int64_t n) const override { return 4 * chunks(n) + n; }
  void encode(const float* g, int64_t n, std::byte* msg) override {
    float* scales = reinterpret_cast<float*>(msg);
    int8_t* q = reinterpret_cast<int8_t*>(msg + 4 * chunks(n));
    for (int64_t c = 0; c < chunks(n); c++) {
      const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
      float amax = 0;
      bool finite = true;
      for (int64_t i = lo; i < hi; i++) {
        amax = std::max(amax, std::abs(g[i]));
        finite = finite && std::isfinite(g[i]);
      }
      // A non-finite value (an overflow: the step is to be skipped) makes its chunk NaN, which
      // a sum of the decoded chunks (in two phases, encoded again) cannot lose.
      const float scale = finite ? amax / 127.0f : NAN;
      const float inv = finite && amax > 0 ? 127.0f / amax : 0.0f;
      std::memcpy(&scales[c], &scale, 4);
      for (int64_t i = lo; i < hi; i++) q[i] = int8_t(std::lrint(g[i] * inv));
    }
  }
  void add_decoded(const std::byte* msg, int64_t n, float* out) const override {
    const std::byte* q = msg + 4 * chunks(n);
    for (int64_t c = 0; c < chunks(n); c++) {
      float scale;
      std::memcpy(&scale, msg + 4 * c, 4);
      const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
      for (int64_t i = lo; i < hi; i++) out[i] += scale * float(int8_t(q[i]));
    }
  }
};

// One bit per element (the sign) and one scale per chunk (the mean magnitude):
// [scales: float x chunks][bits: ceil(n / 8) bytes].
class OneBitCompressor final : public GatherCompressor {
 public:
  OneBitCompressor(bool error_feedback, int64_t n, const std::vector<ExactRange>& exact,
                   GroupPlace group, bool two_phase)
      : GatherCompressor(error_feedback, n, exact, group, two_phase) {}

 private:
  int64_t message_bytes(int64_t n) const override { return 4 * chunks(n) + (n + 7) / 8; }
  void encode(const float* g, int64_t n, std::byte* msg) override {
    uint8_t* bits = reinterpret_cast<uint8_t*>(msg + 4 * chunks(n));
    std::fill(bits, bits + (n + 7) / 8, 0);
    for (int64_t c = 0; c < chunks(n); c++) {
      const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
      double sum = 0;
      for (int64_t i = lo; i < hi; i++) sum += std::abs(g[i]);
      const float scale = float(sum / double(hi - lo));
      std::memcpy(msg + 4 * c, &scale, 4);
      for (int64_t i = lo; i < hi; i++)
        if (g[i] >= 0) bits[i / 8] |= uint8_t(1u << (i % 8));
    }
  }
  void add_decoded(const std::byte* msg, int64_t n, float* out) const override {
    const uint8_t* bits = reinterpret_cast<const uint8_t*>(msg + 4 * chunks(n));
    for (int64_t c = 0; c < chunks(n); c++) {
      float scale;
      std::memcpy(&scale, msg + 4 * c, 4);
      const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
      for (int64_t i = lo; i < hi; i++) out[i] += (bits[i / 8] >> (i % 8)) & 1 ? scale : -scale;
    }
  }
};

// The k largest magnitudes: [indices: int32 x k][values: float x k]. All-gathered in any group
// (DGC's exchange): the sum of p sparse messages is up to p times denser, so a part's sum would
// not fit one message of k.
class TopKCompressor final : public GatherCompressor {
 public:
  TopKCompressor(bool error_feedback, int64_t n, double ratio, const std::vector<ExactRange>& exact,
                 GroupPlace group)
      : GatherCompressor(error_feedback, n, exact, group, false) {
    set_ratio(ratio);
  }
  void set_ratio(double ratio) override {
    k_ = std::clamp<int64_t>(int64_t(std::llround(ratio * double(packed()))), 1,
                             std::max<int64_t>(1, packed()));
  }
  void mask_sent(float* v) const override { zero_packed(sent_, v); }

 private:
  int64_t message_bytes(int64_t) const override { return 8 * k_; }
  void encode(const float* g, int64_t n, std::byte* msg) override {
    order_.resize(n);
    std::iota(order_.begin(), order_.end(), 0);
    std::nth_element(order_.begin(), order_.begin() + (k_ - 1), order_.end(),
                     [&](int32_t a, int32_t b) {  // ties by index: the same choice every time
                       // NaN first, as inf: an overflow must reach the sum (the step is skipped).
                       const auto size = [](float v) {
                         return std::isnan(v) ? INFINITY : std::abs(v);
                       };
                       const float x = size(g[a]), y = size(g[b]);
                       return x > y || (x == y && a < b);
                     });
    std::sort(order_.begin(), order_.begin() + k_);
    sent_.assign(order_.begin(), order_.begin() + k_);
    for (int64_t j = 0; j < k_; j++) {
      const int32_t i = order_[j];
      std::memcpy(msg + 4 * j, &i, 4);
      std::memcpy(msg + 4 * (k_ + j), &g[i], 4);
    }
  }
  void add_decoded(const std::byte* msg, int64_t, float* out) const override {
    for (int64_t j = 0; j < k_; j++) {
      int32_t i;
      float v;
      std::memcpy(&i, msg + 4 * j, 4);
      std::memcpy(&v, msg + 4 * (k_ + j), 4);
      out[i] += v;
    }
  }
  int64_t k_ = 1;
  std::vector<int32_t> order_, sent_;  // sent_: the last message's elements, in packed order
};

// PowerSGD: each weight matrix M (m x c) is approximated by P Q^T of rank r (powersgd_rank, or
// its own from powersgd_budget: a large matrix gains more from each rank than a small). One power
// iteration per step from the previous step's Q: P = M Q, summed over ranks, orthonormalised;
// Q = M^T P, summed. The sum over ranks of M is then P Q^T; this rank's own share is
// P (M^T P)^T, the projection of its M on P's columns. Everything else in the bucket (vectors,
// matrices too small to gain, the partial rows where the bucket's edges cut a matrix, matrices
// with exact elements) is all-reduced as is.
class PowerSgdCompressor final : public FeedbackCompressor {
 public:
  PowerSgdCompressor(const CompressionOptions& o, int64_t n, const std::vector<MatrixView>& all,
                     const std::vector<ExactRange>& exact)
      : FeedbackCompressor(o.error_feedback, n), plain_(n, 1) {
    for (const MatrixView& m : all) {
      const double fits = o.powersgd_budget * double(m.rows * m.cols) / double(m.rows + m.cols);
      const int rank = o.powersgd_budget > 0 ? std::max(1, int(fits)) : o.powersgd_rank;
      if (std::min(m.rows, m.cols) <= 2 * rank) continue;  // (m + c) r would not be smaller
      // A copy elsewhere (a tied embedding's other end) sits at another place in its bucket,
      // where the initial Q would differ.
      const auto overlaps = [&](const ExactRange& r) {
        return r.offset < m.offset + m.rows * m.cols && m.offset < r.offset + r.count;
      };
      if (std::any_of(exact.begin(), exact.end(), overlaps)) continue;
      matrices_.push_back(m);
      ranks_.push_back(rank);
      std::fill(plain_.begin() + m.offset, plain_.begin() + m.offset + m.rows * m.cols, 0);
      // The same initial Q on every rank: a function of the seed and the matrix's place.
      std::mt19937_64 rng(o.seed * 1000003 + uint64_t(m.offset));
      std::normal_distribution<float> normal;
      std::vector<float> q(m.cols * rank);
      for (float& x : q) x = normal(rng);
      q_.push_back(std::move(q));
    }
  }

 private:
  int64_t method_state_size() const override {
    int64_t n = 0;
    for (const std::vector<float>& q : q_) n += int64_t(q.size());
    return n;
  }
  void save_method_state(float* out) const override {
    for (const std::vector<float>& q : q_) out = std::copy(q.begin(), q.end(), out);
  }
  void load_method_state(const float* in) override {
    for (std::vector<float>& q : q_) {
      std::copy(in, in + q.size(), q.begin());
      in += q.size();
    }
  }

  void exchange(Communicator& group, float* g, int64_t n, float* mine) override {
    // Round 1: P = M Q for every matrix, one all-reduce for all of them.
    int64_t p_total = 0, q_total = 0;
    for (size_t k = 0; k < matrices_.size(); k++)
      p_total += matrices_[k].rows * ranks_[k], q_total += matrices_[k].cols * ranks_[k];
    std::vector<float> p(p_total), q(q_total), q_mine(q_total);
    int64_t po = 0;
    for (size_t k = 0; k < matrices_.size(); k++) {
      const MatrixView& m = matrices_[k];
      matmul(g + m.offset, m.rows, m.cols, q_[k].data(), ranks_[k], p.data() + po);
      po += m.rows * ranks_[k];
    }
    group.all_reduce(host_ptr(p.data()), p_total, ReduceOp::sum);
    // Round 2: orthonormal P, Q = M^T P; the rest of the bucket travels with the Qs.
    std::vector<float> rest;
    for (int64_t i = 0; i < n; i++)
      if (plain_[i]) rest.push_back(g[i]);
    po = 0;
    int64_t qo = 0;
    for (size_t k = 0; k < matrices_.size(); k++) {
      const MatrixView& m = matrices_[k];
      const int r = ranks_[k];
      orthonormalize(p.data() + po, m.rows, r);
      matmul_t(g + m.offset, m.rows, m.cols, p.data() + po, r, q.data() + qo);
      po += m.rows * r;
      qo += m.cols * r;
    }
    q_mine = q;
    std::vector<float> message(q);
    message.insert(message.end(), rest.begin(), rest.end());
    group.all_reduce(host_ptr(message.data()), int64_t(message.size()), ReduceOp::sum);
    // Decode: the sum P Q^T and this rank's share P Q_mine^T; the rest as it came.
    for (int64_t i = 0, j = q_total; i < n; i++)
      if (plain_[i]) {
        mine[i] = g[i];
        g[i] = message[j++];
      }
    po = 0;
    qo = 0;
    for (size_t k = 0; k < matrices_.size(); k++) {
      const MatrixView& m = matrices_[k];
      const int r = ranks_[k];
      outer(p.data() + po, message.data() + qo, m.rows, m.cols, r, g + m.offset);
      outer(p.data() + po, q_mine.data() + qo, m.rows, m.cols, r, mine + m.offset);
      // The next step starts from this Q (warm start), unless a non-finite gradient made it so.
      const auto q_begin = message.begin() + qo, q_end = q_begin + m.cols * r;
      if (std::all_of(q_begin, q_end, [](float x) { return std::isfinite(x); }))
        std::copy(q_begin, q_end, q_[k].begin());
      po += m.rows * r;
      qo += m.cols * r;
    }
  }

  // out(rows x r) = M(rows x cols) x Q(cols x r)
  static void matmul(const float* M, int64_t rows, int64_t cols, const float* Q, int r,
                     float* out) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++)
      for (int j = 0; j < r; j++) {
        double s = 0;
        for (int64_t c = 0; c < cols; c++) s += double(M[i * cols + c]) * Q[c * r + j];
        out[i * r + j] = float(s);
      }
  }
  // out(cols x r) = M^T P
  static void matmul_t(const float* M, int64_t rows, int64_t cols, const float* P, int r,
                       float* out) {
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < cols; c++)
      for (int j = 0; j < r; j++) {
        double s = 0;
        for (int64_t i = 0; i < rows; i++) s += double(M[i * cols + c]) * P[i * r + j];
        out[c * r + j] = float(s);
      }
  }
  // out(rows x cols) = P(rows x r) Q(cols x r)^T
  static void outer(const float* P, const float* Q, int64_t rows, int64_t cols, int r, float* out) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++)
      for (int64_t c = 0; c < cols; c++) {
        float s = 0;
        for (int j = 0; j < r; j++) s += P[i * r + j] * Q[c * r + j];
        out[i * cols + c] = s;
      }
  }
  // Gram-Schmidt on the r columns of P (rows x r), each projection removed twice ("twice is
  // enough": once, a column nearly in the span of the others keeps a rounding residue that,
  // normalised, points back into that span, and its rank is counted twice). A column with
  // nothing left of its own (under 1e-5 of its length: a gradient of lower rank than r) becomes
  // zero.
  static void orthonormalize(float* P, int64_t rows, int r) {
    auto squared = [&](int j) {
      double s = 0;
      for (int64_t i = 0; i < rows; i++) s += double(P[i * r + j]) * P[i * r + j];
      return s;
    };
    for (int j = 0; j < r; j++) {
      const double before = squared(j);
      for (int pass = 0; pass < 2; pass++)
        for (int k = 0; k < j; k++) {
          double dot = 0;
          for (int64_t i = 0; i < rows; i++) dot += double(P[i * r + j]) * P[i * r + k];
          for (int64_t i = 0; i < rows; i++) P[i * r + j] -= float(dot) * P[i * r + k];
        }
      const double norm = squared(j);
      const float inv = norm > 1e-30 && norm > 1e-10 * before ? float(1.0 / std::sqrt(norm)) : 0.0f;
      for (int64_t i = 0; i < rows; i++) P[i * r + j] *= inv;
    }
  }

  std::vector<MatrixView> matrices_;
  std::vector<int> ranks_;             // per matrix
  std::vector<std::vector<float>> q_;  // warm start, per matrix
  std::vector<char> plain_;            // elements sent uncompressed
};

}  // namespace

void Compressor::set_ratio(double) {
  throw std::logic_error("Compressor::set_ratio: only top-k keeps a fraction of the values");
}

void Compressor::mask_sent(float*) const {
  throw std::logic_error("Compressor::mask_sent: only top-k sends some of the values");
}

std::unique_ptr<Compressor> make_compressor(const CompressionOptions& o, int64_t n,
                                            const std::vector<MatrixView>& matrices,
                                            const std::vector<ExactRange>& exact,
                                            GroupPlace group) {
  const bool ef = o.error_feedback;
  if (o.method == "fp16") return std::make_unique<CastCompressor<f16>>(ef, n);
  if (o.method == "bf16") return std::make_unique<CastCompressor<bf16>>(ef, n);
  if (o.method == "int8") return std::make_unique<Int8Compressor>(ef, n, exact, group, o.two_phase);
  if (o.method == "onebit")
    return std::make_unique<OneBitCompressor>(ef, n, exact, group, o.two_phase);
  if (o.method == "topk")
    return std::make_unique<TopKCompressor>(ef, n, o.topk_ratio, exact, group);
  if (o.method == "powersgd") return std::make_unique<PowerSgdCompressor>(o, n, matrices, exact);
  throw std::invalid_argument("unknown compression method " + o.method);
}

}  // namespace trainer
