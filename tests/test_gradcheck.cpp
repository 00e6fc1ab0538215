// Gradients of every layer and of the whole model against central finite differences, all in
// double precision (the CPU kernels are templates, so f64 runs the same code as training).
// With h = 1e-5 the truncation error is O(h^2) ~ 1e-10 and roundoff ~ 1e-16 / h ~ 1e-11,
// relative to O(1) values, so agreement to 1e-6 relative means the backward pass is right.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "model/architectures.h"
#include "model/init.h"
#include "model/stage_executor.h"
#include "test_util.h"

namespace trainer::test {
namespace {

constexpr double kStep = 1e-5, kRtol = 1e-6, kAtol = 1e-8;
using Vec = std::vector<double>;

// Thousands of tiny forwards: one thread avoids paying OpenMP fork/join for each of them.
class GradCheck : public ::testing::Test {
 protected:
  const OmpThreads one_thread_{1};
};

// Checks the analytic gradient `grad` of scalar f with respect to `x` by central differences.
void expect_gradient(const std::function<double()>& f, Vec& x, const Vec& grad,
                     const std::string& what) {
  Vec numeric(x.size());
  for (size_t i = 0; i < x.size(); i++) {
    const double saved = x[i];
    x[i] = saved + kStep;
    const double up = f();
    x[i] = saved - kStep;
    const double down = f();
    x[i] = saved;
    numeric[i] = (up - down) / (2 * kStep);
  }
  EXPECT_TRUE(all_close(grad, numeric, kRtol, kAtol)) << what;
}

// sum(R * out): a random projection turns a layer's output into a scalar.
double project(const Vec& out, const Vec& r) {
  double s = 0;
  for (size_t i = 0; i < out.size(); i++) s += out[i] * r[i];
  return s;
}

TEST_F(GradCheck, LayerNorm) {
  const int N = 5, C = 7;
  Vec x = random_vector<double>(N * C, 1), w = random_vector<double>(C, 2),
      b = random_vector<double>(C, 3), r = random_vector<double>(N * C, 4);
  auto f = [&] {
    Device d;
    DPtr out = d.upload(Vec(N * C)), mean = d.upload(Vec(N)), rstd = d.upload(Vec(N));
    d.k->layernorm_forward(out, mean, rstd, d.upload(x), d.upload(w), d.upload(b), N, C);
    return project(d.download<double>(out, N * C), r);
  };
  Device d;
  DPtr out = d.upload(Vec(N * C)), mean = d.upload(Vec(N)), rstd = d.upload(Vec(N));
  DPtr xd = d.upload(x), wd = d.upload(w);
  d.k->layernorm_forward(out, mean, rstd, xd, wd, d.upload(b), N, C);
  DPtr dx = d.upload(Vec(N * C)), dw = d.upload(Vec(C)), db = d.upload(Vec(C));
  d.k->layernorm_backward(dx, dw, db, d.upload(r), xd, wd, mean, rstd, N, C);
  expect_gradient(f, x, d.download<double>(dx, N * C), "dx");
  expect_gradient(f, w, d.download<double>(dw, C), "dweight");
  expect_gradient(f, b, d.download<double>(db, C), "dbias");
}

TEST_F(GradCheck, Matmul) {
  const int N = 4, IC = 6, OC = 5;
  Vec x = random_vector<double>(N * IC, 5), w = random_vector<double>(OC * IC, 6),
      b = random_vector<double>(OC, 7), r = random_vector<double>(N * OC, 8);
  auto f = [&] {
    Device d;
    DPtr out = d.upload(Vec(N * OC));
    d.k->matmul_forward(out, d.upload(x), d.upload(w), d.upload(b), N, IC, OC);
    return project(d.download<double>(out, N * OC), r);
  };
  Device d;
  DPtr dx = d.upload(Vec(N * IC)), dw = d.upload(Vec(OC * IC)), db = d.upload(Vec(OC));
  d.k->matmul_backward(dx, dw, db, d.upload(r), d.upload(x), d.upload(w), N, IC, OC);
  expect_gradient(f, x, d.download<double>(dx, N * IC), "dx");
  expect_gradient(f, w, d.download<double>(dw, OC * IC), "dweight");
  expect_gradient(f, b, d.download<double>(db, OC), "dbias");
}

TEST_F(GradCheck, CausalAttention) {
  const int B = 2, T = 5, C = 6, NH = 2;
  Vec qkv = random_vector<double>(B * T * 3 * C, 9), r = random_vector<double>(B * T * C, 10);
  auto f = [&] {
    Device d;
    DPtr out = d.upload(Vec(B * T * C)), lse = d.upload(Vec(B * NH * T));
    d.k->attention_forward(out, lse, d.upload(qkv), B, T, C, NH);
    return project(d.download<double>(out, B * T * C), r);
  };
  Device d;
  DPtr out = d.upload(Vec(B * T * C)), lse = d.upload(Vec(B * NH * T));
  DPtr qkvd = d.upload(qkv);
  d.k->attention_forward(out, lse, qkvd, B, T, C, NH);
  DPtr dqkv = d.upload(Vec(B * T * 3 * C));
  d.k->attention_backward(dqkv, d.upload(r), qkvd, out, lse, B, T, C, NH);
  expect_gradient(f, qkv, d.download<double>(dqkv, B * T * 3 * C), "dqkv");
}

TEST_F(GradCheck, RmsNorm) {
  const int N = 5, C = 7;
  const float eps = 1e-5f;
  Vec x = random_vector<double>(N * C, 31), w = random_vector<double>(C, 32),
      r = random_vector<double>(N * C, 33);
  auto f = [&] {
    Device d;
    DPtr out = d.upload(Vec(N * C)), rstd = d.upload(Vec(N));
    d.k->rmsnorm_forward(out, rstd, d.upload(x), d.upload(w), N, C, eps);
    return project(d.download<double>(out, N * C), r);
  };
  Device d;
  DPtr out = d.upload(Vec(N * C)), rstd = d.upload(Vec(N));
  DPtr xd = d.upload(x), wd = d.upload(w);
  d.k->rmsnorm_forward(out, rstd, xd, wd, N, C, eps);
  DPtr dx = d.upload(Vec(N * C)), dw = d.upload(Vec(C));
  d.k->rmsnorm_backward(dx, dw, d.upload(r), xd, wd, rstd, N, C);
  expect_gradient(f, x, d.download<double>(dx, N * C), "dx");
  expect_gradient(f, w, d.download<double>(dw, C), "dweight");
}

// Grouped-query (two query heads per key/value head) and multi-query attention: the key and value
// gradients sum over the query heads sharing them.
TEST_F(GradCheck, GroupedQueryAttention) {
  const int B = 2, T = 5, C = 8, NH = 4, hs = C / NH;
  for (int NKV : {2, 1}) {
    const int W = C + 2 * NKV * hs;
    Vec qkv = random_vector<double>(B * T * W, 34), r = random_vector<double>(B * T * C, 35);
    auto f = [&] {
      Device d;
      DPtr out = d.upload(Vec(B * T * C)), lse = d.upload(Vec(B * NH * T));
      d.k->attention_forward(out, lse, d.upload(qkv), B, T, C, NH, NKV);
      return project(d.download<double>(out, B * T * C), r);
    };
    Device d;
    DPtr out = d.upload(Vec(B * T * C)), lse = d.upload(Vec(B * NH * T));
    DPtr qkvd = d.upload(qkv);
    d.k->attention_forward(out, lse, qkvd, B, T, C, NH, NKV);
    DPtr dqkv = d.upload(Vec(B * T * W));
    d.k->attention_backward(dqkv, d.upload(r), qkvd, out, lse, B, T, C, NH, NKV);
    expect_gradient(f, qkv, d.download<double>(dqkv, B * T * W),
                    "dqkv, NKV " + std::to_string(NKV));
  }
}

// RoPE is linear in qkv: its backward must be the transpose of the forward's rotation (fp32 table,
// f64 activations).
TEST_F(GradCheck, Rope) {
  const int B = 2, T = 3, NH = 2, NKV = 1, hs = 4, pos0 = 2, W = (NH + 2 * NKV) * hs;
  ModelConfig llama;
  llama.arch = Arch::llama;
  llama.n_head = NH;
  llama.d_model = NH * hs;
  const std::vector<float> table = rope_table(llama, pos0 + T);
  Vec qkv = random_vector<double>(B * T * W, 36), r = random_vector<double>(B * T * W, 37);
  auto f = [&] {
    Device d;
    DPtr x = d.upload(qkv);
    d.k->rope_forward(x, d.upload(table), B, T, NH, NKV, hs, pos0);
    return project(d.download<double>(x, B * T * W), r);
  };
  Device d;
  DPtr g = d.upload(r);
  d.k->rope_backward(g, d.upload(table), B, T, NH, NKV, hs, pos0);
  expect_gradient(f, qkv, d.download<double>(g, B * T * W), "dqkv");
}

TEST_F(GradCheck, SwiGlu) {
  const int N = 4, F = 6;
  Vec gate_up = random_vector<double>(N * 2 * F, 38, 2.0), r = random_vector<double>(N * F, 39);
  auto f = [&] {
    Device d;
    DPtr out = d.upload(Vec(N * F));
    d.k->swiglu_forward(out, d.upload(gate_up), N, F);
    return project(d.download<double>(out, N * F), r);
  };
  Device d;
  DPtr dgu = d.upload(Vec(N * 2 * F));
  d.k->swiglu_backward(dgu, d.upload(r), d.upload(gate_up), N, F);
  expect_gradient(f, gate_up, d.download<double>(dgu, N * 2 * F), "d gate_up");
}

TEST_F(GradCheck, Gelu) {
  const int n = 40;
  Vec x = random_vector<double>(n, 11, 2.0), r = random_vector<double>(n, 12);
  auto f = [&] {
    Device d;
    DPtr out = d.upload(Vec(n));
    d.k->gelu_forward(out, d.upload(x), n);
    return project(d.download<double>(out, n), r);
  };
  Device d;
  DPtr dx = d.upload(Vec(n));
  d.k->gelu_backward(dx, d.upload(x), d.upload(r), n);
  expect_gradient(f, x, d.download<double>(dx, n), "dx");
}

TEST_F(GradCheck, Encoder) {
  const int B = 2, T = 3, C = 4, V = 5;
  std::vector<int32_t> tokens = {4, 0, 4, 2, 2, 1};
  Vec wte = random_vector<double>(V * C, 13), wpe = random_vector<double>(T * C, 14),
      r = random_vector<double>(B * T * C, 15);
  auto f = [&] {
    Device d;
    DPtr out = d.upload(Vec(B * T * C));
    d.k->encoder_forward(out, tokens.data(), d.upload(wte), d.upload(wpe), B, T, C, {0, V, V});
    return project(d.download<double>(out, B * T * C), r);
  };
  Device d;
  DPtr dwte = d.upload(Vec(V * C)), dwpe = d.upload(Vec(T * C));
  d.k->encoder_backward(dwte, dwpe, d.upload(r), tokens.data(), B, T, C, {0, V, V});
  expect_gradient(f, wte, d.download<double>(dwte, V * C), "dwte");
  expect_gradient(f, wpe, d.download<double>(dwpe, T * C), "dwpe");
}

TEST_F(GradCheck, SoftmaxCrossEntropy) {
  const int N = 4, V = 6, Vp = 8;
  Vec logits = random_vector<double>(N * Vp, 16, 2.0);
  std::vector<int32_t> targets = {5, 0, 2, 2};
  auto f = [&] {
    Device d;
    Vec copy = logits;
    return softmax_crossentropy<double>(d, d.upload(Vec(N)), d.upload(copy), targets, V, Vp).mean;
  };
  Device d;
  DPtr ld = d.upload(logits);
  const CrossEntropyForward ce =
      softmax_crossentropy<double>(d, d.upload(Vec(N)), ld, targets, V, Vp);
  d.k->crossentropy_backward(ld, ce.rowmax, ce.sumexp, targets.data(), 1.0f / N, N, {0, V, Vp});
  Vec grad = d.download<double>(ld, N * Vp);
  expect_gradient(f, logits, grad, "dlogits");
}

// The whole model: every element of every parameter of a tiny model, in f64.
void check_whole_model(const ModelConfig& cfg) {
  const int B = 2, T = 6;
  auto kernels = make_cpu_kernels();
  StageExecutor model(cfg, *kernels, DType::f64, B, T);
  model.init_parameters(7);
  model.train_mode(42, 0, 0);  // dropout (if any): the same masks in every forward
  // Move every parameter off its initial value (biases 0, norms 1) so that all terms matter.
  for (const ParamInfo& p : model.table().params) {
    Vec v = model.read<double>(p, model.params());
    for (size_t i = 0; i < v.size(); i++) v[i] += 0.1 * normal_at(99, hash_name(p.name), i);
    model.write(p, model.params(), v);
  }
  std::vector<int32_t> tokens(B * T), targets(B * T);
  for (int i = 0; i < B * T; i++) {
    tokens[i] = (i * 7 + 3) % cfg.vocab_size;
    targets[i] = (i * 11 + 5) % cfg.vocab_size;
  }
  model.zero_grad();
  model.forward(tokens.data(), targets.data(), B, T);
  model.backward(1.0f);

  double* params = model.params().as<double>();
  for (const ParamInfo& p : model.table().params) {
    Vec analytic = model.read<double>(p, model.grads());
    Vec numeric(analytic.size());
    for (int64_t i = 0; i < p.logical_numel(); i++) {
      double& x = params[p.offset + i];
      const double saved = x;
      x = saved + kStep;
      const double up = model.forward(tokens.data(), targets.data(), B, T);
      x = saved - kStep;
      const double down = model.forward(tokens.data(), targets.data(), B, T);
      x = saved;
      numeric[i] = (up - down) / (2 * kStep);
    }
    EXPECT_TRUE(all_close(analytic, numeric, kRtol, kAtol)) << p.name;
    // Padded vocabulary rows (embedding, untied head) get no gradient.
    const double* g = model.grads().as<double>() + p.offset;
    for (int64_t i = p.logical_numel(); i < p.numel; i++) ASSERT_EQ(g[i], 0.0) << p.name;
  }
}

ModelConfig tiny(Arch arch) {
  ModelConfig cfg;
  cfg.arch = arch;
  cfg.vocab_size = 20;
  cfg.vocab_multiple = 8;  // padded to 24: padded rows must get no gradient
  cfg.seq_len = 6;
  cfg.n_layer = 2;
  cfg.n_head = 2;
  cfg.d_model = 8;
  return cfg;
}

TEST_F(GradCheck, WholeGpt2) {
  check_whole_model(tiny(Arch::gpt2));
}

TEST_F(GradCheck, WholeGpt2WithDropout) {
  ModelConfig cfg = tiny(Arch::gpt2);
  cfg.dropout = 0.3;
  check_whole_model(cfg);
}

TEST_F(GradCheck, WholeGpt2UntiedWithoutBiases) {
  ModelConfig cfg = tiny(Arch::gpt2);
  cfg.tie_embeddings = false;
  cfg.bias = false;
  check_whole_model(cfg);
}

// Grouped-query attention (two query heads per key/value head), an untied head, SwiGLU, and
// Llama 3.1's rotary scaling with every band in play (as tests/dump_reference.cpp sets it).
TEST_F(GradCheck, WholeLlama) {
  ModelConfig cfg = tiny(Arch::llama);
  cfg.d_model = 16;
  cfg.n_head = 4;
  cfg.n_kv_head = 2;
  cfg.tie_embeddings = false;
  cfg.ffn_hidden = 12;
  cfg.rope_theta = 500.0;
  cfg.rope_scaling = {8.0, 1.0, 4.0, 32};
  check_whole_model(cfg);
}

// Multi-query attention and a tied head.
TEST_F(GradCheck, WholeLlamaMqaTied) {
  ModelConfig cfg = tiny(Arch::llama);
  cfg.n_kv_head = 1;
  cfg.tie_embeddings = true;
  cfg.ffn_hidden = 10;
  check_whole_model(cfg);
}

}  // namespace
}  // namespace trainer::test
