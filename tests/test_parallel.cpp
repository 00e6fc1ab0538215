// The parallel layout and the pipeline schedule: pure functions, tested without MPI.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "comm/parallel_dims.h"
#include "io/errors.h"
#include "model/model_definition.h"
#include "trainer/pipeline_schedule.h"

namespace trainer {
namespace {

ModelConfig model(int n_layer = 4, int n_head = 4, int vocab = 256, int multiple = 64) {
  ModelConfig m;
  m.n_layer = n_layer;
  m.n_head = n_head;
  m.d_model = 64;
  m.vocab_size = vocab;
  m.vocab_multiple = multiple;
  return m;
}

struct LayoutCase {
  int world, dp, tp, pp;
  std::string order;
  int rank;
  RankCoords coords;
  std::vector<int> tp_group, pp_group, dp_group;
};

TEST(ParallelDims, CoordinatesAndGroups) {
  const std::vector<LayoutCase> cases = {
      {1, 0, 1, 1, "tp-pp-dp", 0, {0, 0, 0}, {0}, {0}, {0}},
      {4, 0, 1, 1, "tp-pp-dp", 2, {2, 0, 0}, {2}, {2}, {0, 1, 2, 3}},
      {4, 0, 2, 1, "tp-pp-dp", 3, {1, 1, 0}, {2, 3}, {3}, {1, 3}},
      {4, 1, 1, 4, "tp-pp-dp", 2, {0, 0, 2}, {2}, {0, 1, 2, 3}, {2}},
      // dp2 x tp2 x pp2: tp adjacent, pp next, dp outermost.
      {8, 2, 2, 2, "tp-pp-dp", 5, {1, 1, 0}, {4, 5}, {5, 7}, {1, 5}},
      {8, 0, 2, 2, "tp-pp-dp", 6, {1, 0, 1}, {6, 7}, {4, 6}, {2, 6}},
      // Another order: dp fastest, then tp, then pp.
      {8, 2, 2, 2, "dp-tp-pp", 5, {1, 0, 1}, {5, 7}, {1, 5}, {4, 5}},
      {6, 3, 2, 1, "pp-dp-tp", 4, {1, 1, 0}, {1, 4}, {4}, {3, 4, 5}},
  };
  for (const auto& c : cases) {
    const auto d = ParallelDims::make(c.world, c.dp, c.tp, c.pp, c.order, model());
    SCOPED_TRACE(::testing::Message()
                 << "world " << c.world << " " << c.order << " rank " << c.rank);
    EXPECT_EQ(d.dp() * d.tp() * d.pp(), c.world);
    EXPECT_EQ(d.coords(c.rank), c.coords);
    EXPECT_EQ(d.group(Axis::tp, c.rank), c.tp_group);
    EXPECT_EQ(d.group(Axis::pp, c.rank), c.pp_group);
    EXPECT_EQ(d.group(Axis::dp, c.rank), c.dp_group);
    // Coordinates are a bijection onto the ranks.
    std::set<int> seen;
    for (int r = 0; r < c.world; r++) {
      EXPECT_EQ(d.rank_of(d.coords(r)), r);
      seen.insert(d.rank_of(d.coords(r)));
    }
    EXPECT_EQ(int(seen.size()), c.world);
  }
}

TEST(ParallelDims, DescribeListsEveryGroupOnce) {
  const auto d = ParallelDims::make(8, 0, 2, 2, "tp-pp-dp", model());
  EXPECT_EQ(d.describe(),
            "layout: world 8 = dp 2 x tp 2 x pp 2, order tp-pp-dp\n"
            "  tp groups: [0 1] [2 3] [4 5] [6 7]\n"
            "  pp groups: [0 2] [1 3] [4 6] [5 7]\n"
            "  dp groups: [0 4] [1 5] [2 6] [3 7]\n");
}

// Context-parallel ranks come right after the tensor-parallel ones; the replica group (the
// reducer's) is every rank with the same tp and pp coordinates, ordered by (dp, cp).
TEST(ParallelDims, ContextParallelRanksFollowTheTensorParallelOnes) {
  ModelConfig m = model();
  m.seq_len = 16;
  const auto d = ParallelDims::make(16, 2, 2, 2, "tp-pp-dp", m, 2);
  EXPECT_EQ(d.cp(), 2);
  EXPECT_EQ(d.replicas(), 4);
  // Rank 13 = tp 1 + 2 x (cp 0) + 4 x (pp 1) + 8 x (dp 1).
  EXPECT_EQ(d.coords(13), (RankCoords{1, 1, 1, 0}));
  EXPECT_EQ(d.group(Axis::cp, 13), (std::vector<int>{13, 15}));
  EXPECT_EQ(d.group(Axis::tp, 13), (std::vector<int>{12, 13}));
  EXPECT_EQ(d.group(Axis::dp, 13), (std::vector<int>{5, 13}));
  EXPECT_EQ(d.replica_group(13), (std::vector<int>{5, 7, 13, 15}));
  EXPECT_EQ(d.replica_index(d.coords(13)), 2);
  std::set<int> seen;
  for (int r = 0; r < 16; r++) seen.insert(d.rank_of(d.coords(r)));
  EXPECT_EQ(seen.size(), 16u);
  EXPECT_EQ(ParallelDims::make(4, 0, 1, 1, "tp-pp-dp", m, 2).dp(), 2);
  EXPECT_EQ(ParallelDims::make(4, 0, 1, 1, "tp-pp-dp", m, 2).describe(),
            "layout: world 4 = dp 2 x cp 2 x tp 1 x pp 1, order tp-cp-pp-dp\n"
            "  tp groups: [0] [1] [2] [3]\n"
            "  cp groups: [0 1] [2 3]\n"
            "  pp groups: [0] [1] [2] [3]\n"
            "  dp groups: [0 2] [1 3]\n");
  try {
    ParallelDims::make(6, 2, 1, 1, "tp-pp-dp", m, 2);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(
        e.what(),
        "[parallel] dp x cp x tp x pp = 2 x 2 x 1 x 1 = 4 does not match the world size 6");
  }
  m.seq_len = 12;  // 2 x cp = 8 chunks do not divide it
  EXPECT_THROW(ParallelDims::make(4, 1, 1, 1, "tp-pp-dp", m, 4), ConfigError);
}

std::string error_of(int world, int dp, int tp, int pp, const std::string& order,
                     const ModelConfig& m) {
  try {
    ParallelDims::make(world, dp, tp, pp, order, m);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(ParallelDims, InvalidLayoutsNameTheNumbers) {
  EXPECT_EQ(error_of(6, 0, 4, 1, "tp-pp-dp", model()),
            "[parallel] world size 6 is not divisible by tp x pp = 4 x 1 = 4, so dp cannot be "
            "derived");
  EXPECT_EQ(error_of(6, 2, 2, 2, "tp-pp-dp", model()),
            "[parallel] dp x tp x pp = 2 x 2 x 2 = 8 does not match the world size 6");
  EXPECT_EQ(error_of(3, 1, 3, 1, "tp-pp-dp", model(4, 4)),
            "[parallel] tp = 3 must divide n_head = 4");
  EXPECT_EQ(error_of(8, 1, 8, 1, "tp-pp-dp", model(4, 4)),
            "[parallel] tp = 8 must divide n_head = 4");
  EXPECT_EQ(error_of(4, 1, 4, 1, "tp-pp-dp", model(4, 8, 102, 2)),
            "[parallel] tp = 4 must divide the padded vocabulary 102 (make model.vocab_multiple "
            "a multiple of tp)");
  // Llama: key/value heads are split across the group, never replicated, so tp must divide
  // n_kv_head (and the SwiGLU width).
  ModelConfig gqa = model(4, 8);
  gqa.arch = Arch::llama;
  gqa.n_kv_head = 2;
  gqa.ffn_hidden = 64;
  EXPECT_EQ(error_of(4, 1, 4, 1, "tp-pp-dp", gqa),
            "[parallel] tp = 4 must divide n_kv_head = 2: each rank holds whole key/value heads "
            "(they are split across the group, not replicated)");
  gqa.n_kv_head = 4;
  gqa.ffn_hidden = 66;
  EXPECT_EQ(error_of(4, 1, 4, 1, "tp-pp-dp", gqa),
            "[parallel] tp = 4 must divide the MLP's hidden width 66");
  EXPECT_EQ(error_of(8, 1, 1, 8, "tp-pp-dp", model(4)),
            "[parallel] pp = 8 exceeds n_layer = 4: every stage needs at least one layer");
  EXPECT_EQ(error_of(2, 0, 1, 1, "tp-dp", model()),
            "[parallel] order = \"tp-dp\" must name tp, pp and dp once each, fastest-varying "
            "first (e.g. \"tp-pp-dp\")");
  EXPECT_EQ(error_of(2, 0, 1, 1, "tp-tp-dp", model()).substr(0, 30),
            "[parallel] order = \"tp-tp-dp\" ");
}

std::string render(const std::vector<PipeAction>& actions) {
  std::string s;
  for (const auto& a : actions) {
    if (!s.empty()) s += ' ';
    s += to_string(a);
  }
  return s;
}

TEST(PipelineSchedule, OneFOneBShapes) {
  EXPECT_EQ(render(one_f_one_b(0, 4, 6)), "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5");
  EXPECT_EQ(render(one_f_one_b(2, 4, 6)), "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5");
  EXPECT_EQ(render(one_f_one_b(3, 4, 6)), "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5");
  EXPECT_EQ(render(one_f_one_b(0, 4, 2)), "F0 F1 B0 B1");        // fewer micro-batches than stages
  EXPECT_EQ(render(one_f_one_b(0, 1, 3)), "F0 B0 F1 B1 F2 B2");  // pp = 1
  const auto a = one_f_one_b(1, 3, 2);
  EXPECT_EQ(a[0], (PipeAction{PipeAction::forward, 0, 0, 2}));
  EXPECT_EQ(a.back(), (PipeAction{PipeAction::backward, 1, 2, 0}));
}

TEST(PipelineSchedule, InvariantsForManyShapes) {
  for (int S = 1; S <= 6; S++)
    for (int M = 1; M <= 9; M++)
      for (int s = 0; s < S; s++) {
        SCOPED_TRACE(::testing::Message() << "S=" << S << " M=" << M << " stage " << s);
        const auto actions = one_f_one_b(s, S, M);
        std::map<int, int> fwd_at, bwd_at;
        int alive = 0, peak = 0;
        for (int i = 0; i < int(actions.size()); i++) {
          const auto& a = actions[i];
          auto& at = a.kind == PipeAction::forward ? fwd_at : bwd_at;
          EXPECT_FALSE(at.count(a.micro)) << "twice: " << to_string(a);
          at[a.micro] = i;
          alive += a.kind == PipeAction::forward ? 1 : -1;
          peak = std::max(peak, alive);
          // Inputs come from the neighbour in the direction of the data.
          const int expect_recv =
              a.kind == PipeAction::forward ? (s > 0 ? s - 1 : -1) : (s + 1 < S ? s + 1 : -1);
          EXPECT_EQ(a.recv, expect_recv);
        }
        EXPECT_EQ(int(fwd_at.size()), M);
        EXPECT_EQ(int(bwd_at.size()), M);
        for (int m = 0; m < M; m++) EXPECT_LT(fwd_at[m], bwd_at[m]) << "micro " << m;
        EXPECT_LE(peak, std::min(S - s, M)) << "activations in flight";
        EXPECT_EQ(alive, 0);
      }
}

TEST(PipelineSchedule, RunsWithoutDeadlockAndTheKnownBubble) {
  for (int S = 1; S <= 6; S++)
    for (int M = 1; M <= 12; M++)
      EXPECT_NEAR(pipeline_bubble(S, M), double(S - 1) / (M + S - 1), 1e-12)
          << "S=" << S << " M=" << M;
}

// Unequal stages: the slowest works through every micro-batch. When it is the last (the LM
// head's, as the partition usually leaves it), its bubble is the others' time before its first
// forward and after its last backward, (sum - max) / ((M - 1) max + sum): the planner's
// (M - 1) t_max + sum t_s. Elsewhere the others' work overlaps its own and that is a bound.
TEST(PipelineSchedule, UnequalStagesWaitForTheSlowest) {
  for (const std::vector<double>& costs : std::vector<std::vector<double>>{
           {1, 1, 1, 2.5}, {0.5, 0.75, 1}, {2.5, 1, 1, 1}, {1, 3, 1}, {0.5, 1, 0.75}})
    for (int M = 1; M <= 12; M++) {
      double sum = 0, max = 0;
      for (double c : costs) sum += c, max = std::max(max, c);
      const double closed = (sum - max) / ((M - 1) * max + sum), bubble = pipeline_bubble(costs, M);
      if (costs.back() == max || M == 1)
        EXPECT_NEAR(bubble, closed, 1e-12) << "stages " << costs.size() << " M=" << M;
      else
        EXPECT_LT(bubble, closed) << "stages " << costs.size() << " M=" << M;
      EXPECT_GT(bubble, 0) << "stages " << costs.size() << " M=" << M;
    }
}

// The shards of every (tp, pp) layout tile the whole model: each logical element of each
// parameter is held by exactly one tp rank (or every one, when replicated), the stages hold
// contiguous, balanced layer ranges, and exactly one copy of each element is "owned".
TEST(ModelShard, TablesTileTheWholeModel) {
  ModelConfig cfg = model(5, 4, 250, 64);  // Vp 256: the last vocab slice is part padding
  const ParamTable whole = param_table(cfg);
  for (int tp : {1, 2, 4})
    for (int pp : {1, 2, 3, 5}) {
      SCOPED_TRACE(testing::Message() << "tp " << tp << " pp " << pp);
      std::map<std::string, std::vector<int>> held, owned;
      for (const ParamInfo& q : whole.params) {
        held[q.name].assign(q.logical_numel(), 0);
        owned[q.name].assign(q.logical_numel(), 0);
      }
      int layers = 0;
      for (int stage = 0; stage < pp; stage++)
        for (int t = 0; t < tp; t++) {
          const ModelShard shard = ModelShard::make(cfg, t, tp, stage, pp);
          if (t == 0) {
            EXPECT_EQ(shard.first_layer, layers);
            EXPECT_GE(shard.end_layer - shard.first_layer, 1);
            layers = shard.end_layer;
          }
          const ParamTable table = param_table(cfg, shard, 16 * 3);
          EXPECT_EQ(table.total % 48, 0);
          for (const ParamInfo& p : table.params) {
            ASSERT_LE(p.local_numel(), p.numel) << p.name;
            EXPECT_EQ(p.offset % 16, 0);
            for (int64_t i = 0; i < p.local_numel(); i++) {
              const int64_t g = p.logical_index(i);
              ASSERT_GE(g, 0);
              ASSERT_LT(g, p.logical_numel()) << p.name;
              if (!p.tied_copy) held[p.name][g]++;
              owned[p.name][g] += p.owned();
            }
            // The runs of consecutive logical indices agree with the element-wise map, from
            // any starting element (a ZeRO piece may start anywhere), and cover every element.
            for (int64_t begin : {int64_t(0), p.local_numel() / 3}) {
              int64_t next = begin, wrong = 0;
              p.for_each_run(begin, p.local_numel(),
                             [&](int64_t local, int64_t logical, int64_t n) {
                               wrong += local != next || n < 1;
                               for (int64_t i = 0; i < n; i++)
                                 wrong += p.logical_index(local + i) != logical + i;
                               next = local + n;
                             });
              EXPECT_EQ(wrong, 0) << p.name;
              EXPECT_EQ(next, p.local_numel()) << p.name;
            }
          }
        }
      EXPECT_EQ(layers, cfg.n_layer);
      for (const ParamInfo& q : whole.params) {
        const int copies = q.split_dim < 0 ? tp : 1;
        for (int64_t g = 0; g < q.logical_numel(); g++) {
          ASSERT_EQ(held[q.name][g], copies) << q.name << " element " << g;
          ASSERT_EQ(owned[q.name][g], 1) << q.name << " element " << g;
        }
      }
    }
}

// Stages balance their cost: blocks evenly when the head is cheap, fewer blocks on the last
// stage when a large vocabulary's head weighs as much as several blocks.
TEST(ModelShard, PipelinePartitionBalancesTheHead) {
  ModelConfig bytes = model(8, 4, 256, 64);  // C 64, T 256: the head is 0.2 of a block
  EXPECT_EQ(pipeline_partition(bytes, 2), (std::vector<int>{0, 4, 8}));
  EXPECT_EQ(pipeline_partition(bytes, 4), (std::vector<int>{0, 2, 4, 6, 8}));
  EXPECT_EQ(pipeline_partition(bytes, 8), (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8}));
  ModelConfig ws;  // W-S: 6 blocks of C 384, T 256, GPT-2 vocab: the head weighs ~10 blocks
  ws.n_layer = 6, ws.n_head = 6, ws.d_model = 384, ws.seq_len = 256, ws.vocab_size = 50257;
  EXPECT_EQ(pipeline_partition(ws, 2), (std::vector<int>{0, 5, 6}));
  EXPECT_EQ(pipeline_partition(ws, 1), (std::vector<int>{0, 6}));
  EXPECT_THROW(pipeline_partition(ws, 7), std::invalid_argument);
}

TEST(ModelShard, QkvSlicesTakeTheSameHeadsOfQKAndV) {
  ModelConfig cfg = model(1, 4);  // C = 64, head size 16
  const ParamTable table = param_table(cfg, ModelShard::make(cfg, 1, 2, 0, 1));
  const ParamInfo& qkv = table.at("h.0.attn.qkv.bias");
  // Rank 1 of 2 holds heads 2 and 3: rows [32, 64) of q, of k and of v.
  EXPECT_EQ(qkv.local_shape(), std::vector<int64_t>{96});
  EXPECT_EQ(qkv.logical_index(0), 32);
  EXPECT_EQ(qkv.logical_index(31), 63);
  EXPECT_EQ(qkv.logical_index(32), 64 + 32);
  EXPECT_EQ(qkv.logical_index(95), 192 - 1);
  const ParamInfo& proj = table.at("h.0.attn.proj.weight");
  EXPECT_EQ(proj.local_shape(), (std::vector<int64_t>{64, 32}));  // input columns split
  EXPECT_EQ(proj.logical_index(0), 32);
  EXPECT_EQ(proj.logical_index(32), 64 + 32);
}

}  // namespace
}  // namespace trainer
