// Causal grouped-query attention on the CPU backend (kernels/cpu/attention.cpp) against a naive
// double-precision reference: the training forward (output and each row's log-sum-exp) and
// backward, ring attention's parts, 16-bit storage, and generation over a key/value cache.
#include <gtest/gtest.h>

#include <array>
#include <cmath>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/half.h"
#include "model/context_parallel.h"
#include "stored_values.h"
#include "test_util.h"

namespace trainer::test {
namespace {

// Naive causal grouped-query attention in double, straight from the definition (llm.c's CPU
// loops): qkv rows hold NH query heads, NKV key heads and NKV value heads; query head h uses key
// and value head h / (NH / NKV). lse: each row's log-sum-exp of its scaled scores (B, NH, T).
struct NaiveAttention {
  std::vector<double> out, lse, dqkv;
  template <class Q, class D>
  NaiveAttention(const std::vector<Q>& qkv, const std::vector<D>& dout, int B, int T, int C, int NH,
                 int NKV) {
    const int hs = C / NH, group = NH / NKV, W = C + 2 * NKV * hs;
    const double scale = 1 / std::sqrt(double(hs));
    out.assign(B * T * C, 0);
    lse.assign(B * NH * T, 0);
    std::vector<double> a(T);
    dqkv.assign(B * T * W, 0);
    auto q = [&](int b, int t, int h, int i) { return (b * T + t) * W + h * hs + i; };
    auto k = [&](int b, int t, int h, int i) { return (b * T + t) * W + C + h / group * hs + i; };
    auto v = [&](int b, int t, int h, int i) { return k(b, t, h, i) + NKV * hs; };
    for (int b = 0; b < B; b++)
      for (int h = 0; h < NH; h++)
        for (int t = 0; t < T; t++) {
          double mx = -1e300;
          for (int u = 0; u <= t; u++) {
            double s = 0;
            for (int i = 0; i < hs; i++)
              s += double(qkv[q(b, t, h, i)]) * double(qkv[k(b, u, h, i)]);
            a[u] = s * scale;
            mx = std::max(mx, a[u]);
          }
          double sum = 0;
          for (int u = 0; u <= t; u++) sum += (a[u] = std::exp(a[u] - mx));
          for (int u = 0; u <= t; u++) a[u] /= sum;
          lse[(b * NH + h) * T + t] = mx + std::log(sum);
          for (int i = 0; i < hs; i++) {
            double o = 0;
            for (int u = 0; u <= t; u++) o += a[u] * double(qkv[v(b, u, h, i)]);
            out[(b * T + t) * C + h * hs + i] = o;
          }
          // backward for this query row
          std::vector<double> da(t + 1);
          for (int u = 0; u <= t; u++)
            for (int i = 0; i < hs; i++) {
              const double g = double(dout[(b * T + t) * C + h * hs + i]);
              da[u] += g * double(qkv[v(b, u, h, i)]);
              dqkv[v(b, u, h, i)] += a[u] * g;
            }
          double dot = 0;
          for (int u = 0; u <= t; u++) dot += a[u] * da[u];
          for (int u = 0; u <= t; u++) {
            const double dpre = a[u] * (da[u] - dot) * scale;
            for (int i = 0; i < hs; i++) {
              dqkv[q(b, t, h, i)] += dpre * double(qkv[k(b, u, h, i)]);
              dqkv[k(b, u, h, i)] += dpre * double(qkv[q(b, t, h, i)]);
            }
          }
        }
  }
};

TEST(Kernels, AttentionForwardBackward) {
  Device d;
  // T = 250 spans three of the kernel's 96-row blocks, with a ragged last block. Head sizes 4 and
  // 8 are one vector panel on the CPU, 64 and 80 several whole ones, 35 several with a ragged
  // last one for every vector width.
  for (auto [B, T, C, NH] :
       {std::array{2, 7, 12, 3}, std::array{1, 250, 16, 2}, std::array{1, 133, 128, 2},
        std::array{2, 70, 160, 2}, std::array{1, 133, 70, 2}}) {
    auto qkv = random_vector(B * T * 3 * C, 12), dout = random_vector(B * T * C, 13);
    NaiveAttention ref(qkv, dout, B, T, C, NH, NH);
    DPtr out = d.upload(std::vector<float>(B * T * C));
    DPtr lse = d.upload(std::vector<float>(B * NH * T, 3.0f));
    DPtr qkvd = d.upload(qkv);
    d.k->attention_forward(out, lse, qkvd, B, T, C, NH);
    EXPECT_TRUE(all_close(d.download<float>(out, B * T * C), ref.out, kRtol, kAtol)) << "T=" << T;
    EXPECT_TRUE(all_close(d.download<float>(lse, B * NH * T), ref.lse, kRtol, kAtol));
    DPtr dqkv = d.upload(std::vector<float>(B * T * 3 * C, 9.0f));
    d.k->attention_backward(dqkv, d.upload(dout), qkvd, out, lse, B, T, C, NH);
    EXPECT_TRUE(all_close(d.download<float>(dqkv, B * T * 3 * C), ref.dqkv, kRtol, kAtol))
        << "T=" << T;
  }
}

// The backward takes a slice of a key/value head's query heads per task when the key/value heads
// alone would leave threads idle (kernels/cpu/cpu_ops.h), each slice summing its own dK and dV.
// The choice, then the numbers on two threads with it taken: B = 1 with 3 key/value heads of 2
// query heads, and multi-query (one of 6), in the causal backward (which writes dqkv) and in a
// ring part's (which adds to dq and dkv).
TEST(Kernels, AttentionBackwardSlicesGroupsForIdleThreads) {
  EXPECT_EQ(cpu::attention_backward_split(4, 3, 2), 1);     // W-L's 4 key/value heads: balanced
  EXPECT_EQ(cpu::attention_backward_split(3, 3, 2), 3);     // 3 tasks on 2 threads: 9
  EXPECT_EQ(cpu::attention_backward_split(1, 6, 2), 2);     // multi-query, B = 1
  EXPECT_EQ(cpu::attention_backward_split(1, 12, 16), 12);  // 12 of 16 threads beat 6 or 4
  EXPECT_EQ(cpu::attention_backward_split(32, 4, 16), 1);
  EXPECT_EQ(cpu::attention_backward_split(3, 1, 2), 1);  // multi-head: nothing to slice
  const OmpThreads two_threads(2);
  Device d;
  const int B = 1, T = 150, C = 36, NH = 6, hs = C / NH;
  for (int NKV : {3, 1}) {
    SCOPED_TRACE(testing::Message() << "NKV " << NKV);
    ASSERT_GT(cpu::attention_backward_split(B * NKV, NH / NKV, 2), 1);
    const int W = C + 2 * NKV * hs;
    auto qkv = random_vector(B * T * W, 21), dout = random_vector(B * T * C, 22);
    NaiveAttention ref(qkv, dout, B, T, C, NH, NKV);
    DPtr out = d.upload(std::vector<float>(B * T * C)),
         lse = d.upload(std::vector<float>(B * NH * T));
    DPtr qkvd = d.upload(qkv), doutd = d.upload(dout);
    d.k->attention_forward(out, lse, qkvd, B, T, C, NH, NKV);
    DPtr dqkv = d.upload(std::vector<float>(B * T * W, 9.0f));
    d.k->attention_backward(dqkv, doutd, qkvd, out, lse, B, T, C, NH, NKV);
    const std::vector<float> sliced = d.download<float>(dqkv, B * T * W);
    EXPECT_TRUE(all_close(sliced, ref.dqkv, kRtol, kAtol));
    // One thread has no idle threads to fill and does not slice: its key/value gradients, summed
    // in another order, agree with the reference but not bit for bit with the sliced run's (they
    // would, were the slicing disconnected).
    DPtr dqkv1 = d.upload(std::vector<float>(B * T * W, 9.0f));
    {
      const OmpThreads one_thread(1);
      d.k->attention_backward(dqkv1, doutd, qkvd, out, lse, B, T, C, NH, NKV);
    }
    const std::vector<float> unsliced = d.download<float>(dqkv1, B * T * W);
    EXPECT_TRUE(all_close(unsliced, ref.dqkv, kRtol, kAtol));
    EXPECT_NE(unsliced, sliced);  // fixed seeds: which bits differ is deterministic
    // The same as one ring part, added to gradients that start at 1.
    const TokenChunks whole{T, 0, 0};
    const AttentionPart part{B, T, C, NH, NKV, whole, whole, false};
    DPtr dq = d.upload(std::vector<float>(B * T * W, 1.0f)),
         dkv = d.upload(std::vector<float>(B * T * W, 1.0f));
    d.k->attention_part_backward(dq, dkv, doutd, qkvd, qkvd, out, lse, part);
    std::vector<float> got = d.download<float>(dq, B * T * W);
    const std::vector<float> kv = d.download<float>(dkv, B * T * W);
    std::vector<double> want(ref.dqkv);
    // dq's query columns and dkv's key/value columns got the gradient, the others still hold 1.
    for (size_t i = 0; i < got.size(); i++) {
      got[i] += kv[i] - 1;
      want[i] += 1;
    }
    EXPECT_TRUE(all_close(got, want, kRtol, kAtol));
  }
}

// Ring attention by its parts, without the ring: rank r's queries (its two chunks of each
// sequence, model/context_parallel.h) against every rank's keys and values in ring order, folded
// by the online softmax, give the naive causal attention's rows; and backward's parts, each
// rank's key/value gradients summed over the ranks that saw them, its gradient. In double the
// sums' order is the only difference (1e-12); in float, rounding (1e-5 against the double
// reference). Multi-head, grouped and
// multi-query, T = 8 per rank with cp = 4 (chunks of 4), T = 120 with cp = 2 (chunks of 60 over
// the kernel's 96-row blocks), T = 78 (chunks of 39, ragged for every vector width) and T = 200
// (chunks of 100: two key blocks a run, the second ragged); head sizes 2 and 21 (one panel, and
// several with a ragged last one, on the CPU).
template <class S>
void check_ring_parts(double tol) {
  Device d;
  const int B = 2, NH = 6;
  for (auto [cp, T, C] : {std::array{2, 240, 12}, std::array{4, 32, 12}, std::array{2, 156, 126},
                          std::array{2, 400, 12}})
    for (int NKV : {NH, NH / 3, 1}) {
      SCOPED_TRACE(testing::Message() << "cp " << cp << ", C " << C << ", NKV " << NKV);
      const int hs = C / NH;
      const int W = C + 2 * NKV * hs, Tl = T / cp;
      const ContextParallel ring(0, cp, {});
      auto qkv = random_vector<S>(size_t(B) * T * W, 31),
           dout = random_vector<S>(size_t(B) * T * C, 32);
      const NaiveAttention want(qkv, dout, B, T, C, NH, NKV);
      // Rank r's rows of a (B, T, width) tensor.
      auto rows_of = [&]<class V>(const std::vector<V>& whole, int r, int width) {
        const TokenChunks ch = ContextParallel(r, cp, {}).chunks(Tl);
        std::vector<V> mine(size_t(B) * Tl * width);
        for (int b = 0; b < B; b++)
          for (int t = 0; t < Tl; t++)
            std::copy_n(&whole[(size_t(b) * T + ch.position(t)) * width], width,
                        &mine[(size_t(b) * Tl + t) * width]);
        return mine;
      };
      std::vector<DPtr> q, o, lse, dq, dkv;
      for (int r = 0; r < cp; r++) {
        q.push_back(d.upload(rows_of(qkv, r, W)));
        o.push_back(d.upload(std::vector<S>(size_t(B) * Tl * C, 5.0)));
        lse.push_back(d.upload(std::vector<S>(size_t(B) * NH * Tl, 5.0)));
        dq.push_back(d.upload(std::vector<S>(size_t(B) * Tl * W)));
        dkv.push_back(d.upload(std::vector<S>(size_t(B) * Tl * W)));
      }
      for (int r = 0; r < cp; r++) {
        const ContextParallel me(r, cp, {});
        AttentionPart part{B, Tl, C, NH, NKV, me.chunks(Tl), {}, true};
        for (int s = 0; s < cp; s++) {
          part.keys = ring.chunks_of(me.holder(s), Tl);
          part.first = s == 0;
          d.k->attention_part_forward(o[r], lse[r], q[r], q[me.holder(s)], part);
        }
        EXPECT_TRUE(
            all_close(d.download<S>(o[r], size_t(B) * Tl * C), rows_of(want.out, r, C), tol, tol))
            << "rank " << r;
      }
      for (int r = 0; r < cp; r++) {
        const ContextParallel me(r, cp, {});
        const DPtr dout_r = d.upload(rows_of(dout, r, C));
        AttentionPart part{B, Tl, C, NH, NKV, me.chunks(Tl), {}, false};
        for (int s = 0; s < cp; s++) {
          const int h = me.holder(s);
          part.keys = ring.chunks_of(h, Tl);
          d.k->attention_part_backward(dq[r], dkv[h], dout_r, q[r], q[h], o[r], lse[r], part);
        }
      }
      for (int r = 0; r < cp; r++) {
        std::vector<S> got = d.download<S>(dq[r], size_t(B) * Tl * W);
        const std::vector<S> kv = d.download<S>(dkv[r], size_t(B) * Tl * W);
        for (size_t i = 0; i < got.size(); i++) got[i] += kv[i];  // disjoint columns
        EXPECT_TRUE(all_close(got, rows_of(want.dqkv, r, W), tol, tol)) << "rank " << r;
      }
    }
}

TEST(Kernels, RingAttentionPartsAreTheWholeAttention) {
  check_ring_parts<double>(1e-12);
  check_ring_parts<float>(1e-5);
}

template <class S>
class AttentionKernels : public ::testing::Test {};
TYPED_TEST_SUITE(AttentionKernels, StorageTypes);

// Grouped-query attention for multi-query (NKV = 1), grouped (NKV = NH / 2) and multi-head
// (NKV = NH) over T = 110 (two of the CPU kernel's 96-row blocks, the second ragged).
TYPED_TEST(AttentionKernels, GroupedQueryAttentionForwardBackward) {
  using S = TypeParam;
  Device d;
  const int B = 2, T = 110, C = 24, NH = 6, hs = C / NH;
  for (int NKV : {1, NH / 2, NH}) {
    SCOPED_TRACE(testing::Message() << "NKV " << NKV);
    const int W = C + 2 * NKV * hs;
    const auto qkv = stored<S>(random_vector(B * T * W, 12)),
               dout = stored<S>(random_vector(B * T * C, 13));
    NaiveAttention ref(widened(qkv), widened(dout), B, T, C, NH, NKV);
    DPtr out = d.upload(std::vector<S>(B * T * C));
    // The log-sum-exps are statistics: fp32 whatever the activations' format.
    DPtr lse = d.upload(std::vector<float>(B * NH * T, 3.0f));
    DPtr qkvd = d.upload(qkv);
    d.k->attention_forward(out, lse, qkvd, B, T, C, NH, NKV);
    const Tolerance tol = storage_tolerance<S>(), chained = storage_tolerance<S>(3);
    EXPECT_TRUE(all_close(download_widened<S>(d, out, B * T * C), ref.out, tol.rtol, tol.atol));
    EXPECT_TRUE(all_close(d.download<float>(lse, B * NH * T), ref.lse, kRtol, kAtol));
    // dqkv is overwritten (starts at 9), key and value gradients summed over each group.
    DPtr dqkv = d.upload(stored<S>(std::vector<float>(B * T * W, 9.0f)));
    d.k->attention_backward(dqkv, d.upload(dout), qkvd, out, lse, B, T, C, NH, NKV);
    EXPECT_TRUE(
        all_close(download_widened<S>(d, dqkv, B * T * W), ref.dqkv, chained.rtol, chained.atol));
  }
}

// Generation: the queries of rows [q0, T) against the cache of keys [0, T) are the full causal
// forward's rows [q0, T) (the full forward checked against the naive one above).
TYPED_TEST(AttentionKernels, AttentionInferenceIsTheForwardsLastRows) {
  using S = TypeParam;
  Device d;
  const int T = 9, C = 16, NH = 4, NKV = 2, W = C + 2 * NKV * (C / NH);
  const auto qkv = stored<S>(random_vector(T * W, 14));
  const NaiveAttention ref(widened(qkv), std::vector<double>(T * C), 1, T, C, NH, NKV);
  const Tolerance tol = storage_tolerance<S>();
  for (int q0 : {0, 5, T - 1}) {
    DPtr out = d.upload(stored<S>(std::vector<float>((T - q0) * C, 7.0f)));
    d.k->attention_inference(out, d.upload(qkv), T, q0, C, NH, NKV);
    const std::vector<double> want(ref.out.begin() + q0 * C, ref.out.end());
    EXPECT_TRUE(all_close(download_widened<S>(d, out, (T - q0) * C), want, tol.rtol, tol.atol))
        << "q0 " << q0;
  }
}

}  // namespace
}  // namespace trainer::test
