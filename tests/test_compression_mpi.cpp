// Gradient compression and the optimizers that exchange compressed momentum under a real
// `mpirun -np 4` (comm_mpi.h): bytes on the wire, error feedback, what each method keeps.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <numeric>
#include <random>

#include "comm/communicator.h"
#include "comm/compression.h"
#include "comm/grad_reducer.h"
#include "comm_mpi.h"

namespace trainer {
namespace {

TEST(Mpi, CompressionBytesAndErrorFeedback) {
  Communicator& c = g_world->comm();
  const int r = c.rank(), P = c.size();
  const int64_t n = 10000, chunks = (n + 255) / 256;
  const std::vector<MatrixView> matrices = {{1000, 100, 60}, {7000, 30, 100}};
  const int64_t plain = uncompressed_bytes(n, P);  // 2 n 4 (p - 1) / p
  // int8 and onebit among more than two ranks: in two phases, over parts of whole chunks (of
  // 40 chunks, 40 j / P to 40 (j + 1) / P): the other parts' messages out, then this rank's
  // part's sum to every other rank in a message as long as the longest part's. Between two, the
  // message all-gathered. Either way about 2 (p - 1) / p messages, as a ring all-reduce.
  auto exchanged = [&](auto message) {
    if (P <= 2) return (P - 1) * message(n);
    int64_t out = 0, longest = 0;
    for (int j = 0; j < P; j++) {
      const int64_t len = std::min(n, chunks * (j + 1) / P * 256) - chunks * j / P * 256;
      if (j != r) out += message(len);
      longest = std::max(longest, message(len));
    }
    return out + (P - 1) * longest;
  };
  const auto int8 = [](int64_t len) { return 4 * ((len + 255) / 256) + len; };
  const auto onebit = [](int64_t len) { return 4 * ((len + 255) / 256) + (len + 7) / 8; };
  const std::map<std::string, int64_t> expected = {
      {"fp16", plain / 2},
      {"bf16", plain / 2},
      {"int8", exchanged(int8)},
      {"onebit", exchanged(onebit)},
      {"onebit_gathered", (P - 1) * onebit(n)},  // two_phase = false
      {"topk", (P - 1) * 8 * 100},               // k = 1% of n
      {"powersgd", 2 * 4 * (P - 1) * ((100 + 60) * 4 + (30 + 100) * 4 + (n - 9000)) / P},
      // powersgd_budget 0.1: ranks 0.1 x 6000 / 160 = 3.75 -> 3 and 0.1 x 3000 / 130 -> 2.
      {"powersgd_budget", 2 * 4 * (P - 1) * ((100 + 60) * 3 + (30 + 100) * 2 + (n - 9000)) / P},
  };
  for (const auto& [method, bytes] : expected) {
    SCOPED_TRACE(method);
    CompressionOptions o;
    o.method = method == "powersgd_budget"   ? "powersgd"
               : method == "onebit_gathered" ? "onebit"
                                             : method;
    o.two_phase = method != "onebit_gathered";
    if (method == "powersgd_budget") o.powersgd_budget = 0.1;
    o.seed = 5;
    auto comp = make_compressor(o, n, matrices, {}, {r, P});
    std::mt19937 rng(100 + r);
    std::normal_distribution<float> normal;
    std::vector<double> true_sum(n, 0.0), returned(n, 0.0), magnitude(n, 0.0);
    for (int step = 0; step < 5; step++) {
      std::vector<float> g(n);
      for (float& x : g) x = normal(rng) * (1 + float(step));
      for (int64_t i = 0; i < n; i++) {
        true_sum[i] += g[i];
        magnitude[i] += std::abs(g[i]);
      }
      const auto before = c.traffic();
      comp->all_reduce(c, g.data(), n);
      EXPECT_EQ(c.traffic().bytes_sent - before.bytes_sent, bytes);
      if (method == "int8" || method == "onebit") {
        // Within 3% of a ring's 2 (p - 1) / p messages, whatever the group's size.
        const double message = double(method == "int8" ? int8(n) : onebit(n));
        EXPECT_LE(double(bytes), 1.03 * 2.0 * (P - 1) / P * message);
      }
      if (method == "int8" || method == "onebit" || method == "topk") {  // decoded alike
        std::vector<double> highest(g.begin(), g.end());
        c.all_reduce(ptr(highest), n, ReduceOp::max);
        for (int64_t i = 0; i < n; i++)
          ASSERT_EQ(double(g[i]), highest[i]) << "every rank has the same sum, element " << i;
      }
      for (int64_t i = 0; i < n; i++) returned[i] += g[i];
    }
    const std::vector<float> residual = comp->residual();
    std::vector<double> lhs(residual.begin(), residual.end()), rhs(true_sum);
    c.all_reduce(ptr(lhs), n, ReduceOp::sum);  // the residuals of all ranks
    c.all_reduce(ptr(rhs), n, ReduceOp::sum);  // the true gradients of all ranks
    c.all_reduce(ptr(magnitude), n, ReduceOp::sum);
    const double wire_eps = method == "bf16" ? 0x1p-8 : method == "fp16" ? 0x1p-11 : 0.0;
    for (int64_t i = 0; i < n; i++) {
      const double tolerance = 1e-5 * magnitude[i] + 3 * wire_eps * magnitude[i];
      ASSERT_NEAR(returned[i] + lhs[i], rhs[i], tolerance) << "sent + residual, element " << i;
    }
    // And compression did drop something (for the lossy methods), which feedback carried.
    if (method != "fp16" && method != "bf16") {
      double dropped = 0;
      for (float x : residual) dropped += std::abs(x);
      EXPECT_GT(dropped, 0);
    }
  }
}

// An overflow (a gradient that is inf or NaN on one rank) must reach every rank's sum, whatever
// the exchange, so that the step is skipped: in two phases the part's sum is encoded again, and
// int8's absmax scale of a NaN chunk was 0 (its values came back as zeros). The residual stays
// finite (kept, the non-finite values would poison every later step).
TEST(Mpi, ANonFiniteGradientReachesEveryRanksSum) {
  Communicator& c = g_world->comm();
  const int r = c.rank(), P = c.size();
  const int64_t n = 4096;
  for (const char* method : {"int8", "onebit", "topk"})
    for (float bad : {INFINITY, NAN}) {
      SCOPED_TRACE(testing::Message() << method << " " << bad);
      CompressionOptions o;
      o.method = method;
      o.topk_ratio = 0.1;
      auto comp = make_compressor(o, n, {}, {}, {r, P});
      std::vector<float> g(n, 0.01f * float(r + 1));
      if (r == 1) g[1000] = bad;
      comp->all_reduce(c, g.data(), n);
      EXPECT_FALSE(std::isfinite(g[1000]));
      for (float x : comp->residual()) ASSERT_TRUE(std::isfinite(x));
    }
}

// The optimizer's state `values` (laid out as the flat buffer) as a reducer reads it: whole, or
// under ZeRO the pieces this rank holds, at their shard offsets.
GradReducer::OptimizerReader state_reader(const std::vector<double>& values,
                                          const GradReducer& reducer, bool shard) {
  return [&values, &reducer, shard](int64_t at, float* dst, int64_t n) {
    if (!shard) {
      for (int64_t i = 0; i < n; i++) dst[i] = float(values[at + i]);
      return;
    }
    for (const GradReducer::Piece& p : reducer.pieces())
      if (at >= p.shard_offset && at + n <= p.shard_offset + p.count) {
        for (int64_t i = 0; i < n; i++) dst[i] = float(values[p.offset + at - p.shard_offset + i]);
        return;
      }
    FAIL() << "no piece at shard offset " << at;
  };
}

// One step of a momentum exchange on fresh random gradients g (~0.1, this rank's own) scaled by
// `scale`; returns the gradients summed over the world.
std::vector<double> exchange_random_gradients(GradReducer& reducer, Communicator& c,
                                              std::vector<float>& g, std::mt19937& rng, int step,
                                              float scale) {
  std::normal_distribution<float> normal;
  std::vector<double> sum_g(g.size());
  for (size_t i = 0; i < g.size(); i++) sum_g[i] = g[i] = normal(rng) * 0.1f;
  c.all_reduce(host_ptr(sum_g.data()), int64_t(sum_g.size()), ReduceOp::sum);
  reducer.start_step(step);
  EXPECT_TRUE(reducer.exchanges_momentum());
  reducer.set_gradient_scale(scale);
  reducer.arm();
  reducer.ready(0);
  reducer.finish();
  return sum_g;
}

// 1-bit Adam's momentum bookkeeping: each rank sends beta1 m / R + (1 - beta1) s g, compressed
// to signs with error feedback, and the sum received is the new momentum. Summed over the ranks,
// what was received and what the residuals kept is exactly the momentum of the summed gradients
// (plus the residuals carried in), step after step; the momentum is the same on every rank, and
// under ZeRO it starts from the pieces the ranks hold. Hierarchically (two nodes of two) the
// node sums its part first, and only the ranks holding the same part exchange it. Among more
// than two ranks the exchange is in two phases, and the rank that sums a part keeps that sum's
// residual too (after its own, in the state): received and all residuals still add up.
TEST(Mpi, OnebitAdamMomentumIsTheCompressedSumsBookkeeping) {
  World& w = *g_world;
  Communicator& c = w.comm();
  const int r = c.rank(), P = c.size();
  auto k = make_cpu_kernels();
  const int64_t bucket = 16 * P * 64, total = bucket * 6;
  auto [intra, inter] = two_nodes(w);
  const float beta = 0.9f;
  for (bool hierarchical : {false, true})
    for (bool shard : {false, true}) {
      SCOPED_TRACE(testing::Message() << "hierarchical " << hierarchical << " shard " << shard);
      std::vector<float> g(total), params(total);
      ReducerOptions o;
      o.bucket_elems = bucket;
      o.shard = shard;
      o.momentum = {true, beta, 0, CompressionOptions{}};
      o.momentum.compression.method = "onebit";
      GradReducer reducer(*k, ptr(g), ptr(params), total, c, hierarchical ? intra.get() : nullptr,
                          hierarchical ? inter.get() : nullptr, o);
      ASSERT_EQ(reducer.buckets(), 6);
      // The optimizer's momentum, the same on every rank (held whole, or as pieces).
      std::vector<double> m(total);
      for (int64_t i = 0; i < total; i++) m[i] = double(float(0.01 * std::sin(0.37 * double(i))));
      reducer.start_step(0);
      EXPECT_FALSE(reducer.momentum_ready());
      reducer.start_momentum(state_reader(m, reducer, shard));
      std::vector<double> d = m;  // what is exchanged
      // Where this rank's part of bucket b is, in the flat buffer.
      const int64_t L = hierarchical ? 2 : 1, part = bucket / L;
      // In two phases (P ranks exchange), the part of it this rank sums: 1 / P of it, whole
      // chunks of 256.
      const int64_t summed = P / L > 2 ? part / P : 0;
      auto part_begin = [&](int64_t b) {
        return b * bucket + (hierarchical ? intra->rank() : 0) * part;
      };
      std::vector<double> carried(total, 0.0);  // the ranks' residuals summed, from the last step
      std::mt19937 rng(7 + r);
      for (int step = 0; step < 3; step++) {
        SCOPED_TRACE(step);
        const float scale = 0.5f + 0.25f * float(step);
        const std::vector<double> sum_g =
            exchange_random_gradients(reducer, c, g, rng, step, scale);
        // The state: per bucket, its residual, its summed part's residual and its momentum
        // (this rank's part), then "ready".
        const std::vector<float> state = reducer.compression_state();
        const int64_t per_bucket = 2 * part + summed;
        ASSERT_EQ(int64_t(state.size()), 6 * per_bucket + 1);
        EXPECT_EQ(state.back(), 1.0f);
        std::vector<double> residuals(total, 0.0);
        for (int64_t b = 0; b < 6; b++) {
          const float* at = state.data() + b * per_bucket;
          for (int64_t i = 0; i < part; i++) {
            residuals[part_begin(b) + i] = at[i];
            // The momentum kept is what was received.
            ASSERT_EQ(at[part + summed + i], g[part_begin(b) + i]) << b << " " << i;
          }
          for (int64_t i = 0; i < summed; i++)
            residuals[part_begin(b) + r * summed + i] += at[part + i];
        }
        c.all_reduce(ptr(residuals), total, ReduceOp::sum);
        std::vector<double> highest(g.begin(), g.end()), negated_lowest(total);
        for (int64_t i = 0; i < total; i++) negated_lowest[i] = -double(g[i]);
        c.all_reduce(ptr(highest), total, ReduceOp::max);
        c.all_reduce(ptr(negated_lowest), total, ReduceOp::max);
        for (int64_t i = 0; i < total; i++)
          ASSERT_EQ(highest[i], -negated_lowest[i]) << "every rank has the same momentum, " << i;
        for (int64_t i = 0; i < total; i++) {
          const double want = beta * d[i] + (1 - beta) * scale * sum_g[i] + carried[i];
          ASSERT_NEAR(g[i] + residuals[i], want, 1e-5) << "received + residuals, element " << i;
        }
        if (shard) {  // ZeRO keeps its pieces of it
          for (const GradReducer::Piece& p : reducer.pieces())
            for (int64_t i = 0; i < p.count; i++)
              ASSERT_EQ(reducer.shard_grads().as<float>()[p.shard_offset + i], g[p.offset + i]);
        }
        // 1 bit: the residual is far from zero (a sign per value cannot carry the values).
        double dropped = 0;
        for (double x : residuals) dropped += std::abs(x);
        EXPECT_GT(dropped, 1e-3 * double(total));
        d.assign(g.begin(), g.end());
        carried = residuals;
      }
    }
}

// Hierarchically each rank's part of a bucket crosses nodes, and the parts cut matrices: PowerSGD
// compresses the whole rows on each side as matrices of their own. A 31 x 64 matrix at offset 16
// of a 2048-value bucket, which a node's two ranks split at 1024 (in its row 15): each part has
// 15 whole rows, sent at rank 2 as P (15 x 2) and Q (64 x 2), and 64 values as they are (16
// before or after the matrix, 48 of the cut row): 222 values cross nodes, not the part's 1024.
TEST(Mpi, PowerSgdCompressesTheRowsOfAMatrixANodesPartsCut) {
  World& w = *g_world;
  Communicator& c = w.comm();
  auto k = make_cpu_kernels();
  const int64_t total = 16 * c.size() * 32;  // one bucket
  auto [intra, inter] = two_nodes(w);
  std::vector<float> g(total, 0.5f), params(total);
  ReducerOptions o;
  o.bucket_elems = total;
  o.compression.method = "powersgd";
  o.compression.powersgd_rank = 2;
  o.matrices = {{16, 31, 64}};
  GradReducer reducer(*k, ptr(g), ptr(params), total, c, intra.get(), inter.get(), o);
  const auto before = inter->traffic();
  reducer.start_step(0);
  reducer.arm();
  reducer.ready(0);
  reducer.finish();
  // Two all-reduces between 2 nodes (P, then Q): each sends its values once.
  EXPECT_EQ(inter->traffic().bytes_sent - before.bytes_sent, (15 * 2 + 64 * 2 + 64) * 4);
  // A rank-1 gradient (all 0.5, summed over 4 ranks: 2) comes back exactly at rank 2 (it came
  // back doubled when Gram-Schmidt's second column, a rounding residue normalised, pointed along
  // the first).
  for (int64_t i = 0; i < total; i++) ASSERT_NEAR(g[i], 2.0f, 1e-5) << i;
}

// Top-k's knobs for DGC: set_ratio changes how many values a message takes, and mask_sent
// zeroes a vector where the last message took its values (leaving the elements summed exactly
// alone).
TEST(Mpi, TopKTakesTheRatioItIsSetToAndMasksWhatItSent) {
  Communicator& c = g_world->comm();
  const int64_t n = 1000;
  CompressionOptions o;
  o.method = "topk";
  o.topk_ratio = 0.01;
  o.error_feedback = false;
  std::vector<float> g(n);
  for (int64_t i = 0; i < n; i++)
    g[i] = float(1 + i % 97) * (i % 2 ? 1.0f : -1.0f) * float(1 + c.rank());
  auto largest = [&](int64_t k) {  // the k largest compressed magnitudes, ties by index
    std::vector<int64_t> order(n - 100);
    std::iota(order.begin(), order.end(), 100);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return std::abs(g[a]) > std::abs(g[b]); });
    order.resize(size_t(k));
    std::sort(order.begin(), order.end());
    return order;
  };
  for (double ratio : {0.0, 0.05}) {
    SCOPED_TRACE(ratio);
    // 900 of the 1000 values compressed: k = 9 at 1%, 45 at 5%.
    auto comp = make_compressor(o, n, {}, {{0, 100}}, {c.rank(), c.size()});
    if (ratio > 0) comp->set_ratio(ratio);
    std::vector<float> x = g;
    comp->all_reduce(c, x.data(), n);
    std::vector<float> v(n, 1.0f);
    comp->mask_sent(v.data());
    std::vector<int64_t> zeros;
    for (int64_t i = 0; i < n; i++)
      if (v[i] == 0) zeros.push_back(i);
    EXPECT_EQ(zeros, largest(ratio > 0 ? 45 : 9));
  }
}

// DGC's bookkeeping (ReducerOptions::momentum.local): each rank keeps its own velocity
// u = beta1 u + (1 - beta1) s g, starting from m / R, so that without masking the ranks'
// velocities sum to the momentum of the summed gradients (momentum correction); the top-k
// compressor's residual accumulates the velocity and sends its k largest values, k falling
// from 25% to the ratio over the sparsity warm-up; what was received and what the residuals
// kept is, summed over the ranks, the velocities plus what they carried in; and with masking
// each rank's velocity is zero exactly where its message took the values (where its residual
// became zero). Flat and hierarchical (two nodes of two), with and without ZeRO-1.
TEST(Mpi, DgcVelocitiesSumToTheMomentumAndAreMaskedWhereSent) {
  World& w = *g_world;
  Communicator& c = w.comm();
  const int r = c.rank(), P = c.size();
  auto k = make_cpu_kernels();
  const int64_t bucket = 16 * P * 32, total = bucket * 3;
  auto [intra, inter] = two_nodes(w);
  const float beta = 0.9f;
  const double ratio = 0.02;
  for (bool masking : {false, true})
    for (bool hierarchical : {false, true})
      for (bool shard : {false, true}) {
        SCOPED_TRACE(testing::Message() << "masking " << masking << " hierarchical " << hierarchical
                                        << " shard " << shard);
        std::vector<float> g(total), params(total);
        ReducerOptions o;
        o.bucket_elems = bucket;
        o.shard = shard;
        o.momentum = {true, beta, 0, CompressionOptions{}, true, masking, 2};
        o.momentum.compression.method = "topk";
        o.momentum.compression.topk_ratio = ratio;
        GradReducer reducer(*k, ptr(g), ptr(params), total, c, hierarchical ? intra.get() : nullptr,
                            hierarchical ? inter.get() : nullptr, o);
        ASSERT_EQ(reducer.buckets(), 3);
        EXPECT_DOUBLE_EQ(reducer.kept_fraction(0), 0.25);
        EXPECT_NEAR(reducer.kept_fraction(1), std::sqrt(0.25 * ratio), 1e-12);
        EXPECT_DOUBLE_EQ(reducer.kept_fraction(2), ratio);
        EXPECT_DOUBLE_EQ(reducer.kept_fraction(9), ratio);
        const int64_t L = hierarchical ? 2 : 1, part = bucket / L, R = P / L;
        auto part_begin = [&](int64_t b) {
          return b * bucket + (hierarchical ? intra->rank() : 0) * part;
        };
        // The optimizer's momentum at the start, the same on every rank.
        std::vector<double> m(total);
        for (int64_t i = 0; i < total; i++) m[i] = double(float(0.01 * std::cos(0.29 * double(i))));
        reducer.start_step(0);
        reducer.start_momentum(state_reader(m, reducer, shard));
        std::vector<double> d = m;  // the uncompressed momentum of the summed gradients
        std::vector<double> carried(total, 0.0);  // the ranks' residuals summed, last step
        std::vector<double> velocities(total);    // the ranks' velocities summed, last step
        for (int64_t i = 0; i < total; i++) velocities[i] = m[i];
        std::mt19937 rng(11 + r);
        for (int step = 0; step < 4; step++) {
          SCOPED_TRACE(step);
          const float scale = 0.5f + 0.25f * float(step);
          const std::vector<double> sum_g =
              exchange_random_gradients(reducer, c, g, rng, step, scale);
          // Per bucket: its residual, then this rank's velocity; then "ready".
          const std::vector<float> state = reducer.compression_state();
          ASSERT_EQ(int64_t(state.size()), 3 * 2 * part + 1);
          const int64_t sent = std::llround(reducer.kept_fraction(step) * double(part));
          std::vector<double> residuals(total, 0.0), u(total, 0.0);
          for (int64_t b = 0; b < 3; b++) {
            int64_t zeros = 0;
            for (int64_t i = 0; i < part; i++) {
              const float res = state[b * 2 * part + i], vel = state[b * 2 * part + part + i];
              residuals[part_begin(b) + i] = res;
              u[part_begin(b) + i] = vel;
              zeros += res == 0;
              if (masking && res == 0) {
                ASSERT_EQ(vel, 0.0f) << "masked where sent " << b << " " << i;
              }
              if (res != 0) {
                ASSERT_NE(vel, 0.0f) << "kept where not sent " << b << " " << i;
              }
            }
            EXPECT_EQ(zeros, sent) << "bucket " << b;
          }
          // At most R messages of `sent` values each, the same sum on every rank.
          for (int64_t b = 0; b < 3; b++) {
            int64_t nonzero = 0;
            for (int64_t i = 0; i < part; i++) nonzero += g[part_begin(b) + i] != 0;
            EXPECT_LE(nonzero, R * sent);
            EXPECT_GE(nonzero, sent);
          }
          std::vector<double> highest(g.begin(), g.end()), negated_lowest(total);
          for (int64_t i = 0; i < total; i++) negated_lowest[i] = -double(g[i]);
          c.all_reduce(ptr(highest), total, ReduceOp::max);
          c.all_reduce(ptr(negated_lowest), total, ReduceOp::max);
          for (int64_t i = 0; i < total; i++)
            ASSERT_EQ(highest[i], -negated_lowest[i]) << "every rank received the same, " << i;
          // Each part is held by one rank of each node: summed over the world, each element is
          // the sum over the R ranks exchanging it.
          c.all_reduce(ptr(residuals), total, ReduceOp::sum);
          c.all_reduce(ptr(u), total, ReduceOp::sum);
          for (int64_t i = 0; i < total; i++) {
            d[i] = beta * d[i] + (1 - beta) * scale * sum_g[i];
            // Without masking the velocities sum to the momentum; with it, the velocity of what
            // was not sent grew as the momentum's (and what was sent restarts from zero).
            const double velocity = beta * velocities[i] + (1 - beta) * scale * sum_g[i];
            if (!masking) {
              ASSERT_NEAR(u[i], d[i], 1e-5) << "momentum correction, element " << i;
            }
            ASSERT_NEAR(g[i] + residuals[i], velocity + carried[i], 1e-5)
                << "received + residuals, element " << i;
          }
          if (shard) {  // ZeRO keeps its pieces of what was received
            for (const GradReducer::Piece& p : reducer.pieces())
              for (int64_t i = 0; i < p.count; i++)
                ASSERT_EQ(reducer.shard_grads().as<float>()[p.shard_offset + i], g[p.offset + i]);
          }
          velocities = u;
          carried = residuals;
        }
      }
}

}  // namespace
}  // namespace trainer
