// The model family: the Llama description (its dimensions, parameter table, rotary frequencies)
// against published numbers, and the stage executor's mechanisms that every model shares: the
// key/value cache of inference and the hooks around each layer.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <numbers>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "model/architectures.h"
#include "model/grad_units.h"
#include "model/init.h"
#include "model/stage_executor.h"
#include "test_util.h"

namespace trainer::test {
namespace {

ModelConfig llama(int d_model, int n_layer, int n_head, int n_kv_head, int vocab) {
  ModelConfig c;
  c.arch = Arch::llama;
  c.d_model = d_model;
  c.n_layer = n_layer;
  c.n_head = n_head;
  c.n_kv_head = n_kv_head;
  c.vocab_size = vocab;
  c.tie_embeddings = false;
  return c;
}

int64_t logical_params(const ModelConfig& cfg) {
  int64_t n = 0;
  for (const ParamInfo& p : param_table(cfg).params) n += p.logical_numel();
  return n;
}

// Llama's FFN rule (2/3 of 4 C, times ffn_dim_multiplier, rounded up to multiple_of) gives the
// published widths.
TEST(LlamaConfig, FfnWidthsOfPublishedModels) {
  ModelConfig l2 = llama(4096, 32, 32, 32, 32000);  // Llama 2 7B
  EXPECT_EQ(l2.ffn(), 11008);
  ModelConfig l3 = llama(4096, 32, 32, 8, 128256);  // Llama 3 8B
  l3.ffn_dim_multiplier = 1.3;
  l3.multiple_of = 1024;
  EXPECT_EQ(l3.ffn(), 14336);
  ModelConfig l70 = llama(8192, 80, 64, 8, 128256);  // Llama 3 70B
  l70.ffn_dim_multiplier = 1.3;
  l70.multiple_of = 4096;
  EXPECT_EQ(l70.ffn(), 28672);
  l70.ffn_hidden = 1000;  // given explicitly, it wins
  EXPECT_EQ(l70.ffn(), 1000);
  ModelConfig g;  // GPT-2: 4 C
  EXPECT_EQ(g.ffn(), 4 * g.d_model);
}

// The parameter counts of the published checkpoints, from the table alone (nothing allocated).
TEST(LlamaConfig, ParameterCountsOfPublishedModels) {
  ModelConfig l2 = llama(4096, 32, 32, 32, 32000);
  EXPECT_EQ(logical_params(l2), 6738415616);  // Llama 2 7B
  ModelConfig l3 = llama(4096, 32, 32, 8, 128256);
  l3.ffn_dim_multiplier = 1.3;
  l3.multiple_of = 1024;
  EXPECT_EQ(logical_params(l3), 8030261248);  // Llama 3 8B
  // FLOPs: 6 per matmul weight (every block matrix and the head, not the embedding) plus
  // causal attention's 6 L C T.
  l3.seq_len = 8192;
  const int64_t matmul = logical_params(l3) - int64_t(128256) * 4096 - (2 * 32 + 1) * 4096;
  EXPECT_EQ(matmul_params(l3), matmul);
  EXPECT_DOUBLE_EQ(flops_per_token(l3), 6.0 * double(matmul) + 6.0 * 32 * 4096 * 8192.0);
}

TEST(LlamaParamTable, MetaNamesPackedQkvAndGateUp) {
  ModelConfig cfg = llama(64, 2, 8, 2, 100);
  cfg.ffn_hidden = 96;
  const ParamTable t = param_table(cfg);
  const std::vector<std::string> layer0 = {
      "layers.0.attention_norm.weight",  "layers.0.attention.wq.weight",
      "layers.0.attention.wk.weight",    "layers.0.attention.wv.weight",
      "layers.0.attention.wo.weight",    "layers.0.ffn_norm.weight",
      "layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w3.weight",
      "layers.0.feed_forward.w2.weight"};
  ASSERT_EQ(t.params.size(), 1 + 2 * layer0.size() + 2);
  EXPECT_EQ(t.params.front().name, "tok_embeddings.weight");
  for (size_t i = 0; i < layer0.size(); i++) EXPECT_EQ(t.params[1 + i].name, layer0[i]);
  EXPECT_EQ(t.params[t.params.size() - 2].name, "norm.weight");
  EXPECT_EQ(t.params.back().name, "output.weight");
  EXPECT_EQ(t.at("layers.1.attention.wk.weight").shape, (std::vector<int64_t>{16, 64}));
  // Packed: q, k and v one (96, 64) matrix; gate and up one (192, 64) matrix.
  auto end = [&](const char* n) { return t.at(n).offset + t.at(n).numel; };
  EXPECT_EQ(t.at("layers.0.attention.wk.weight").offset, end("layers.0.attention.wq.weight"));
  EXPECT_EQ(t.at("layers.0.attention.wv.weight").offset, end("layers.0.attention.wk.weight"));
  EXPECT_EQ(t.at("layers.0.feed_forward.w3.weight").offset, end("layers.0.feed_forward.w1.weight"));
  // Tensor-parallel rank 1 of 2 holds query heads 4..7 and key/value head 1, still packed.
  const ParamTable r1 = param_table(cfg, ModelShard::make(cfg, 1, 2, 0, 1));
  const ParamInfo& wk = r1.at("layers.0.attention.wk.weight");
  EXPECT_EQ(wk.local_shape(), (std::vector<int64_t>{8, 64}));
  EXPECT_EQ(wk.logical_index(0), 8 * 64);
  EXPECT_EQ(wk.offset, r1.at("layers.0.attention.wq.weight").offset + 32 * 64);
  EXPECT_EQ(r1.at("layers.0.feed_forward.w2.weight").local_shape(), (std::vector<int64_t>{64, 48}));
  // Tied: no output.weight; the last stage of a pipeline holds a copy of the embedding.
  cfg.tie_embeddings = true;
  const ParamTable last = param_table(cfg, ModelShard::make(cfg, 0, 1, 1, 2));
  EXPECT_EQ(last.find("output.weight"), nullptr);
  ASSERT_NE(last.tied(), nullptr);
  EXPECT_TRUE(last.tied()->tied_copy);
}

// theta^(-2i/hs), and Llama 3.1's three bands: short wavelengths kept, long ones divided by the
// factor, a blend in between (Meta's apply_scaling, written out by hand here).
TEST(Rope, FrequenciesAndLlama31Scaling) {
  ModelConfig cfg = llama(32, 1, 4, 4, 10);  // head size 8: four frequencies
  cfg.rope_theta = 500.0;
  const std::vector<double> plain = rope_frequencies(cfg);
  ASSERT_EQ(plain.size(), 4u);
  for (int i = 0; i < 4; i++) EXPECT_DOUBLE_EQ(plain[i], std::pow(500.0, -2.0 * i / 8));
  cfg.rope_scaling = {8.0, 1.0, 4.0, 32};
  const std::vector<double> scaled = rope_frequencies(cfg);
  // Wavelengths 2 pi / f: 6.3 (< 32 / 4: kept), 29.8 (between: blended), 140 and 664 (> 32:
  // divided by 8).
  EXPECT_DOUBLE_EQ(scaled[0], plain[0]);
  const double wavelen = 2 * std::numbers::pi / plain[1];
  const double smooth = (32 / wavelen - 1.0) / (4.0 - 1.0);
  EXPECT_DOUBLE_EQ(scaled[1], (1 - smooth) * plain[1] / 8 + smooth * plain[1]);
  EXPECT_DOUBLE_EQ(scaled[2], plain[2] / 8);
  EXPECT_DOUBLE_EQ(scaled[3], plain[3] / 8);
  const std::vector<float> table = rope_table(cfg, 3);
  ASSERT_EQ(table.size(), 3u * 4 * 2);
  EXPECT_FLOAT_EQ(table[(2 * 4 + 1) * 2], float(std::cos(2 * scaled[1])));
  EXPECT_FLOAT_EQ(table[(2 * 4 + 1) * 2 + 1], float(std::sin(2 * scaled[1])));
}

// n token ids below vocab, a function of (i + salt) alone.
std::vector<int32_t> pseudo_tokens(size_t n, int vocab, uint64_t salt) {
  std::vector<int32_t> v(n);
  for (size_t i = 0; i < n; i++) v[i] = int32_t(mix64(i + salt) % uint64_t(vocab));
  return v;
}

ModelConfig tiny(Arch arch) {
  ModelConfig cfg;
  cfg.arch = arch;
  cfg.vocab_size = 50;
  cfg.vocab_multiple = 16;
  cfg.seq_len = 12;
  cfg.n_layer = 2;
  cfg.n_head = 4;
  cfg.d_model = 16;
  if (arch == Arch::llama) {
    cfg.n_kv_head = 2;
    cfg.ffn_hidden = 24;
    cfg.tie_embeddings = false;
  }
  return cfg;
}

void perturb(StageExecutor& model) {
  for (const ParamInfo& p : model.table().params) {
    std::vector<double> v = model.read<double>(p, model.params());
    for (size_t i = 0; i < v.size(); i++) v[i] += 0.1 * normal_at(5, hash_name(p.name), i);
    model.write(p, model.params(), v);
  }
}

// Generation with the key/value cache (a prompt, then one token at a time) gives the logits of
// the full forward over the whole sequence, row for row.
class KvCache : public ::testing::TestWithParam<std::tuple<Arch, Recompute>> {};

TEST_P(KvCache, IncrementalInferenceMatchesTheFullForward) {
  const ModelConfig cfg = tiny(std::get<0>(GetParam()));
  const int T = cfg.seq_len, prompt = 5, Vp = cfg.padded_vocab();
  auto k = make_cpu_kernels();
  StageExecutor full(cfg, *k, DType::f64, 1, T);
  full.init_parameters(3);
  perturb(full);
  std::vector<int32_t> tokens(T);
  for (int t = 0; t < T; t++) tokens[t] = int32_t(mix64(t) % cfg.vocab_size);
  full.forward(tokens.data(), nullptr, 1, T);
  std::vector<double> want(size_t(T) * Vp);
  k->copy_to_host(want.data(), full.logits(), int64_t(want.size()));

  // Under full recomputation the blocks keep their key/value caches apart from the buffers they
  // share in training.
  StageOptions o;
  o.recompute = std::get<1>(GetParam());
  StageExecutor gen(cfg, *k, DType::f64, 1, T, o);
  gen.init_parameters(3);
  perturb(gen);
  std::vector<double> got(size_t(T) * Vp);
  gen.infer(tokens.data(), prompt, 0);
  k->copy_to_host(got.data(), gen.logits(), int64_t(prompt) * Vp);
  for (int t = prompt; t < T; t++) {
    gen.infer(&tokens[t], 1, t);
    k->copy_to_host(got.data() + size_t(t) * Vp, gen.logits(), Vp);
  }
  // The same kernels on the same rows, in a different grouping: equal to rounding.
  EXPECT_TRUE(all_close(got, want, 1e-11, 1e-12));
  // A second prompt from position 0 starts afresh.
  gen.infer(tokens.data(), prompt, 0);
  std::vector<double> again(size_t(prompt) * Vp);
  k->copy_to_host(again.data(), gen.logits(), int64_t(again.size()));
  EXPECT_TRUE(all_close(again, std::vector<double>(want.begin(), want.begin() + again.size()),
                        1e-11, 1e-12));
}

std::string arch_and_recompute(const ::testing::TestParamInfo<std::tuple<Arch, Recompute>>& info) {
  return std::string(arch_name(std::get<0>(info.param))) + "_" +
         recompute_name(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Models, KvCache,
                         ::testing::Combine(::testing::Values(Arch::gpt2, Arch::llama),
                                            ::testing::Values(Recompute::none, Recompute::full)),
                         arch_and_recompute);

// Recomputation changes memory, never results: two micro-batches in flight (forward, forward,
// backward, backward, as a pipeline runs them), with dropout on GPT-2, give the losses and
// gradients of keeping everything, bit for bit, for every block recomputed or only the first.
// Blocks under recomputation share the buffers of what they do not keep, so a recomputation
// that did not run would leave the last block's activations in the earlier blocks' backward.
class Recomputation : public ::testing::TestWithParam<std::tuple<Arch, Recompute>> {};

TEST_P(Recomputation, BitwiseTheGradientsOfKeepingEverything) {
  ModelConfig cfg = tiny(std::get<0>(GetParam()));
  cfg.n_layer = 3;
  if (cfg.arch == Arch::gpt2) cfg.dropout = 0.2;
  const Recompute mode = std::get<1>(GetParam());
  const int B = 2, T = cfg.seq_len;
  auto k = make_cpu_kernels();
  const std::vector<int32_t> tokens = pseudo_tokens(2 * B * T, cfg.vocab_size, 0),
                             targets = pseudo_tokens(2 * B * T, cfg.vocab_size, 1000);
  auto run = [&](Recompute r, int layers, std::vector<double>& losses) {
    StageOptions o;
    o.slots = 2;
    o.recompute = r;
    o.recompute_layers = layers;
    StageExecutor model(cfg, *k, DType::f32, B, T, o);
    model.init_parameters(7);
    model.zero_grad();
    model.train_mode(11, 0, 1);
    for (int s = 0; s < 2; s++)
      losses.push_back(model.forward(s, &tokens[s * B * T], &targets[s * B * T], B, T));
    model.backward(1, 1.0f);
    model.backward(0, 1.0f);
    std::vector<float> grads(model.table().total);
    k->copy_to_host(grads.data(), model.grads(), int64_t(grads.size()));
    return grads;
  };
  std::vector<double> want_losses, losses, first_losses;
  const std::vector<float> want = run(Recompute::none, 0, want_losses);
  EXPECT_EQ(run(mode, 0, losses), want);
  EXPECT_EQ(losses, want_losses);
  EXPECT_EQ(run(mode, 1, first_losses), want);
  EXPECT_EQ(first_losses, want_losses);
}

INSTANTIATE_TEST_SUITE_P(Models, Recomputation,
                         ::testing::Combine(::testing::Values(Arch::gpt2, Arch::llama),
                                            ::testing::Values(Recompute::selective,
                                                              Recompute::full)),
                         arch_and_recompute);

// A training forward makes the logits' gradients in its cross-entropy pass (one rank holds the
// vocabulary): the loss and every parameter gradient are those of forward() then backward(), bit
// for bit, for both models in fp32 and bf16 and two micro-batches in flight; the backward then
// runs no cross-entropy of its own (what the profile shows), and one with another loss scale
// than its forward's is refused.
TEST(TrainingForward, MakesTheLogitsGradientsBitwiseInOnePass) {
  for (Arch arch : {Arch::gpt2, Arch::llama})
    for (DType dtype : {DType::f32, DType::bf16}) {
      const ModelConfig cfg = tiny(arch);
      const int B = 2, T = cfg.seq_len;
      auto k = make_cpu_kernels();
      std::multiset<std::string> ops;
      k->set_op_observer([&](const char* op, double, auto, auto) { ops.insert(op); });
      const std::vector<int32_t> tokens = pseudo_tokens(2 * B * T, cfg.vocab_size, 0),
                                 targets = pseudo_tokens(2 * B * T, cfg.vocab_size, 1000);
      const float scale = 1024.0f;
      auto run = [&](bool training_forward, std::vector<double>& losses) {
        StageOptions o;
        o.slots = 2;
        StageExecutor model(cfg, *k, dtype, B, T, o);
        model.init_parameters(7);
        model.zero_grad();
        ops.clear();
        for (int s = 0; s < 2; s++) {
          const int32_t *x = &tokens[s * B * T], *y = &targets[s * B * T];
          losses.push_back(training_forward ? model.training_forward(s, x, y, B, T, scale)
                                            : model.forward(s, x, y, B, T));
        }
        model.backward(1, scale);
        model.backward(0, scale);
        std::vector<float> grads(model.table().total);
        k->download_f32(grads.data(), model.grads(), int64_t(grads.size()));
        if (training_forward) {
          model.training_forward(0, tokens.data(), targets.data(), B, T, scale);
          EXPECT_THROW(model.backward(0, scale / 2), std::logic_error);
        }
        return grads;
      };
      const std::string where = std::string(arch_name(arch)) + " " + std::string(dtype_name(dtype));
      std::vector<double> want_losses, losses;
      const std::vector<float> want = run(false, want_losses);
      EXPECT_EQ(ops.count("crossentropy_stats"), 2u) << where;
      EXPECT_EQ(ops.count("crossentropy_backward"), 2u) << where;
      EXPECT_EQ(run(true, losses), want) << where;
      EXPECT_EQ(losses, want_losses) << where;
      EXPECT_EQ(ops.count("crossentropy_stats_and_backward"), 3u) << where;
      EXPECT_EQ(ops.count("crossentropy_stats") + ops.count("crossentropy_backward"), 0u) << where;
    }
}

// Gradient units (ZeRO-2's, model/grad_units.h) tile each shard's table in offset order, start
// on multiples of the table's unit multiple, hold one block's (or the embeddings', or the final
// norm and head's) parameters each, and the tied embedding's unit alone is held: for GPT-2
// (tied) and Llama (untied), whole and in three pipeline stages by two tensor-parallel ranks.
TEST(GradUnits, TileEachShardAlignedWithTheTiedEmbeddingHeld) {
  for (Arch arch : {Arch::gpt2, Arch::llama}) {
    ModelConfig cfg = tiny(arch);
    cfg.n_layer = 5;
    cfg.tie_embeddings = arch == Arch::gpt2;
    for (auto [tp, stages] : {std::pair{1, 1}, std::pair{2, 3}})
      for (int stage = 0; stage < stages; stage++) {
        SCOPED_TRACE(std::string(arch_name(arch)) + " tp " + std::to_string(tp) + " stage " +
                     std::to_string(stage) + " of " + std::to_string(stages));
        const ModelShard shard = ModelShard::make(cfg, tp - 1, tp, stage, stages);
        const int64_t multiple = 16 * 4;  // dp = 4
        const ParamTable table = param_table(cfg, shard, multiple);
        const std::vector<GradUnit> units = grad_units(table);
        const bool front = shard.first_stage() || (shard.last_stage() && cfg.tie_embeddings);
        ASSERT_EQ(units.size(), size_t(shard.end_layer - shard.first_layer + front +
                                       (shard.last_stage() ? 1 : 0)));
        EXPECT_EQ(units.front().begin, 0);
        EXPECT_EQ(units.back().end, table.total);
        for (size_t u = 0; u < units.size(); u++) {
          EXPECT_LT(units[u].begin, units[u].end);
          EXPECT_EQ(units[u].begin % multiple, 0);
          if (u + 1 < units.size()) {
            EXPECT_EQ(units[u].end, units[u + 1].begin);
          }
          EXPECT_EQ(units[u].held, u == 0 && front && cfg.tie_embeddings) << u;
        }
        for (const ParamInfo& p : table.params) {
          int in = -1;
          for (size_t u = 0; u < units.size(); u++)
            if (p.offset >= units[u].begin && p.offset + p.numel <= units[u].end) in = int(u);
          ASSERT_GE(in, 0) << p.name;
          // The unit of block l is after the embeddings' (when this stage has them).
          const bool before_blocks = p.offset < table.layer_offset(shard.first_layer);
          const int want = p.layer >= 0    ? front + p.layer - shard.first_layer
                           : before_blocks ? 0
                                           : int(units.size()) - 1;
          EXPECT_EQ(in, want) << p.name;
        }
      }
  }
}

// Windowed gradients (ZeRO-2's executor side): each unit's backward writes into the buffer
// open() lends and hands it back with close(); summed back into place they are the flat
// buffer's gradients, with recomputation, for GPT-2 (a tied embedding, held: written by the
// head and the embedding) and Llama: bit for bit for one micro-batch; for two, to rounding (the
// flat buffer accumulates inside each kernel, the windows after it). A unit opened twice
// without closing, or a gradient written outside its window, fails.
class RecordingWindows : public GradientWindows {
 public:
  RecordingWindows(const std::vector<GradUnit>& units, int64_t total)
      : units_(units), sum_(total, 0.0f), open_(units.size(), false) {}
  DPtr open(int u) override {
    EXPECT_FALSE(open_[u]) << "unit " << u << " opened twice";
    open_[u] = true;
    order.push_back(u);
    buffers_[u].assign(size_t(units_[u].elems()), 0.0f);  // zeroed, as the reducer lends them
    return host_ptr(buffers_[u].data());
  }
  void close(int u, int layers_left) override {
    EXPECT_TRUE(open_[u]) << "unit " << u << " closed without open";
    open_[u] = false;
    lefts.push_back(layers_left);
    for (int64_t i = 0; i < units_[u].elems(); i++) sum_[units_[u].begin + i] += buffers_[u][i];
  }
  const std::vector<float>& sum() const { return sum_; }
  std::vector<int> order, lefts;

 private:
  std::vector<GradUnit> units_;
  std::vector<float> sum_;
  std::vector<bool> open_;
  std::map<int, std::vector<float>> buffers_;
};

TEST(GradUnits, WindowedBackwardGivesTheFlatGradients) {
  for (Arch arch : {Arch::gpt2, Arch::llama}) {
    SCOPED_TRACE(arch_name(arch));
    ModelConfig cfg = tiny(arch);
    cfg.n_layer = 3;
    const int B = 2, T = cfg.seq_len;
    auto k = make_cpu_kernels();
    const std::vector<int32_t> tokens = pseudo_tokens(2 * B * T, cfg.vocab_size, 0),
                               targets = pseudo_tokens(2 * B * T, cfg.vocab_size, 1000);
    for (int micro_batches : {1, 2}) {
      SCOPED_TRACE(std::to_string(micro_batches) + " micro-batches");
      auto run = [&](bool windowed, RecordingWindows* windows) {
        StageOptions o;
        o.slots = 2;
        o.recompute = Recompute::full;
        o.recompute_layers = 1;
        o.windowed_grads = windowed;
        StageExecutor model(cfg, *k, DType::f32, B, T, o);
        model.init_parameters(7);
        model.set_gradient_windows(windows);
        model.zero_grad();
        for (int s = 0; s < micro_batches; s++)
          model.forward(s, &tokens[s * B * T], &targets[s * B * T], B, T);
        for (int s = micro_batches - 1; s >= 0; s--) model.backward(s, 1.0f);
        std::vector<float> grads(model.grads_elems());
        k->copy_to_host(grads.data(), model.grads(), model.grads_elems());
        return std::pair{grads, model.grad_units()};
      };
      const auto [want, units] = run(false, nullptr);
      RecordingWindows windows(units, int64_t(want.size()));
      const auto [held, same_units] = run(true, &windows);
      std::vector<float> got = windows.sum();
      // The held unit's gradients stay in grads(), from offset 0.
      ASSERT_EQ(held.size(), size_t(cfg.tie_embeddings ? units.front().end : 0));
      for (size_t i = 0; i < held.size(); i++) got[i] += held[i];
      if (micro_batches == 1) {
        EXPECT_EQ(got, want);
      } else {
        for (size_t i = 0; i < want.size(); i++)
          ASSERT_NEAR(got[i], want[i], 1e-6 * (1 + std::abs(want[i]))) << i;
      }
      // Each backward: the head's unit, the blocks' from the last, then an untied embedding's;
      // layers_left as backward reports it.
      const int n = int(units.size()), lent = cfg.tie_embeddings ? n - 1 : n;
      std::vector<int> order, lefts;
      for (int b = 0; b < micro_batches; b++) {
        for (int u = n - 1; u >= n - lent; u--) order.push_back(u);
        for (int left : {3, 2, 1, 0}) lefts.push_back(left);
        if (!cfg.tie_embeddings) lefts.push_back(0);
      }
      EXPECT_EQ(windows.order, order);
      EXPECT_EQ(windows.lefts, lefts);
    }
  }
}

// Windowed parameters (ZeRO-3's executor side): each unit's forward, recomputation, backward and
// inference reads its parameters from the buffer open() lends, and only between open() and
// close(): here a copy of the flat parameters that close() poisons with NaN. Loss, gradients
// and inference logits are bit for bit the flat model's, for GPT-2 (its tied embedding held
// whole, outside the windows) and Llama; the units are opened in order (forward ascending,
// backward descending), each unit's (a held one's too) prefetching the next lent one.
class CopyingParamWindows : public ParamWindows {
 public:
  CopyingParamWindows(const std::vector<GradUnit>& units, std::vector<float> flat)
      : units_(units), flat_(std::move(flat)) {}
  DPtr open(int u) override {
    EXPECT_FALSE(buffers_.count(u)) << "unit " << u << " opened twice";
    EXPECT_FALSE(units_[u].held) << "a held unit has no window";
    opened.push_back(u);
    std::vector<float>& b = buffers_[u];
    b.assign(flat_.begin() + units_[u].begin, flat_.begin() + units_[u].end);
    return host_ptr(b.data());
  }
  void close(int u) override {
    ASSERT_TRUE(buffers_.count(u)) << "unit " << u << " closed without open";
    std::fill(buffers_[u].begin(), buffers_[u].end(), NAN);  // read after close: NaN losses
    closed_.push_back(std::move(buffers_[u]));  // kept allocated: a stale read stays defined
    buffers_.erase(u);
  }
  void prefetch(int u) override { prefetched.push_back(u); }
  void progress() override {}
  std::vector<int> opened, prefetched;

 private:
  std::vector<GradUnit> units_;
  std::vector<float> flat_;
  std::map<int, std::vector<float>> buffers_;
  std::vector<std::vector<float>> closed_;
};

TEST(GradUnits, WindowedParametersGiveTheFlatLossAndGradients) {
  for (Arch arch : {Arch::gpt2, Arch::llama}) {
    SCOPED_TRACE(arch_name(arch));
    ModelConfig cfg = tiny(arch);
    cfg.n_layer = 3;
    const int B = 2, T = cfg.seq_len;
    auto k = make_cpu_kernels();
    const std::vector<int32_t> tokens = pseudo_tokens(B * T, cfg.vocab_size, 0),
                               targets = pseudo_tokens(B * T, cfg.vocab_size, 1000);
    StageOptions o;
    o.recompute = Recompute::full;
    o.recompute_layers = 1;
    struct Result {
      double loss;
      std::vector<float> grads, logits;
    };
    auto run = [&](StageExecutor& model) {
      model.zero_grad();
      Result r;
      r.loss = model.forward(tokens.data(), targets.data(), B, T);
      model.backward(1.0f);
      r.grads.resize(model.grads_elems());
      k->copy_to_host(r.grads.data(), model.grads(), model.grads_elems());
      model.infer(tokens.data(), 4, 0);
      r.logits.resize(size_t(4) * model.vocab().width);
      k->copy_to_host(r.logits.data(), model.logits(), int64_t(r.logits.size()));
      return r;
    };
    StageExecutor flat(cfg, *k, DType::f32, B, T, o);
    flat.init_parameters(7);
    const Result want = run(flat);
    std::vector<float> params(flat.table().total);
    k->copy_to_host(params.data(), flat.params(), flat.table().total);

    o.windowed_params = true;
    StageExecutor windowed(cfg, *k, DType::f32, B, T, o);
    const std::vector<GradUnit>& units = windowed.grad_units();
    ASSERT_EQ(windowed.params_elems(), held_end(units));
    for (const ParamInfo& p : windowed.table().params)  // the held units' stay whole
      if (p.offset < windowed.params_elems())
        windowed.write(p, windowed.params(), flat.read<float>(p, flat.params()));
    EXPECT_THROW(windowed.param(windowed.table().params.back()), std::logic_error);
    CopyingParamWindows windows(units, params);
    windowed.set_param_windows(&windows);
    const Result got = run(windowed);
    EXPECT_EQ(got.loss, want.loss);
    EXPECT_EQ(got.grads, want.grads);
    EXPECT_EQ(got.logits, want.logits);
    // Forward ascending, backward descending (a recomputed block's forward again inside its
    // backward's window), then inference ascending; each open prefetches the next lent unit on
    // its way, none past the ends.
    std::vector<int> lent;
    for (int u = 0; u < int(units.size()); u++)
      if (!units[u].held) lent.push_back(u);
    std::vector<int> order = lent, prefetched;
    order.insert(order.end(), lent.rbegin(), lent.rend());
    order.insert(order.end(), lent.begin(), lent.end());
    const int n = int(units.size());
    auto next_lent = [&](int u, int direction) {
      for (int v = u + direction; v >= 0 && v < n; v += direction)
        if (!units[v].held) return v;
      return -1;
    };
    for (int pass : {1, -1, 1})  // forward, backward, inference
      for (int i = 0; i < n; i++) {
        const int u = pass > 0 ? i : n - 1 - i;
        // The head's forward looks ahead to the backward, which starts from it.
        const int direction = pass > 0 && u < n - 1 ? 1 : -1;
        if (const int v = next_lent(u, direction); v >= 0) prefetched.push_back(v);
      }
    EXPECT_EQ(windows.opened, order);
    EXPECT_EQ(windows.prefetched, prefetched);
  }
}

// What each mode keeps, from the plan: selective drops the MLP activation of every recomputed
// block but one, full everything but the block outputs; recompute_layers
// limits it to the first blocks.
TEST(Recomputation, ActivationMemoryFollowsTheMode) {
  ModelConfig cfg = tiny(Arch::llama);
  cfg.n_layer = 4;
  const int B = 2, T = cfg.seq_len;
  auto acts = [&](Recompute r, int layers) {
    StageOptions o;
    o.recompute = r;
    o.recompute_layers = layers;
    return StageExecutor::memory_needed(cfg, DType::f32, B, T, o).activations;
  };
  const int64_t none = acts(Recompute::none, 0), selective = acts(Recompute::selective, 0),
                full = acts(Recompute::full, 0);
  EXPECT_LT(selective, none);
  EXPECT_LT(full, selective);
  EXPECT_LT(acts(Recompute::full, 2), none);
  EXPECT_GT(acts(Recompute::full, 2), full);
  EXPECT_EQ(acts(Recompute::none, 2), none);
  // Selective over 4 blocks keeps 3 fewer copies of the SwiGLU output (B T F), to 64-byte
  // rounding.
  const int64_t saved = 3 * int64_t(B) * T * cfg.ffn() * 4;
  EXPECT_NEAR(double(none - selective), double(saved), 3 * 2 * 64.0);
}

// Every numeric [model] knob reaches the model: changing it alone changes the logits.
TEST(ModelKnobs, EachChangesTheLogits) {
  auto k = make_cpu_kernels();
  auto logits_of = [&](const ModelConfig& cfg) {
    StageExecutor m(cfg, *k, DType::f64, 1, cfg.seq_len);
    m.init_parameters(3);
    std::vector<int32_t> tokens(cfg.seq_len);
    for (int t = 0; t < cfg.seq_len; t++) tokens[t] = int32_t(mix64(t) % cfg.vocab_size);
    m.forward(tokens.data(), nullptr, 1, cfg.seq_len);
    std::vector<double> out(size_t(cfg.seq_len) * cfg.padded_vocab());
    k->copy_to_host(out.data(), m.logits(), int64_t(out.size()));
    return out;
  };
  const ModelConfig base = tiny(Arch::llama);
  const std::vector<double> want = logits_of(base);
  // Long enough a context (12) against a small original one (4), so that scaling matters.
  const std::vector<std::pair<const char*, void (*)(ModelConfig&)>> knobs = {
      {"rope_theta", [](ModelConfig& c) { c.rope_theta = 100; }},
      {"norm_eps", [](ModelConfig& c) { c.norm_eps = 0.5; }},
      {"rope_scaling_factor",
       [](ModelConfig& c) {
         c.rope_scaling = {4.0, 1.0, 4.0, 4};
       }},
      {"init_std", [](ModelConfig& c) { c.init_std = 0.05; }},
      {"n_kv_head", [](ModelConfig& c) { c.n_kv_head = 4; }},
      {"ffn_hidden", [](ModelConfig& c) { c.ffn_hidden = 32; }},
      {"tie_embeddings", [](ModelConfig& c) { c.tie_embeddings = true; }}};
  for (const auto& [name, change] : knobs) {
    ModelConfig cfg = base;
    change(cfg);
    EXPECT_FALSE(all_close(logits_of(cfg), want, 1e-9, 0)) << name;
  }
  ModelConfig gpt2 = tiny(Arch::gpt2);
  const std::vector<double> gpt2_logits = logits_of(gpt2);
  gpt2.bias = false;  // biases start at 0, so the table itself must lose them
  EXPECT_EQ(param_table(gpt2).find("h.0.attn.qkv.bias"), nullptr);
  EXPECT_NE(param_table(tiny(Arch::gpt2)).find("h.0.attn.qkv.bias"), nullptr);
  gpt2.bias = true;
  gpt2.init_std = 0.05;
  EXPECT_FALSE(all_close(logits_of(gpt2), gpt2_logits, 1e-9, 0)) << "gpt2 init_std";
}

// Dropout acts in training forwards only, with masks that are a function of the key and the
// micro-batch index: eval mode is the model without dropout, bit for bit; the same index draws
// the same masks; another index, other masks.
TEST(Dropout, TrainModeOnlyAndAFunctionOfKeyAndMicroBatch) {
  ModelConfig cfg = tiny(Arch::gpt2);
  auto k = make_cpu_kernels();
  StageExecutor plain(cfg, *k, DType::f64, 2, 8);
  cfg.dropout = 0.2;
  StageExecutor model(cfg, *k, DType::f64, 2, 8);
  plain.init_parameters(1);
  model.init_parameters(1);
  std::vector<int32_t> tokens(16), targets(16);
  for (int i = 0; i < 16; i++) tokens[i] = i % 50, targets[i] = (3 * i) % 50;
  auto loss = [&](StageExecutor& m) { return m.forward(tokens.data(), targets.data(), 2, 8); };
  const double without = loss(plain);
  EXPECT_EQ(loss(model), without);  // eval mode: the default
  model.train_mode(7, 3, 2);        // micro-batches 3, 5, 7, ...
  const double m3 = loss(model), m5 = loss(model);
  EXPECT_NE(m3, without);
  EXPECT_NE(m3, m5);
  model.train_mode(7, 5, 2);
  EXPECT_EQ(loss(model), m5);
  model.train_mode(8, 3, 2);
  EXPECT_NE(loss(model), m3);
  model.eval_mode();
  EXPECT_EQ(loss(model), without);
  // Validation-style forwards (no targets) never drop.
  model.train_mode(7, 3, 2);
  model.forward(tokens.data(), nullptr, 2, 8);
  plain.forward(tokens.data(), nullptr, 2, 8);
  std::vector<double> a(16 * 64), b(16 * 64);
  k->copy_to_host(a.data(), model.logits(), int64_t(a.size()));
  k->copy_to_host(b.data(), plain.logits(), int64_t(b.size()));
  EXPECT_EQ(a, b);
}

// The hooks around each layer fire in order: forward ascending with before/after pairs, backward
// descending; each micro-batch's slot is passed through; and the gradient-ready hook's frontier
// reaches every layer's first parameter as that layer's backward ends.
TEST(StageExecutorHooks, FireAroundEveryLayerInOrder) {
  const ModelConfig cfg = tiny(Arch::llama);
  auto k = make_cpu_kernels();
  StageOptions o;
  o.slots = 2;
  StageExecutor model(cfg, *k, DType::f32, 2, 8, o);
  model.init_parameters(1);
  std::vector<std::string> events;
  auto log = [&](const char* what) {
    return [&events, what](int slot, int layer) {
      events.push_back(std::string(what) + std::to_string(slot) + "." + std::to_string(layer));
    };
  };
  model.add_layer_hooks({log("F"), log("f"), log("B"), log("b")});
  std::vector<int64_t> frontiers;
  model.set_grads_ready_hook([&](int64_t frontier, int) {
    if (frontiers.empty() || frontiers.back() != frontier) frontiers.push_back(frontier);
  });
  std::vector<int32_t> tokens(16, 1), targets(16, 2);
  model.forward(1, tokens.data(), targets.data(), 2, 8);
  model.backward(1, 1.0f);
  const std::vector<std::string> want = {"F1.0", "f1.0", "F1.1", "f1.1",
                                         "B1.1", "b1.1", "B1.0", "b1.0"};
  EXPECT_EQ(events, want);
  const ParamTable& t = model.table();
  const std::vector<int64_t> want_frontiers = {t.at("norm.weight").offset, t.layer_offset(1),
                                               t.layer_offset(0)};
  EXPECT_EQ(frontiers, want_frontiers);
}

}  // namespace
}  // namespace trainer::test
