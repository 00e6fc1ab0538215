// The pieces of training around the kernels: LR schedule, weight-decay policy, initialisation,
// checkpoint round trips and mismatches, sampling.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "model/init.h"
#include "model/stage_executor.h"
#include "test_util.h"
#include "trainer/adamw.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_interval.h"
#include "trainer/lr_schedule.h"
#include "trainer/sampler.h"
#include "trainer/step_guard.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;

ModelConfig tiny_model() {
  ModelConfig c;
  c.vocab_size = 30;
  c.vocab_multiple = 16;
  c.seq_len = 8;
  c.n_layer = 2;
  c.n_head = 2;
  c.d_model = 16;
  return c;
}

TEST(LrSchedule, WarmupThenDecayToMinLr) {
  OptimConfig o;
  o.lr = 1.0;
  o.min_lr = 0.1;
  o.warmup_steps = 10;
  EXPECT_DOUBLE_EQ(lr_at(o, 0, 110), 0.1);
  EXPECT_DOUBLE_EQ(lr_at(o, 9, 110), 1.0);
  EXPECT_DOUBLE_EQ(lr_at(o, 10, 110), 1.0);
  EXPECT_NEAR(lr_at(o, 109, 110), 0.1, 1e-12);
  EXPECT_NEAR(lr_at(o, 10 + 99 / 2.0, 110), 0.55, 0.01);  // cosine midpoint
  o.schedule = "linear";
  EXPECT_NEAR(lr_at(o, 59, 110), 1.0 - 0.9 * 49.0 / 99.0, 1e-12);
  o.schedule = "constant";
  EXPECT_DOUBLE_EQ(lr_at(o, 100, 110), 1.0);
}

TEST(AdamW, WeightDecayPolicy) {
  const ParamTable t = param_table(tiny_model());
  OptimConfig o;
  o.weight_decay = 0.1;
  EXPECT_FLOAT_EQ(AdamW::weight_decay(o, t.at("h.0.attn.qkv.weight")), 0.1f);
  EXPECT_FLOAT_EQ(AdamW::weight_decay(o, t.at("wte.weight")), 0.0f);
  EXPECT_FLOAT_EQ(AdamW::weight_decay(o, t.at("h.1.ln2.weight")), 0.0f);
  EXPECT_FLOAT_EQ(AdamW::weight_decay(o, t.at("h.1.mlp.fc.bias")), 0.0f);
  o.decay_embeddings = o.decay_norms_and_biases = true;
  EXPECT_FLOAT_EQ(AdamW::weight_decay(o, t.at("wpe.weight")), 0.1f);
  EXPECT_FLOAT_EQ(AdamW::weight_decay(o, t.at("ln_f.bias")), 0.1f);
}

// Offload keeps AdamW's state in host memory and updates it on CPU threads, segment by segment,
// the weights copied back: the device update bit for bit (the same function on the same values),
// in fp32 and in bf16 with stochastic rounding (the same conversion from the master). The stats
// say the host did the work: every segment in every update.
TEST(AdamW, OffloadIsTheDeviceUpdateBitwise) {
  auto k = make_cpu_kernels();
  for (DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    StageExecutor a(tiny_model(), *k, dtype, 1, 8), b(tiny_model(), *k, dtype, 1, 8);
    OptimConfig o;
    o.weight_decay = 0.1;
    AdamW device(a, o), host(b, o, true);
    EXPECT_TRUE(host.offloaded());
    ASSERT_TRUE(host.master());
    EXPECT_FALSE(host.master().device);
    const int64_t total = a.table().total;
    // The initial weights as a run makes them: exact fp32 into the master, rounded for the model.
    DPtr full = k->alloc(total, DType::f32);
    a.init_parameters(3, full);
    for (AdamW* opt : {&device, &host})
      if (opt->master()) opt->init_master(full);
    k->convert(a.params(), full, total, 0);
    k->convert(b.params(), full, total, 0);
    k->free(full);
    if (is_half(dtype))
      for (AdamW* opt : {&device, &host}) opt->set_stochastic_rounding(77);
    for (int step = 1; step <= 3; step++) {
      const std::vector<float> g = test::random_vector(size_t(total), 10 + step, 0.1);
      k->upload_f32(a.grads(), g.data(), total);
      k->upload_f32(b.grads(), g.data(), total);
      device.update(1e-2f, 0.5f, step);
      host.update(1e-2f, 0.5f, step);
      const AdamW::OffloadStats stats = host.take_offload_stats();
      EXPECT_EQ(stats.segments, int64_t(host.segments().size()));
      EXPECT_GT(stats.update_s, 0);
    }
    const size_t bytes = size_t(total) * dtype_size(dtype);
    EXPECT_EQ(std::memcmp(a.params().p, b.params().p, bytes), 0);
    for (AdamW::State which : {AdamW::State::weights, AdamW::State::m, AdamW::State::v}) {
      std::vector<float> x(total), y(total);
      if (which == AdamW::State::weights && !device.master())
        k->download_f32(x.data(), a.params(), total);
      else
        device.read_state(which, 0, x.data(), total);
      host.read_state(which, 0, y.data(), total);
      EXPECT_EQ(x, y) << "state " << int(which);
    }
  }
}

// A model in any dtype starts from the fp32 model's values, rounded once: the f64 values init
// computes reach the buffer through floats on the host, never as an f64 buffer for the backend
// to convert (neither backend converts f64 to 16-bit, and the CUDA backend has no f64 at all:
// before this, every fp32 GPU run without a master copy threw at start-up).
TEST(Init, AnyDtypeIsTheFp32ValuesRounded) {
  auto k = make_cpu_kernels();
  StageExecutor ref(tiny_model(), *k, DType::f32, 1, 8);
  ref.init_parameters(5);
  const int64_t total = ref.table().total;
  for (DType dtype : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dtype));
    StageExecutor m(tiny_model(), *k, dtype, 1, 8);
    m.init_parameters(5);
    DPtr rounded = k->alloc(total, dtype);
    k->convert(rounded, ref.params(), total, 0);
    EXPECT_EQ(std::memcmp(m.params().p, rounded.p, size_t(total) * dtype_size(dtype)), 0);
    // And back to the host in either precision: the rounded values exactly, each widened.
    for (const ParamInfo& p : m.table().params) {
      std::vector<float> expected(size_t(p.local_numel()));
      k->download_f32(expected.data(), rounded + p.offset, p.local_numel());
      ASSERT_EQ(m.read<float>(p, m.params()), expected) << p.name;
      ASSERT_EQ(m.read<double>(p, m.params()),
                std::vector<double>(expected.begin(), expected.end()))
          << p.name;
    }
    k->free(rounded);
  }
}

TEST(Init, PureFunctionOfSeedAndName) {
  auto k = make_cpu_kernels();
  StageExecutor a(tiny_model(), *k, DType::f32, 1, 8), b(tiny_model(), *k, DType::f32, 2, 4);
  a.init_parameters(5);
  b.init_parameters(5);
  for (const ParamInfo& p : a.table().params)
    EXPECT_EQ(a.read<float>(p, a.params()), b.read<float>(p, b.params())) << p.name;
  // A parameter's values do not depend on the model around it: the same name in a deeper
  // model gets the same numbers (what lets a later split keep its slice).
  ModelConfig deeper = tiny_model();
  deeper.n_layer = 3;
  StageExecutor c(deeper, *k, DType::f32, 1, 8);
  c.init_parameters(5);
  const ParamInfo& qkv = a.table().at("h.1.attn.qkv.weight");
  EXPECT_EQ(a.read<float>(qkv, a.params()), c.read<float>(c.table().at(qkv.name), c.params()));
  b.init_parameters(6);
  EXPECT_NE(a.read<float>(qkv, a.params()), b.read<float>(qkv, b.params()));
  // Statistics: weights ~ N(0, 0.02), norms 1, biases 0, padded vocab rows 0.
  auto w = a.read<float>(a.table().at("h.0.mlp.fc.weight"), a.params());
  double sum2 = 0;
  for (float x : w) sum2 += double(x) * x;
  EXPECT_NEAR(std::sqrt(sum2 / w.size()), 0.02, 0.003);
  for (float x : a.read<float>(a.table().at("h.0.ln1.weight"), a.params())) ASSERT_EQ(x, 1.0f);
  for (float x : a.read<float>(a.table().at("h.0.ln1.bias"), a.params())) ASSERT_EQ(x, 0.0f);
  const ParamInfo& wte = a.table().at("wte.weight");
  const float* raw = a.params().as<float>() + wte.offset;
  for (int64_t i = wte.logical_numel(); i < wte.numel; i++) ASSERT_EQ(raw[i], 0.0f);
}

TEST(Init, NormalSamplerMoments) {
  double s = 0, s2 = 0;
  const int n = 200000;
  for (int i = 0; i < n; i++) {
    const double x = normal_at(1, 2, i);
    s += x;
    s2 += x * x;
  }
  EXPECT_NEAR(s / n, 0.0, 0.01);
  EXPECT_NEAR(s2 / n, 1.0, 0.01);
}

using CheckpointTest = test::TempDirTest;

// A consistent state: tokens = samples x seq_len (a checkpoint's attributes are checked
// against each other on load).
TrainState state_at(int64_t step, int64_t samples, const ModelConfig& model) {
  TrainState s;
  s.step = step, s.tokens = samples * model.seq_len, s.data_samples = samples;
  return s;
}

TEST_F(CheckpointTest, RoundTripIsBitwise) {
  auto k = make_cpu_kernels();
  Config cfg;
  cfg.model = tiny_model();
  StageExecutor model(cfg.model, *k, DType::f32, 1, 8);
  model.init_parameters(3);
  AdamW opt(model, cfg.optim);
  // Give the moments values: one real update.
  std::vector<int32_t> tok = {1, 2, 3, 4, 5, 6, 7, 8}, tgt = {2, 3, 4, 5, 6, 7, 8, 9};
  model.forward(tok.data(), tgt.data(), 1, 8);
  model.backward();
  opt.update(1e-3f, 1.0f, 1);
  const std::string step_dir = save_checkpoint((dir_ / "checkpoints").string(), cfg, model, &opt,
                                               state_at(7, 112, cfg.model));
  EXPECT_EQ(step_dir, (dir_ / "checkpoints" / "step_00000007").string());
  EXPECT_FALSE(fs::exists(dir_ / "checkpoints" / "step_00000007.tmp"));

  const std::string state = resolve_checkpoint(dir_.string());  // via run dir and `latest`
  EXPECT_EQ(state, step_dir + "/state.h5");
  EXPECT_EQ(config_to_toml(checkpoint_config(state)), config_to_toml(cfg));
  StageExecutor loaded(cfg.model, *k, DType::f32, 1, 8);
  AdamW loaded_opt(loaded, cfg.optim);
  const TrainState ts = load_checkpoint(state, loaded, &loaded_opt);
  EXPECT_EQ(ts.step, 7);
  EXPECT_EQ(ts.tokens, 112 * cfg.model.seq_len);
  EXPECT_EQ(ts.data_samples, 112);
  for (const ParamInfo& p : model.table().params) {
    EXPECT_EQ(model.read<float>(p, model.params()), loaded.read<float>(p, loaded.params()));
    EXPECT_EQ(model.read<float>(p, opt.m()), loaded.read<float>(p, loaded_opt.m()));
    EXPECT_EQ(model.read<float>(p, opt.v()), loaded.read<float>(p, loaded_opt.v()));
  }
}

TEST_F(CheckpointTest, MismatchedModelIsAClearError) {
  auto k = make_cpu_kernels();
  Config cfg;
  cfg.model = tiny_model();
  StageExecutor model(cfg.model, *k, DType::f32, 1, 8);
  const std::string dir = save_checkpoint((dir_ / "checkpoints").string(), cfg, model, nullptr,
                                          state_at(1, 1, cfg.model));
  ModelConfig other = tiny_model();
  other.n_layer = 3;
  StageExecutor wrong(other, *k, DType::f32, 1, 8);
  try {
    load_checkpoint(dir + "/state.h5", wrong, nullptr);
    FAIL();
  } catch (const ConfigError& e) {  // not damage: the config does not fit the checkpoint
    EXPECT_EQ(std::string(e.what()),
              dir +
                  "/state.h5: the checkpoint is of a model with [model] n_layer = 2, this run's "
                  "config has n_layer = 3: resume with the model it was trained with, or start a "
                  "fresh run in another out_dir");
  }
  EXPECT_THROW(resolve_checkpoint((dir_ / "nowhere").string()), CheckpointError);
  // A file that is not HDF5.
  std::ofstream(dir_ / "junk.h5") << "not hdf5";
  EXPECT_THROW(checkpoint_config((dir_ / "junk.h5").string()), CheckpointError);
}

TEST(Sampler, DeterministicForASeed) {
  auto k = make_cpu_kernels();
  StageExecutor model(tiny_model(), *k, DType::f32, 1, 8);
  model.init_parameters(1);
  SampleOptions o{20, 1.0, 0, 9};
  auto a = sample_tokens(model, 8, {1, 2, 3}, o), b = sample_tokens(model, 8, {1, 2, 3}, o);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.size(), 20u);
  for (int32_t t : a) EXPECT_LT(t, 30);                            // never a padded id
  EXPECT_THROW(sample_tokens(model, 8, {1, 30}, o), ConfigError);  // id 30 >= vocab 30
  o.top_k = 1;                                                     // greedy: always the arg max
  auto g = sample_tokens(model, 8, {1, 2, 3}, o);
  o.seed = 10;
  EXPECT_EQ(g, sample_tokens(model, 8, {1, 2, 3}, o));
}

// The key/value cache (the prompt once, then one token at a time; the window re-run once it
// slides) samples what re-running the whole window for every token samples. Greedy, so that only
// a near-tie of the arg max, which these weights do not have, could tell rounding apart.
TEST(Sampler, TheKeyValueCacheSamplesWhatFullWindowsSample) {
  auto k = make_cpu_kernels();
  StageExecutor model(tiny_model(), *k, DType::f32, 1, 8);
  model.init_parameters(1);
  const int Vp = model.config().padded_vocab();
  int calls_from_zero = 0;
  std::vector<int32_t> window;  // the tokens before pos0 are those of the previous calls
  const NextLogits full = [&](const int32_t* tokens, int n, int pos0, std::vector<float>& out) {
    if (pos0 == 0) calls_from_zero++;
    window.resize(pos0);
    window.insert(window.end(), tokens, tokens + n);
    model.forward(window.data(), nullptr, 1, int(window.size()));
    out.resize(Vp);
    k->copy_to_host(out.data(), model.logits() + int64_t(window.size() - 1) * Vp, Vp);
  };
  const SampleOptions o{12, 1.0, 1, 3};  // 3 + 12 tokens: the window of 8 slides
  const std::vector<int32_t> want = sample_tokens(full, 30, 8, {1, 2, 3}, o);
  EXPECT_EQ(calls_from_zero, 1 + (3 + 12 - 1) - 8);  // the prompt, then each slid window
  EXPECT_EQ(sample_tokens(model, 8, {1, 2, 3}, o), want);
}

}  // namespace
}  // namespace trainer

namespace trainer {
namespace {

// The step guard: non-finite values and z-score spikes over a full window of good steps are bad;
// max_bad_steps in a row call for a rollback; a good step ends the run of bad ones. Overflowed
// gradients under dynamic fp16 scaling are the scaler's to skip, not the guard's.
// Young/Daly: a 60 s stall on a job failing once a day wants a checkpoint every ~53 minutes
// (Young's sqrt(2 d M) = 3220 s, Daly's correction +20 s, less the stall: 3180 s); that interval is
// where the expected waste (stalls and rework) is least, within the model's rounding; and a
// stall above 2M makes checkpointing pointless (the interval is M).
TEST(CheckpointInterval, DalysOptimumMinimisesTheExpectedWaste) {
  const CheckpointCosts c{60, 30, 86400};
  const double young = std::sqrt(2 * 60 * 86400.0);
  const double optimum = optimum_interval_s(c);
  EXPECT_NEAR(optimum, young * (1 + std::sqrt(60 / (2 * 86400.0)) / 3 + 60 / (18 * 86400.0)) - 60,
              1e-9);
  EXPECT_NEAR(optimum, 3180.06, 0.01);
  const double best = expected_waste(optimum, c);
  for (double f : {0.5, 0.8, 0.95, 1.05, 1.25, 2.0})
    EXPECT_GT(expected_waste(f * optimum, c), best * 0.999) << f;
  EXPECT_NEAR(best, 60 / (optimum + 60) + (optimum / 2 + 30 + 30) / 86400, 1e-12);
  EXPECT_NEAR(expected_loss_s(3600, c), 1800 + 30 + 30, 1e-9);
  EXPECT_EQ(optimum_interval_s({300, 0, 100}), 100);
}

TEST(StepGuard, SpikesAndNonFiniteStepsAreBadAndRepeatsRollBack) {
  FaultsConfig f;
  f.spike_zscore = 6;
  f.spike_window = 10;
  f.max_bad_steps = 3;
  StepGuard g(f, false);
  std::string why;
  using V = StepGuard::Verdict;
  EXPECT_EQ(g.check(50.0, 1.0, why), V::good);  // the window is not full yet: no spike test
  for (int i = 0; i < 10; i++)
    EXPECT_EQ(g.check(3.0 + 0.01 * (i % 3), 1.0 + 0.1 * (i % 2), why), V::good);
  EXPECT_EQ(g.check(3.5, 1.0, why), V::bad);
  EXPECT_EQ(why, "loss 3.5000 spiked (z-score 56.1 over the last 10 steps)");
  EXPECT_EQ(g.check(3.01, 4.0, why), V::bad);
  EXPECT_TRUE(why.starts_with("gradient norm 4.0000 spiked")) << why;
  EXPECT_EQ(g.check(NAN, 1.0, why), V::rollback);
  EXPECT_EQ(why, "loss is nan");
  const std::vector<double> losses = g.recent_losses(), norms = g.recent_norms();
  EXPECT_EQ(losses.size(), 10u);
  g.restore(losses, norms);  // as a rollback does: the run of bad steps ends, the windows stay
  EXPECT_EQ(g.bad_in_a_row(), 0);
  EXPECT_EQ(g.recent_losses(), losses);
  EXPECT_EQ(g.check(3.01, INFINITY, why), V::bad);
  EXPECT_EQ(why, "gradient norm is inf");
  EXPECT_EQ(g.check(3.02, 1.05, why), V::good);  // ends the run of bad steps
  EXPECT_EQ(g.bad_in_a_row(), 0);
  EXPECT_EQ(g.check(3.02, INFINITY, why), V::bad);
  StepGuard fp16(f, true);
  EXPECT_EQ(fp16.check(3.0, INFINITY, why), V::good);  // the loss scaler skips it
  EXPECT_EQ(fp16.check(NAN, INFINITY, why), V::bad);
  f.max_bad_steps = 0;  // never roll back
  StepGuard never(f, false);
  for (int i = 0; i < 5; i++) EXPECT_EQ(never.check(NAN, 1.0, why), V::bad);
}

}  // namespace
}  // namespace trainer
