// The MPI communicator under a real `mpirun -np 4` (see tests/CMakeLists.txt): every rank runs
// every test, and a failure on any rank fails the job.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "comm/communicator.h"
#include "comm/compression.h"
#include "comm/grad_reducer.h"
#include "comm/parallel_dims.h"
#include "comm/param_gatherer.h"
#include "comm/staged_comm.h"
#include "comm_mpi.h"
#include "io/compressed_shard.h"
#include "io/dataset.h"
#include "io/errors.h"
#include "io/token_shard.h"
#include "trainer/node_shards.h"

namespace trainer {
namespace {

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

}  // namespace
}  // namespace trainer
