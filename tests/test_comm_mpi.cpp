// The MPI communicator under a real `mpirun -np 4` (see tests/CMakeLists.txt): every rank runs
// every test, and a failure on any rank fails the job.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <random>
#include <thread>

#include "comm/communicator.h"
#include "comm/compression.h"
#include "comm/grad_reducer.h"
#include "comm/parallel_dims.h"
#include "comm/param_gatherer.h"
#include "comm/staged_comm.h"
#include "io/compressed_shard.h"
#include "io/dataset.h"
#include "io/errors.h"
#include "io/token_shard.h"
#include "trainer/node_shards.h"

namespace trainer {
namespace {

World* g_world = nullptr;  // the process's MPI world, owned by main()

DPtr ptr(std::vector<float>& v) {
  return {reinterpret_cast<std::byte*>(v.data()), DType::f32};
}
DPtr ptr(std::vector<double>& v) {
  return {reinterpret_cast<std::byte*>(v.data()), DType::f64};
}

TEST(Mpi, WorldAndNode) {
  World& w = *g_world;
  EXPECT_EQ(w.size(), 4) << "run under mpirun -np 4";
  EXPECT_EQ(w.local_size(), 4);  // one machine
  EXPECT_EQ(w.local_rank(), w.rank());
  EXPECT_FALSE(w.host().empty());
}

TEST(Mpi, AllReduceSumAndMax) {
  Communicator& c = g_world->comm();
  const int r = c.rank();
  std::vector<float> f = {float(r), 1.0f, float(-r)};
  c.all_reduce(ptr(f), 3, ReduceOp::sum);
  EXPECT_EQ(f, (std::vector<float>{6, 4, -6}));
  std::vector<double> d = {double(r) * 0.5, double(-r)};
  c.all_reduce(ptr(d), 2, ReduceOp::max);
  EXPECT_EQ(d, (std::vector<double>{1.5, 0.0}));
}

TEST(Mpi, ReduceScatterAllGatherBroadcast) {
  Communicator& c = g_world->comm();
  const int r = c.rank(), n = c.size();
  std::vector<float> send(2 * n), part(2);
  for (int i = 0; i < 2 * n; i++) send[i] = float(i * (r + 1));
  c.reduce_scatter(ptr(send), ptr(part), 2);
  const float ranks_sum = float(n * (n + 1) / 2);  // sum over ranks of (r + 1)
  EXPECT_EQ(part, (std::vector<float>{2 * r * ranks_sum, (2 * r + 1) * ranks_sum}));

  std::vector<float> mine = {float(r), float(10 * r)}, all(2 * n);
  c.all_gather(ptr(mine), ptr(all), 2);
  for (int i = 0; i < n; i++) {
    EXPECT_EQ(all[2 * i], float(i));
    EXPECT_EQ(all[2 * i + 1], float(10 * i));
  }
  std::vector<double> b = {r == 2 ? 3.25 : 0.0};
  c.broadcast(ptr(b), 1, 2);
  EXPECT_EQ(b[0], 3.25);
}

TEST(Mpi, SendRecvRing) {
  Communicator& c = g_world->comm();
  const int r = c.rank(), n = c.size();
  std::vector<float> out = {float(r)}, in = {-1};
  Request rx = c.irecv(ptr(in), 1, (r + n - 1) % n, 7);
  Request tx = c.isend(ptr(out), 1, (r + 1) % n, 7);
  rx.wait();
  tx.wait();
  EXPECT_EQ(in[0], float((r + n - 1) % n));
}

TEST(Mpi, GroupsFromTheLayout) {
  ModelConfig m;
  m.n_head = 4;
  const auto dims = ParallelDims::make(4, 0, 2, 1, "tp-pp-dp", m);  // dp2 x tp2
  World& w = *g_world;
  auto tp = w.group(dims.group(Axis::tp, w.rank()));
  auto dp = w.group(dims.group(Axis::dp, w.rank()));
  auto pp = w.group(dims.group(Axis::pp, w.rank()));
  EXPECT_EQ(tp->size(), 2);
  EXPECT_EQ(tp->rank(), dims.coords(w.rank()).tp);
  EXPECT_EQ(dp->rank(), dims.coords(w.rank()).dp);
  EXPECT_EQ(pp->size(), 1);
  std::vector<float> v = {float(w.rank())};
  tp->all_reduce(ptr(v), 1, ReduceOp::sum);
  // tp pairs are (0 1) and (2 3).
  EXPECT_EQ(v[0], w.rank() < 2 ? 1.0f : 5.0f);
  v = {float(w.rank())};
  dp->all_reduce(ptr(v), 1, ReduceOp::sum);
  EXPECT_EQ(v[0], w.rank() % 2 == 0 ? 2.0f : 4.0f);  // dp pairs (0 2) and (1 3)
  // A group of one: collectives are local.
  std::vector<float> send = {1, 2}, recv = {0, 0};
  pp->all_reduce(ptr(send), 2, ReduceOp::sum);
  pp->all_gather(ptr(send), ptr(recv), 2);
  EXPECT_EQ(recv, send);
}

TEST(Mpi, NonBlockingAllReduceCompletesWhileWorking) {
  Communicator& c = g_world->comm();
  std::vector<float> big(1 << 20, 1.0f);
  Request req = c.iall_reduce(ptr(big), int64_t(big.size()), ReduceOp::sum);
  double work = 0;
  for (int i = 0; i < 1000; i++) {
    work += std::sqrt(double(i));
    req.test();  // drive progress between chunks of work, as backward will
  }
  req.wait();
  EXPECT_GT(work, 0);
  EXPECT_EQ(big.front(), 4.0f);
  EXPECT_EQ(big.back(), 4.0f);
}

TEST(Mpi, InPlaceAllGatherDupNodesAndTraffic) {
  World& w = *g_world;
  Communicator& c = w.comm();
  const int r = c.rank();
  std::vector<float> buf(8, -1.0f);
  buf[2 * r] = float(r);
  buf[2 * r + 1] = float(10 * r);
  const auto before = c.traffic();
  c.all_gather(ptr(buf) + 2 * r, ptr(buf), 2);  // in place
  EXPECT_EQ(buf, (std::vector<float>{0, 0, 1, 10, 2, 20, 3, 30}));
  EXPECT_EQ(c.traffic().bytes_sent - before.bytes_sent, 3 * 2 * 4);  // (p - 1) blocks
  auto copy = c.dup();
  EXPECT_EQ(copy->rank(), r);
  std::vector<float> one = {1.0f};
  copy->all_reduce(ptr(one), 1, ReduceOp::sum);
  EXPECT_EQ(one[0], 4.0f);
  for (int i = 0; i < w.size(); i++) {
    EXPECT_EQ(w.node_of(i), 0);
    EXPECT_EQ(w.host_of(i), w.host());
  }
}

// Four ranks as two "nodes" of two: intra 0 1 | 2 3, inter (the ranks at the same place on
// each node) 0 2 | 1 3.
struct TwoNodes {
  std::unique_ptr<Communicator> intra, inter;
};
TwoNodes two_nodes(World& w) {
  const int r = w.comm().rank();
  return {w.group(r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3}),
          w.group(r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3})};
}

// The bucketed reducer against the plain sum: flat and hierarchical (two "nodes" of two ranks),
// all-reduce and ZeRO-1 reduce-scatter + gather, with many small buckets started at frontiers
// that every rank reaches at a different time (random delays), so that chains complete in a
// different order on every rank. Values are small integers: every sum is exact.
TEST(Mpi, GradReducerMatchesTheSumInEveryMode) {
  World& w = *g_world;
  Communicator& c = w.comm();
  const int r = c.rank(), P = c.size();
  auto k = make_cpu_kernels();
  const int64_t total = 16 * P * 37;
  auto [intra, inter] = two_nodes(w);
  for (bool hierarchical : {false, true})
    for (bool shard : {false, true}) {
      SCOPED_TRACE(testing::Message() << "hierarchical " << hierarchical << " shard " << shard);
      DPtr grads = k->alloc(total, DType::f32), params = k->alloc(total, DType::f32);
      std::vector<float> g(total), want(total);
      for (int64_t i = 0; i < total; i++) {
        g[i] = float((i * 7 + r * 13) % 17);
        for (int q = 0; q < P; q++) want[i] += float((i * 7 + q * 13) % 17);
      }
      k->copy_from_host(grads, g.data(), total);
      ReducerOptions o;
      o.bucket_elems = 16 * P * 3;
      o.shard = shard;
      GradReducer reducer(*k, grads, params, total, c, hierarchical ? intra.get() : nullptr,
                          hierarchical ? inter.get() : nullptr, o);
      EXPECT_EQ(reducer.buckets(), 13);
      std::mt19937 rng(r);
      reducer.arm();
      for (int64_t frontier = total; frontier > 0; frontier -= 100) {
        std::this_thread::sleep_for(std::chrono::microseconds(rng() % 300));
        reducer.ready(frontier);
      }
      reducer.ready(0);
      reducer.finish();
      // Every bucket started during "backward", and the layers left were recorded (0 here).
      EXPECT_EQ(reducer.started_with_layers_left(), std::vector<int>(13, 0));
      if (!shard) {
        std::vector<float> got(total);
        k->copy_to_host(got.data(), grads, total);
        EXPECT_EQ(got, want);
        // Reduced in place: no gradient shard is allocated without ZeRO-1.
        EXPECT_FALSE(reducer.shard_grads());
        EXPECT_EQ(reducer.shard_elems(), 0);
      } else {
        // This rank's pieces hold the sums; the pieces of all ranks tile the buffer once.
        std::vector<float> shard_host(reducer.shard_elems());
        k->copy_to_host(shard_host.data(), reducer.shard_grads(), reducer.shard_elems());
        int64_t covered = 0;
        std::vector<float> p(total, 0.0f);
        for (const auto& piece : reducer.pieces()) {
          covered += piece.count;
          for (int64_t i = 0; i < piece.count; i++) {
            ASSERT_EQ(shard_host[piece.shard_offset + i], want[piece.offset + i]);
            p[piece.offset + i] = float(r + 1);  // "updated" parameters
          }
        }
        EXPECT_EQ(covered * P, total);
        k->copy_from_host(params, p.data(), total);
        reducer.gather_params();
        k->copy_to_host(p.data(), params, total);
        for (float x : p) ASSERT_GE(x, 1.0f);  // every element came from some rank
        std::vector<float> counts(P, 0.0f);
        for (float x : p) counts[int(x) - 1]++;
        for (int q = 0; q < P; q++) EXPECT_EQ(counts[q], float(total / P));
      }
      k->free(grads);
      k->free(params);
    }
}

// ZeRO-2: gradient units arrive in lent windows, one backward (micro-batch) after another, each
// reduce-scattered as it closes and its piece added into the shard; a held unit (a tied
// embedding's) accumulates in the flat buffer and is reduced at finish(). Against the plain sum
// over ranks and micro-batches, flat and hierarchical, with random delays between units (so
// that reductions finish in a different order on every rank) and two windows for five lent
// units (so that open() waits for reductions to retire).
// Four ranks split into two "nodes" of two (intra: 0 1 | 2 3; inter: 0 2 | 1 3), and a shard's
// gradient units aligned to U = 16 x 4: a held embedding, four blocks of different sizes, a head.
struct TwoNodeUnits {
  std::unique_ptr<Communicator> intra, inter;
  std::vector<GradUnit> units;
  int64_t total;
};
TwoNodeUnits two_node_units(World& w, int64_t U) {
  auto [intra, inter] = two_nodes(w);
  return {std::move(intra),
          std::move(inter),
          {{0, 4 * U, true},
           {4 * U, 7 * U, false},
           {7 * U, 9 * U, false},
           {9 * U, 14 * U, false},
           {14 * U, 15 * U, false},
           {15 * U, 18 * U, false}},
          18 * U};
}

TEST(Mpi, ZeroTwoReducesEachWindowIntoTheShard) {
  World& w = *g_world;
  Communicator& c = w.comm();
  const int r = c.rank(), P = c.size();
  const int64_t U = 16 * P;
  auto k = make_cpu_kernels();
  const auto [intra, inter, units, total] = two_node_units(w, U);
  const int micro_batches = 3;
  auto value = [](int m, int q, int64_t i) { return float((i * 7 + q * 13 + m * 5) % 17); };
  for (bool hierarchical : {false, true}) {
    SCOPED_TRACE(testing::Message() << "hierarchical " << hierarchical);
    DPtr held = k->alloc(4 * U, DType::f32), params = k->alloc(total, DType::f32);
    ReducerOptions o;
    o.shard = true;
    o.units = units;
    GradReducer reducer(*k, held, params, total, c, hierarchical ? intra.get() : nullptr,
                        hierarchical ? inter.get() : nullptr, o);
    EXPECT_EQ(reducer.buckets(), 6);
    EXPECT_EQ(reducer.window_elems(), 5 * U);
    std::mt19937 rng(r);
    std::vector<float> held_host(4 * U, 0.0f), want(total, 0.0f);
    for (int step = 0; step < 2; step++) {
      reducer.start_step(step);
      k->zero(held, 4 * U);
      std::fill(held_host.begin(), held_host.end(), 0.0f);
      std::fill(want.begin(), want.end(), 0.0f);
      for (int m = 0; m < micro_batches; m++)
        for (int u = int(units.size()) - 1; u >= 0; u--) {
          const GradUnit& unit = units[u];
          for (int64_t i = unit.begin; i < unit.end; i++)
            for (int q = 0; q < P; q++) want[i] += value(m + step, q, i);
          if (unit.held) {
            for (int64_t i = unit.begin; i < unit.end; i++) held_host[i] += value(m + step, r, i);
            continue;
          }
          const DPtr window = reducer.open(u);
          std::vector<float> g(unit.elems(), -1.0f);
          k->copy_to_host(g.data(), window, unit.elems());
          ASSERT_EQ(g, std::vector<float>(unit.elems(), 0.0f)) << "a window is lent zeroed";
          for (int64_t i = unit.begin; i < unit.end; i++) g[i - unit.begin] = value(m + step, r, i);
          k->copy_from_host(window, g.data(), unit.elems());
          std::this_thread::sleep_for(std::chrono::microseconds(rng() % 300));
          reducer.close(u, u);
          reducer.ready(unit.begin, u);  // backward drives what is in flight
        }
      k->copy_from_host(held, held_host.data(), 4 * U);
      reducer.ready(0);
      reducer.finish();
      // Started as each unit closed (layers left = its index here); the held one at finish().
      EXPECT_EQ(reducer.started_with_layers_left(), (std::vector<int>{5, 4, 3, 2, 1, -1}));
      std::vector<float> shard(reducer.shard_elems());
      k->copy_to_host(shard.data(), reducer.shard_grads(), reducer.shard_elems());
      int64_t covered = 0;
      for (const auto& piece : reducer.pieces()) {
        covered += piece.count;
        for (int64_t i = 0; i < piece.count; i++)
          ASSERT_EQ(shard[piece.shard_offset + i], want[piece.offset + i])
              << "step " << step << " element " << piece.offset + i;
      }
      EXPECT_EQ(covered * P, total);
    }
    k->free(held);
    k->free(params);
  }
}

// ZeRO-3: each rank holds its pieces of the parameters (the reducer's shard layout); a unit
// opened is whole in its window, flat and hierarchically, whether it was prefetched, kept from
// an earlier open, or gathered on demand; with three windows, the least recently used free one
// is reused, and a unit still open is never overwritten. refresh() gathers the held unit whole
// and forgets the windows (their parameters are stale after an update).
TEST(Mpi, ZeroThreeGathersEachUnitIntoItsWindow) {
  World& w = *g_world;
  Communicator& c = w.comm();
  const int P = c.size();
  const int64_t U = 16 * P;
  auto k = make_cpu_kernels();
  const auto [intra, inter, units, total] = two_node_units(w, U);
  for (bool hierarchical : {false, true}) {
    SCOPED_TRACE(testing::Message() << "hierarchical " << hierarchical);
    DPtr held = k->alloc(4 * U, DType::f32);
    ParamGatherer g(*k, held, DType::f32, units, c, hierarchical ? intra.get() : nullptr,
                    hierarchical ? inter.get() : nullptr);
    ASSERT_EQ(g.shard_elems(), total / P);
    ASSERT_EQ(g.window_elems(), 5 * U);
    // This rank's pieces, where the reducer puts them: each unit's, by the rank's piece index.
    ReducerOptions o;
    o.shard = true;
    o.units = units;
    GradReducer reducer(*k, held, held, total, c, hierarchical ? intra.get() : nullptr,
                        hierarchical ? inter.get() : nullptr, o);
    for (int version : {1, 2}) {
      auto value = [&](int64_t i) { return float(i * 3 + version * 1000); };
      std::vector<float> shard(g.shard_elems());
      for (const auto& piece : reducer.pieces())
        for (int64_t i = 0; i < piece.count; i++)
          shard[piece.shard_offset + i] = value(piece.offset + i);
      k->copy_from_host(g.shard(), shard.data(), g.shard_elems());
      g.refresh();
      std::vector<float> h(4 * U);
      k->copy_to_host(h.data(), held, 4 * U);
      for (int64_t i = 0; i < 4 * U; i++) ASSERT_EQ(h[i], value(i)) << "held element " << i;
      g.take_stats();
      auto expect_whole = [&](int u, DPtr at) {
        std::vector<float> x(units[u].elems());
        k->copy_to_host(x.data(), at, units[u].elems());
        for (int64_t i = 0; i < units[u].elems(); i++)
          ASSERT_EQ(x[i], value(units[u].begin + i)) << "unit " << u << " element " << i;
      };
      // A forward and a backward, as the executor runs them.
      for (int u = 1; u <= 5; u++) {
        const DPtr at = g.open(u);
        if (u < 5) g.prefetch(u + 1);
        g.progress();
        expect_whole(u, at);
        g.close(u);
      }
      for (int u = 5; u >= 1; u--) {
        const DPtr at = g.open(u);
        if (u > 1) g.prefetch(u - 1);
        expect_whole(u, at);
        g.close(u);
      }
      // Forward: the first waited, four prefetched. Backward: 5, 4, 3 kept from the forward (3
      // windows), 2 and 1 prefetched.
      const ParamGatherer::Stats s = g.take_stats();
      EXPECT_EQ(s.waited, 1);
      EXPECT_EQ(s.ready, 9);
      EXPECT_EQ(s.gathers, 7);
      // Two open at once keep their windows; a third unit can still be gathered.
      const DPtr a = g.open(1), b = g.open(2);
      g.prefetch(3);
      const DPtr d = g.open(4);
      expect_whole(1, a);
      expect_whole(2, b);
      expect_whole(4, d);
      for (int u : {1, 2, 4}) g.close(u);
      EXPECT_THROW(g.close(4), std::logic_error);
    }
    k->free(held);
  }
}

// Buffers flagged as device memory travel through the staged communicator's pinned host
// buffers (here the CPU backend's copies stand in for the GPU's: the same code path up to the
// memcpy): every collective, in place or not, point-to-point, and the bucketed reducer.
TEST(Mpi, StagedCommunicatorMovesDeviceBuffersThroughHostMemory) {
  World& w = *g_world;
  auto k = make_cpu_kernels();
  auto c = make_staged_communicator(w.comm().dup(), *k);
  const int r = c->rank(), P = c->size();
  auto device = [](std::vector<float>& v) {
    DPtr p = ptr(v);
    p.device = true;
    return p;
  };
  std::vector<float> f = {float(r), 1.0f};
  c->all_reduce(device(f), 2, ReduceOp::sum);
  EXPECT_EQ(f, (std::vector<float>{6, 4}));
  c->all_reduce(device(f), 2, ReduceOp::max);
  EXPECT_EQ(f, (std::vector<float>{6, 4}));

  std::vector<float> send(2 * P), part(2, -1.0f);
  for (int i = 0; i < 2 * P; i++) send[i] = float(i * (r + 1));
  c->reduce_scatter(device(send), device(part), 2);
  EXPECT_EQ(part, (std::vector<float>{20.0f * r, 10.0f * (2 * r + 1)}));

  std::vector<float> all(2 * P, -1.0f), mine = {float(r), float(10 * r)};
  c->all_gather(device(mine), device(all), 2);
  EXPECT_EQ(all, (std::vector<float>{0, 0, 1, 10, 2, 20, 3, 30}));
  std::vector<float> in_place(2 * P, -1.0f);
  in_place[2 * r] = float(r);
  in_place[2 * r + 1] = float(10 * r);
  c->all_gather(device(in_place) + 2 * r, device(in_place), 2);
  EXPECT_EQ(in_place, all);

  std::vector<float> b = {float(r), float(r)};
  c->broadcast(device(b), 2, 2);
  EXPECT_EQ(b, (std::vector<float>{2, 2}));

  std::vector<float> out = {float(r)}, in = {-1.0f};
  Request rx = c->irecv(device(in), 1, (r + P - 1) % P, 5);
  Request tx = c->isend(device(out), 1, (r + 1) % P, 5);
  tx.wait();
  rx.wait();
  EXPECT_EQ(in[0], float((r + P - 1) % P));

  // The reducer on device-flagged gradients: the same sums as over plain MPI.
  const int64_t total = 16 * P * 5;
  for (bool shard : {false, true}) {
    std::vector<float> g(total), params(total), want(total);
    for (int64_t i = 0; i < total; i++) {
      g[i] = float((i + r) % 5);
      for (int q = 0; q < P; q++) want[i] += float((i + q) % 5);
    }
    ReducerOptions o;
    o.bucket_elems = 16 * P * 2;
    o.shard = shard;
    GradReducer reducer(*k, device(g), device(params), total, *c, nullptr, nullptr, o);
    reducer.arm();
    reducer.ready(0);
    reducer.finish();
    if (!shard) {
      EXPECT_EQ(g, want);
      continue;
    }
    std::vector<float> got(reducer.shard_elems());
    k->copy_to_host(got.data(), reducer.shard_grads(), reducer.shard_elems());
    for (const auto& piece : reducer.pieces())
      for (int64_t i = 0; i < piece.count; i++)
        ASSERT_EQ(got[piece.shard_offset + i], want[piece.offset + i]);
  }
}

// Bytes on the wire for each method, exactly (4 ranks, n = 10000, one 100 x 60 matrix for
// PowerSGD), and error feedback's invariant over 5 steps: what the all-reduce returned plus
// every rank's final residual adds up to the sum of all true gradients. (fp16 and bf16 add the
// 16-bit values on the wire, as NCCL would: those sums round once more, by at most a few
// units of the format's precision relative to the magnitudes added.)
// A compressed shard is decompressed once per node: without a cache, every rank maps local rank
// 0's one temporary (a rank decompressing for itself would name its own), removed once all
// have mapped it; with a cache, every rank is handed the cache file; and a damaged shard is the
// same DataError on every rank, not a hang.
TEST(Mpi, NodeRanksShareOneDecompression) {
  World& w = *g_world;
  const std::unique_ptr<Communicator> node = node_group(w);
  ASSERT_EQ(node->size(), w.local_size());
  std::string dir;
  if (node->rank() == 0) {
    dir = std::filesystem::temp_directory_path() /
          ("trainer_node_shards_" + std::to_string(getpid()));
    std::filesystem::create_directories(dir);
    std::vector<int32_t> tokens(4001);
    for (size_t i = 0; i < tokens.size(); i++) tokens[i] = int32_t(i * 7 % 256);
    write_token_shard(dir + "/s.bin", tokens, 256);
    compress_shard(dir + "/s.bin", dir + "/s.bin.zst");
    std::ofstream(dir + "/bad.bin.zst") << "\x28\xb5\x2f\xfd not really zstd";
  }
  broadcast_string(*node, dir, 0);

  NodeShardDecompressor shared(*node, "");
  const DecompressedShard d = shared.open(dir + "/s.bin.zst");
  EXPECT_TRUE(d.temporary);
  std::string first = d.path;
  broadcast_string(*node, first, 0);
  EXPECT_EQ(d.path, first) << "rank " << w.rank() << " decompressed a copy of its own";
  {
    TokenShard mapped(d.path, 256);
    shared.mapped(d);
    node->barrier();                                // local rank 0 has removed it by now
    EXPECT_FALSE(std::filesystem::exists(d.path));  // removed, and still mapped:
    std::vector<int32_t> got(3);
    mapped.read(4000 - 2, 3, got.data());
    EXPECT_EQ(got, (std::vector<int32_t>{int32_t(3998 * 7 % 256), int32_t(3999 * 7 % 256),
                                         int32_t(4000 * 7 % 256)}));
  }

  NodeShardDecompressor cached(*node, dir + "/cache");
  const Dataset data({dir + "/s.bin.zst"}, 256, 16, false, cached);
  EXPECT_EQ(data.windows(), 4000 / 16);
  EXPECT_EQ(data.describe(),
            "1 shard, trainer format; 1 zstd-compressed, decompressed into the cache");

  try {
    shared.open(dir + "/bad.bin.zst");
    ADD_FAILURE() << "a damaged shard opened";
  } catch (const DataError& e) {
    EXPECT_TRUE(std::string(e.what()).starts_with(dir + "/bad.bin.zst: ")) << e.what();
  }
  node->barrier();
  if (node->rank() == 0) std::filesystem::remove_all(dir);
}

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

int main(int argc, char** argv) {
  auto world = trainer::make_mpi_world(&argc, &argv);
  trainer::g_world = world.get();
  ::testing::InitGoogleTest(&argc, argv);
  // One rank prints (TRAINER_TEST_ALL_RANKS=1: every rank); every rank's result counts.
  if (world->rank() != 0 && !std::getenv("TRAINER_TEST_ALL_RANKS")) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  return RUN_ALL_TESTS();  // mpirun exits non-zero when any rank does
}
