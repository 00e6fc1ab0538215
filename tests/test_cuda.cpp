// The CUDA backend against the CPU backend (the reference, itself checked against naive double
// precision and finite differences): every kernel forward and backward in fp32, bf16 and fp16;
// the whole model's loss and gradients; determinism; operators timed for a profiler (the trainer
// itself on the GPU: test_cuda_cli.cpp). Skipped, saying so, where no GPU is visible (CTest
// label `gpu`).
//
// Tolerances. fp32: the backends add in different orders (cuBLAS vs OpenBLAS tiles, warp
// reductions) and use different exp/tanh (CUDA's expf/tanhf vs our Cephes polynomials, a few ulp
// apart): sums of a few hundred O(1) terms agree to ~1e-6 relative, so rtol 1e-4 / atol 1e-5
// leave room. 16-bit outputs are rounded once from fp32 values that differ by those amounts, so
// they may land one unit in the last place apart: 2^-8 relative for bf16 (rtol 1e-2 with atol
// 1e-2 for values near zero), 2^-11 for fp16 (rtol 2e-3, atol 2e-3); kernels that chain several
// rounded 16-bit intermediates (attention, the model) get 3x.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cuda/gemm.h"
#include "kernels/kernels.h"
#include "model/architectures.h"
#include "model/stage_executor.h"
#include "test_util.h"

namespace trainer {

void PrintTo(DType t, std::ostream* os) {  // test names and messages say f32, not <00>
  *os << dtype_name(t);
}

namespace {

// cuBLASLt is loaded at run time (dlopen), not linked: it is there, with every function the
// GEMMs call, without a GPU as with one.
TEST(CudaBackend, LoadsCublasLtAtRunTime) {
  EXPECT_EQ(cuda::load_cublaslt().rfind("libcublasLt.so.", 0), 0u);
}

struct Tolerance {
  double rtol, atol;
};
Tolerance tolerance(DType t, double chain = 1) {
  switch (t) {
    case DType::bf16:
      return {1e-2 * chain, 1e-2 * chain};
    case DType::f16:
      return {2e-3 * chain, 2e-3 * chain};
    default:
      return {1e-4 * chain, 1e-5 * chain};
  }
}

// One buffer on each backend holding the same values.
struct Twin {
  DPtr cpu, gpu;
  int64_t n;
};

class Backends {
 public:
  Backends() : cpu(make_cpu_kernels()), gpu(make_cuda_kernels({0, 0.25})) {}
  ~Backends() {
    for (const Twin& t : owned_) {
      cpu->free(t.cpu);
      gpu->free(t.gpu);
    }
  }
  Twin make(const std::vector<float>& values, DType dtype) {
    const int64_t n = int64_t(values.size());
    Twin t{cpu->alloc(n, dtype), gpu->alloc(n, dtype), n};
    cpu->upload_f32(t.cpu, values.data(), n);
    gpu->upload_f32(t.gpu, values.data(), n);
    owned_.push_back(t);
    return t;
  }
  Twin random(int64_t n, DType dtype, uint64_t seed, double scale = 1.0) {
    return make(test::random_vector(size_t(n), seed, scale), dtype);
  }
  Twin zeros(int64_t n, DType dtype) { return make(std::vector<float>(size_t(n)), dtype); }
  // Runs f on both backends; pick(t) is t's buffer on the backend being run.
  void both(const std::function<void(Kernels&, std::function<DPtr(const Twin&)>)>& f) {
    f(*cpu, [](const Twin& t) { return t.cpu; });
    f(*gpu, [](const Twin& t) { return t.gpu; });
  }
  std::vector<float> host(Kernels& k, DPtr p, int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    k.download_f32(v.data(), p, n);
    return v;
  }
  // Makes the GPU's copy hold the CPU's values (so that a later step starts from equal inputs).
  void copy_cpu_to_gpu(const Twin& t) {
    const std::vector<float> v = host(*cpu, t.cpu, t.n);
    gpu->upload_f32(t.gpu, v.data(), t.n);
  }
  ::testing::AssertionResult close(const Twin& t, Tolerance tol) {
    return test::all_close(host(*gpu, t.gpu, t.n), host(*cpu, t.cpu, t.n), tol.rtol, tol.atol);
  }
  std::unique_ptr<Kernels> cpu, gpu;

 private:
  std::vector<Twin> owned_;
};

class CudaKernels : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override { REQUIRE_GPU(); }
};

std::string dtype_label(const ::testing::TestParamInfo<DType>& info) {
  return std::string(dtype_name(info.param));
}

TEST_P(CudaKernels, GeluResidualAndConvert) {
  const DType t = GetParam();
  Backends b;
  const int64_t n = 10007;
  Twin x = b.random(n, t, 1, 3.0), dy = b.random(n, t, 2), y = b.zeros(n, t), dx = b.zeros(n, t),
       sum = b.zeros(n, t);
  b.both([&](Kernels& k, auto at) {
    k.gelu_forward(at(y), at(x), n);
    k.gelu_backward(at(dx), at(x), at(dy), n);
    k.residual_forward(at(sum), at(x), at(dy), n);
  });
  EXPECT_TRUE(b.close(y, tolerance(t)));
  EXPECT_TRUE(b.close(dx, tolerance(t)));
  EXPECT_TRUE(b.close(sum, tolerance(t)));
  // Conversions into and out of this dtype round the same way on both backends: bitwise.
  for (DType to : {DType::f32, DType::bf16, DType::f16}) {
    Twin out = b.zeros(n, to);
    b.both([&](Kernels& k, auto at) { k.convert(at(out), at(x), n, 0); });
    EXPECT_TRUE(b.close(out, {0, 0})) << dtype_name(t) << " -> " << dtype_name(to);
  }
}

TEST_P(CudaKernels, EncoderForwardBackwardOnAVocabularySlice) {
  const DType t = GetParam();
  Backends b;
  const int B = 3, T = 17, C = 40;
  const VocabSlice v{10, 7, 8};  // tokens 10..16 are this rank's; 17 is padding
  std::vector<int32_t> tokens(B * T);
  for (int i = 0; i < B * T; i++) tokens[i] = (i * 7) % 25;  // repeats, inside and outside
  Twin wte = b.random(int64_t(v.width) * C, t, 1), wpe = b.random(int64_t(T) * C, t, 2);
  Twin out = b.zeros(int64_t(B) * T * C, t), dout = b.random(int64_t(B) * T * C, t, 3);
  for (DType g : {t, DType::f32}) {  // gradients in the compute dtype or in fp32
    Twin dwte = b.random(int64_t(v.width) * C, g, 4), dwpe = b.random(int64_t(T) * C, g, 5);
    b.both([&](Kernels& k, auto at) {
      k.encoder_forward(at(out), tokens.data(), at(wte), at(wpe), B, T, C, v);
      k.encoder_backward(at(dwte), at(dwpe), at(dout), tokens.data(), B, T, C, v);
    });
    EXPECT_TRUE(b.close(out, tolerance(t)));
    EXPECT_TRUE(b.close(dwte, tolerance(g)));
    EXPECT_TRUE(b.close(dwpe, tolerance(g)));
  }
}

TEST_P(CudaKernels, LayerNormForwardBackward) {
  const DType t = GetParam();
  Backends b;
  const int64_t N = 131;
  const int C = 200;
  Twin x = b.random(N * C, t, 1, 2.0), w = b.random(C, t, 2), bias = b.random(C, t, 3);
  Twin out = b.zeros(N * C, t), mean = b.zeros(N, DType::f32), rstd = b.zeros(N, DType::f32);
  Twin dout = b.random(N * C, t, 4), dx = b.random(N * C, t, 5);
  for (DType g : {t, DType::f32}) {
    Twin dw = b.random(C, g, 6), db = b.random(C, g, 7);
    b.both([&](Kernels& k, auto at) {
      k.layernorm_forward(at(out), at(mean), at(rstd), at(x), at(w), at(bias), N, C);
      k.layernorm_backward(at(dx), at(dw), at(db), at(dout), at(x), at(w), at(mean), at(rstd), N,
                           C);
    });
    EXPECT_TRUE(b.close(out, tolerance(t)));
    EXPECT_TRUE(b.close(mean, tolerance(DType::f32)));
    EXPECT_TRUE(b.close(rstd, tolerance(DType::f32)));
    EXPECT_TRUE(b.close(dx, tolerance(t, 2)));  // accumulated twice over the two rounds
    EXPECT_TRUE(b.close(dw, tolerance(g)));
    EXPECT_TRUE(b.close(db, tolerance(g)));
  }
  // The residual add fused in (in place, as the model calls it): the sum is rounded exactly as
  // the CPU's separate residual kernel stores it.
  Twin res = b.random(N * C, t, 8), other = b.random(N * C, t, 9);
  b.both([&](Kernels& k, auto at) {
    k.residual_layernorm_forward(at(res), at(out), at(mean), at(rstd), at(res), at(other), at(w),
                                 at(bias), N, C);
  });
  EXPECT_TRUE(b.close(res, tolerance(t)));
  EXPECT_TRUE(b.close(out, tolerance(t)));
  EXPECT_TRUE(b.close(rstd, tolerance(DType::f32)));
}

TEST_P(CudaKernels, MatmulForwardBackwardWithAndWithoutBias) {
  const DType t = GetParam();
  Backends b;
  const int64_t N = 96;
  const int IC = 72, OC = 56;
  Twin x = b.random(N * IC, t, 1), w = b.random(int64_t(OC) * IC, t, 2, 0.2),
       bias = b.random(OC, t, 3), dy = b.random(N * OC, t, 4);
  for (bool with_bias : {true, false})
    for (DType g : {t, DType::f32}) {
      Twin y = b.zeros(N * OC, t), dx = b.zeros(N * IC, t);
      Twin dw = b.random(int64_t(OC) * IC, g, 5), db = b.random(OC, g, 6);
      b.both([&](Kernels& k, auto at) {
        k.matmul_forward(at(y), at(x), at(w), with_bias ? at(bias) : DPtr{}, N, IC, OC);
        k.matmul_backward(at(dx), at(dw), with_bias ? at(db) : DPtr{}, at(dy), at(x), at(w), N, IC,
                          OC);
      });
      SCOPED_TRACE(testing::Message() << "bias " << with_bias << ", grads " << dtype_name(g));
      EXPECT_TRUE(b.close(y, tolerance(t)));
      EXPECT_TRUE(b.close(dx, tolerance(t)));
      EXPECT_TRUE(b.close(dw, tolerance(g)));
      EXPECT_TRUE(b.close(db, tolerance(g)));
    }
}

// The GELU fused into cuBLASLt's epilogues (OC = 56, ld a multiple of 8; 16-bit only) and the
// unfused path (OC = 52, and fp32). Fused, the activation is the GELU of the unrounded
// pre-activation and the input gradient is rounded once from fp32 products: two roundings apart
// from the CPU's separate kernels, so 2x; 4x for the fp16 fused input gradient, where cuBLASLt's
// own tanh, if an approximation good to ~5e-4 (as the hardware's: not measured, no GPU yet),
// moves GELU's slope by ~1.4e-3 near -2, times |dy W| up to ~5 (a wrong epilogue is still off by
// orders more). The backward starts from the CPU's pre and act, so that the weight gradient, a
// sum over 96 rows, compares a product of equal inputs. Which path ran is checked from the
// operators the backend reports: a fused epilogue cuBLASLt declined would otherwise pass as the
// fallback.
TEST_P(CudaKernels, MatmulWithGeluFusedAndFallback) {
  const DType t = GetParam();
  Backends b;
  const int64_t N = 96;
  const int IC = 72;
  std::vector<std::string> heard;
  b.gpu->set_op_observer([&](const char* op, double, std::chrono::steady_clock::time_point,
                             std::chrono::steady_clock::time_point) { heard.push_back(op); });
  auto times_heard = [&](const std::string& op) {
    b.gpu->synchronize();
    return std::count(heard.begin(), heard.end(), op);
  };
  for (int OC : {56, 52}) {
    const bool fused = is_half(t) && OC % 8 == 0;
    Twin x = b.random(N * IC, t, 1), w = b.random(int64_t(OC) * IC, t, 2, 0.2),
         bias = b.random(OC, t, 3), w2 = b.random(int64_t(IC) * OC, t, 4, 0.2),
         dy = b.random(N * IC, t, 5);
    Twin pre = b.zeros(N * OC, t), act = b.zeros(N * OC, t), dact = b.zeros(N * OC, t),
         dw2 = b.zeros(int64_t(IC) * OC, DType::f32), db2 = b.zeros(IC, DType::f32);
    b.both([&](Kernels& k, auto at) {
      k.matmul_gelu_forward(at(pre), at(act), at(x), at(w), at(bias), N, IC, OC);
    });
    SCOPED_TRACE(testing::Message() << "OC " << OC);
    EXPECT_EQ(times_heard("matmul_gelu_forward"), fused ? 1 : 0)
        << "the fused GELU forward (GELU_AUX_BIAS epilogue) " << (fused ? "did not run" : "ran");
    EXPECT_TRUE(b.close(pre, tolerance(t)));
    EXPECT_TRUE(b.close(act, tolerance(t, 2)));
    b.copy_cpu_to_gpu(pre);
    b.copy_cpu_to_gpu(act);
    b.both([&](Kernels& k, auto at) {
      // The next layer (OC -> IC) takes act; its input gradient goes back through the GELU.
      k.matmul_backward_gelu(at(dact), at(dw2), at(db2), at(dy), at(act), at(w2), at(pre), N, OC,
                             IC);
    });
    EXPECT_EQ(times_heard("matmul_backward_input_gelu"), fused ? 1 : 0)
        << "the fused GELU backward (DGELU epilogue) " << (fused ? "did not run" : "ran");
    heard.clear();
    EXPECT_TRUE(b.close(dact, tolerance(t, fused && t == DType::f16 ? 4 : 2)));
    EXPECT_TRUE(b.close(dw2, tolerance(t)));
    EXPECT_TRUE(b.close(db2, tolerance(DType::f32)));
  }
}

// The GPU's blocked attention (T = 300: blocks of 128, 128 and 44) against the CPU's: output,
// each row's log-sum-exp, and the gradient from them.
TEST_P(CudaKernels, CausalAttentionForwardBackward) {
  const DType t = GetParam();
  Backends b;
  const int B = 2, T = 300, C = 48, NH = 3;
  const int64_t BT = int64_t(B) * T, rows = int64_t(B) * NH * T;
  const DType stats = is_half(t) ? DType::f32 : t;
  Twin qkv = b.random(BT * 3 * C, t, 1), dout = b.random(BT * C, t, 2);
  Twin out = b.zeros(BT * C, t), dqkv = b.random(BT * 3 * C, t, 3), lse = b.zeros(rows, stats);
  b.cpu->attention_forward(out.cpu, lse.cpu, qkv.cpu, B, T, C, NH);
  b.cpu->attention_backward(dqkv.cpu, dout.cpu, qkv.cpu, out.cpu, lse.cpu, B, T, C, NH);
  b.gpu->attention_forward(out.gpu, lse.gpu, qkv.gpu, B, T, C, NH);
  b.gpu->attention_backward(dqkv.gpu, dout.gpu, qkv.gpu, out.gpu, lse.gpu, B, T, C, NH);
  EXPECT_TRUE(b.close(out, tolerance(t, 3)));
  EXPECT_TRUE(b.close(lse, tolerance(DType::f32, 3)));
  EXPECT_TRUE(b.close(dqkv, tolerance(t, 3)));
}

// Two vocabulary slices of a small vocabulary (at most one column a thread) and of a larger one,
// where each of a row's threads folds several columns into its running max and sum.
TEST_P(CudaKernels, CrossEntropyOverTwoVocabularySlices) {
  const DType t = GetParam();
  Backends b;
  const int64_t N = 45;
  // (vocabulary, slice: start, valid columns, padded width)
  const std::vector<std::pair<int, VocabSlice>> cases = {
      {50, {0, 50, 64}}, {50, {32, 18, 32}}, {5003, {0, 5003, 5008}}, {5003, {2500, 2503, 2560}}};
  for (const auto& [V, v] : cases) {
    std::vector<int32_t> targets(N);
    for (int64_t i = 0; i < N; i++) targets[i] = int32_t((i * 11) % V);
    Twin logits = b.random(N * v.width, t, 1, 3.0);
    Twin rowmax = b.zeros(N, DType::f32), sumexp = b.zeros(N, DType::f32),
         target = b.zeros(N, DType::f32), losses = b.zeros(N, DType::f32);
    std::vector<double> mean;
    b.both([&](Kernels& k, auto at) {
      k.crossentropy_stats(at(rowmax), at(sumexp), at(target), at(logits), targets.data(), N, v);
      mean.push_back(k.crossentropy_loss(at(losses), at(rowmax), at(sumexp), at(target), N));
    });
    SCOPED_TRACE(testing::Message() << "vocabulary " << V << ", slice start " << v.start);
    EXPECT_TRUE(b.close(rowmax, tolerance(t)));
    EXPECT_TRUE(b.close(target, tolerance(t)));
    EXPECT_TRUE(b.close(sumexp, tolerance(DType::f32)));
    EXPECT_TRUE(b.close(losses, tolerance(DType::f32)));
    EXPECT_NEAR(mean[1], mean[0], 1e-5 * std::abs(mean[0]));
    // Rebased on a larger max (as a tensor-parallel group's), then the gradients.
    std::vector<float> larger = b.host(*b.cpu, rowmax.cpu, N);
    for (float& m : larger) m += 0.75f;
    const Twin group_max = b.make(larger, DType::f32);
    b.both([&](Kernels& k, auto at) {
      k.crossentropy_rebase(at(rowmax), at(sumexp), at(group_max), N);
      k.crossentropy_backward(at(logits), at(rowmax), at(sumexp), targets.data(), 1.0f / float(N),
                              N, v);
    });
    EXPECT_TRUE(b.close(sumexp, tolerance(DType::f32)));
    EXPECT_TRUE(b.close(logits, tolerance(t)));
    // Both at once, as a training step runs them where one rank holds the vocabulary.
    const Twin fresh = b.random(N * v.width, t, 2, 3.0);
    b.both([&](Kernels& k, auto at) {
      k.crossentropy_stats_and_backward(at(rowmax), at(sumexp), at(target), at(fresh),
                                        targets.data(), 1.0f / float(N), N, v);
    });
    EXPECT_TRUE(b.close(rowmax, tolerance(t)));
    EXPECT_TRUE(b.close(target, tolerance(t)));
    EXPECT_TRUE(b.close(sumexp, tolerance(DType::f32)));
    EXPECT_TRUE(b.close(fresh, tolerance(t)));
  }
}

TEST_P(CudaKernels, SumOfSquaresAndAdamW) {
  const DType t = GetParam();
  Backends b;
  const int64_t n = 100003;
  Twin g = b.random(n, t, 1);
  double sums[2] = {0, 0};
  int i = 0;
  b.both([&](Kernels& k, auto at) { sums[i++] = k.sum_squares(at(g), n); });
  EXPECT_NEAR(sums[1], sums[0], 1e-9 * sums[0]);  // double accumulation of the same values
  // Over ranges (one kernel on the GPU), twice with other ranges in between: re-uploaded.
  const std::vector<Range> ranges = {{0, 1}, {5, 70000}, {70005, 0}, {80000, 20003}},
                           others = {{3, 4}};
  double over[3] = {0, 0, 0};
  i = 0;
  b.both([&](Kernels& k, auto at) { over[i++] = k.sum_squares(at(g), ranges); });
  b.gpu->sum_squares(g.gpu, others);
  over[2] = b.gpu->sum_squares(g.gpu, ranges);
  EXPECT_NEAR(over[1], over[0], 1e-9 * over[0]);
  EXPECT_EQ(over[2], over[1]);
  // AdamW on fp32 master weights and state with gradients of this dtype, three steps.
  Twin p = b.random(n, DType::f32, 2), m = b.zeros(n, DType::f32), v = b.zeros(n, DType::f32);
  for (int64_t step = 1; step <= 3; step++) {
    const AdamWArgs args{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step, 0.5f};
    b.both([&](Kernels& k, auto at) { k.adamw_update(at(p), at(g), at(m), at(v), n, args); });
  }
  EXPECT_TRUE(b.close(p, {1e-6, 1e-7}));
  EXPECT_TRUE(b.close(m, {1e-6, 1e-7}));
  EXPECT_TRUE(b.close(v, {1e-6, 1e-9}));
  // Momentum SGD, the same kernel's other rule, which keeps no v (null: touching it would
  // fault on the GPU).
  for (int64_t step = 1; step <= 3; step++) {
    AdamWArgs args{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step, 0.5f};
    args.sgd = true;
    b.both([&](Kernels& k, auto at) { k.adamw_update(at(p), at(g), at(m), DPtr{}, n, args); });
  }
  EXPECT_TRUE(b.close(p, {1e-6, 1e-7}));
  EXPECT_TRUE(b.close(m, {1e-6, 1e-7}));
}

TEST_P(CudaKernels, RmsNormForwardBackward) {
  const DType t = GetParam();
  Backends b;
  const int64_t N = 131;
  const int C = 200;
  const float eps = 1e-5f;
  Twin x = b.random(N * C, t, 1, 2.0), w = b.random(C, t, 2);
  Twin out = b.zeros(N * C, t), rstd = b.zeros(N, DType::f32);
  Twin dout = b.random(N * C, t, 4), dx = b.random(N * C, t, 5);
  for (DType g : {t, DType::f32}) {
    Twin dw = b.random(C, g, 6);
    b.both([&](Kernels& k, auto at) {
      k.rmsnorm_forward(at(out), at(rstd), at(x), at(w), N, C, eps);
      k.rmsnorm_backward(at(dx), at(dw), at(dout), at(x), at(w), at(rstd), N, C);
    });
    SCOPED_TRACE(testing::Message() << "grads " << dtype_name(g));
    EXPECT_TRUE(b.close(out, tolerance(t)));
    EXPECT_TRUE(b.close(rstd, tolerance(DType::f32)));
    EXPECT_TRUE(b.close(dx, tolerance(t, 2)));  // accumulated twice over the two rounds
    EXPECT_TRUE(b.close(dw, tolerance(g)));
  }
}

// GPT-2's bias = false: null bias and dbias, separate and with the residual fused in.
TEST_P(CudaKernels, LayerNormWithoutBias) {
  const DType t = GetParam();
  Backends b;
  const int64_t N = 67;
  const int C = 96;
  Twin x = b.random(N * C, t, 1, 2.0), w = b.random(C, t, 2), dout = b.random(N * C, t, 3);
  Twin out = b.zeros(N * C, t), mean = b.zeros(N, DType::f32), rstd = b.zeros(N, DType::f32);
  Twin dx = b.zeros(N * C, t), dw = b.zeros(C, DType::f32);
  b.both([&](Kernels& k, auto at) {
    k.layernorm_forward(at(out), at(mean), at(rstd), at(x), at(w), DPtr{}, N, C);
    k.layernorm_backward(at(dx), at(dw), DPtr{}, at(dout), at(x), at(w), at(mean), at(rstd), N, C);
  });
  EXPECT_TRUE(b.close(out, tolerance(t)));
  EXPECT_TRUE(b.close(dx, tolerance(t)));
  EXPECT_TRUE(b.close(dw, tolerance(DType::f32)));
  Twin res = b.random(N * C, t, 4), other = b.random(N * C, t, 5);
  b.both([&](Kernels& k, auto at) {
    k.residual_layernorm_forward(at(res), at(out), at(mean), at(rstd), at(res), at(other), at(w),
                                 DPtr{}, N, C);
  });
  EXPECT_TRUE(b.close(res, tolerance(t)));
  EXPECT_TRUE(b.close(out, tolerance(t)));
}

// Grouped-query (NKV = NH / 2) and multi-query (NKV = 1) attention: the GPU's blocked attention
// (T = 300: blocks of 128, 128 and 44; T = 64: one) against the CPU's, as the multi-head test
// above.
TEST_P(CudaKernels, GroupedQueryAttentionForwardBackward) {
  const DType t = GetParam();
  Backends b;
  // Head size 16 over three blocks; and a real model's 64 in one block of 64 rows.
  for (const auto& [T, C] : {std::pair{300, 64}, std::pair{64, 256}})
    for (int NKV : {2, 1}) {
      const int B = 2, NH = 4, hs = C / NH;
      const int64_t BT = int64_t(B) * T, rows = int64_t(B) * NH * T;
      SCOPED_TRACE(testing::Message() << "T " << T << " hs " << hs << " NKV " << NKV);
      const int64_t W = C + 2 * int64_t(NKV) * hs;
      Twin qkv = b.random(BT * W, t, 1), dout = b.random(BT * C, t, 2);
      Twin out = b.zeros(BT * C, t), dqkv = b.random(BT * W, t, 3),
           lse = b.zeros(rows, is_half(t) ? DType::f32 : t);
      b.cpu->attention_forward(out.cpu, lse.cpu, qkv.cpu, B, T, C, NH, NKV);
      b.cpu->attention_backward(dqkv.cpu, dout.cpu, qkv.cpu, out.cpu, lse.cpu, B, T, C, NH, NKV);
      b.gpu->attention_forward(out.gpu, lse.gpu, qkv.gpu, B, T, C, NH, NKV);
      b.gpu->attention_backward(dqkv.gpu, dout.gpu, qkv.gpu, out.gpu, lse.gpu, B, T, C, NH, NKV);
      EXPECT_TRUE(b.close(out, tolerance(t, 3)));
      EXPECT_TRUE(b.close(lse, tolerance(DType::f32, 3)));
      EXPECT_TRUE(b.close(dqkv, tolerance(t, 3)));
    }
}

// Generation over a key/value cache: the new queries of rows [q0, T) (one, or a prompt's worth).
// Head sizes 8 (lanes idle in each warp), 64 and 128 (two and four columns a lane).
TEST_P(CudaKernels, AttentionInference) {
  const DType t = GetParam();
  Backends b;
  struct Shape {
    int T, C, NH, NKV;
  };
  for (const Shape& sh : {Shape{77, 64, 8, 2}, Shape{200, 512, 8, 2}, Shape{160, 512, 4, 2}}) {
    const int T = sh.T, C = sh.C, NH = sh.NH, NKV = sh.NKV, hs = C / NH;
    SCOPED_TRACE(testing::Message() << "T " << T << " hs " << hs);
    Twin qkv = b.random(int64_t(T) * (C + 2 * NKV * hs), t, 1);
    for (int q0 : {0, T / 2, T - 1}) {
      Twin out = b.zeros(int64_t(T - q0) * C, t);
      b.both(
          [&](Kernels& k, auto at) { k.attention_inference(at(out), at(qkv), T, q0, C, NH, NKV); });
      EXPECT_TRUE(b.close(out, tolerance(t))) << "q0 " << q0;
    }
  }
}

// RoPE forward at an offset, then backward (on another tensor, as a gradient).
TEST_P(CudaKernels, RopeForwardBackward) {
  const DType t = GetParam();
  Backends b;
  const int B = 3, T = 17, NH = 8, NKV = 2, hs = 16, pos0 = 5, max_pos = 32;
  const int64_t n = int64_t(B) * T * (NH + 2 * NKV) * hs;
  ModelConfig llama;
  llama.arch = Arch::llama;
  llama.n_head = NH;
  llama.d_model = NH * hs;
  const std::vector<float> table = rope_table(llama, max_pos);
  Twin cos_sin = b.make(table, DType::f32), x = b.random(n, t, 1), g = b.random(n, t, 2);
  b.both([&](Kernels& k, auto at) {
    k.rope_forward(at(x), at(cos_sin), B, T, NH, NKV, hs, pos0);
    k.rope_backward(at(g), at(cos_sin), B, T, NH, NKV, hs, pos0);
  });
  EXPECT_TRUE(b.close(x, tolerance(t)));
  EXPECT_TRUE(b.close(g, tolerance(t)));
}

TEST_P(CudaKernels, SwiGluForwardBackward) {
  const DType t = GetParam();
  Backends b;
  const int64_t N = 97;
  const int F = 120;
  Twin gate_up = b.random(N * 2 * F, t, 1, 3.0), dout = b.random(N * F, t, 2);
  Twin out = b.zeros(N * F, t), d_gate_up = b.random(N * 2 * F, t, 3);
  b.both([&](Kernels& k, auto at) {
    k.swiglu_forward(at(out), at(gate_up), N, F);
    k.swiglu_backward(at(d_gate_up), at(dout), at(gate_up), N, F);
  });
  EXPECT_TRUE(b.close(out, tolerance(t)));
  EXPECT_TRUE(b.close(d_gate_up, tolerance(t)));
}

// The mask is a shared function of (seed, offset + i) and the scaling is one fp32 product, rounded
// as the CPU rounds: bitwise the CPU's, p = 0 included (a no-op).
TEST_P(CudaKernels, DropoutIsBitwiseTheCpus) {
  const DType t = GetParam();
  Backends b;
  const int64_t n = 100003;
  for (float p : {0.0f, 0.1f, 0.5f}) {
    Twin x = b.random(n, t, 1);
    b.both([&](Kernels& k, auto at) { k.dropout(at(x), n, p, 1234, 99); });
    EXPECT_TRUE(b.close(x, {0, 0})) << "p " << p;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaKernels,
                         ::testing::Values(DType::f32, DType::bf16, DType::f16), dtype_label);

TEST(Cuda, StochasticRoundingIsBitwiseTheCpusAndTheArenaSaysWhenFull) {
  REQUIRE_GPU();
  Backends b;
  const int64_t n = 50000;
  Twin x = b.random(n, DType::f32, 1, 10.0), out = b.zeros(n, DType::bf16);
  b.both([&](Kernels& k, auto at) { k.convert(at(out), at(x), n, 12345); });
  std::vector<bf16> cpu(n), gpu(n);
  b.cpu->copy_to_host(cpu.data(), out.cpu, n);
  b.gpu->copy_to_host(gpu.data(), out.gpu, n);
  for (int64_t i = 0; i < n; i++) ASSERT_EQ(cpu[i].bits, gpu[i].bits) << "element " << i;

  const Kernels::MemoryUse use = b.gpu->memory();
  EXPECT_GT(use.reserved, 0);
  EXPECT_GT(use.peak, 0);
  try {
    b.gpu->alloc(use.reserved, DType::f32);
    FAIL() << "allocated more than the arena holds";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("GPU memory"), std::string::npos) << e.what();
  }
}

// The model on both backends from the same initial weights: loss and every gradient.
struct ModelRun {
  double loss;
  std::vector<float> grads;
};
ModelRun model_run(Kernels& k, DType dtype) {
  ModelConfig cfg;
  cfg.vocab_size = 97, cfg.seq_len = 32, cfg.n_layer = 2, cfg.n_head = 4, cfg.d_model = 64;
  const int B = 3, T = 32;
  StageOptions o;
  o.grad_dtype = DType::f32;
  StageExecutor model(cfg, k, dtype, B, T, o);
  model.init_parameters(7);
  std::vector<int32_t> tokens(B * T), targets(B * T);
  for (int i = 0; i < B * T; i++) tokens[i] = (i * 13 + 5) % 97, targets[i] = (i * 29 + 1) % 97;
  ModelRun r;
  model.zero_grad();
  r.loss = model.forward(tokens.data(), targets.data(), B, T);
  model.backward(1.0f);
  r.grads.resize(size_t(model.table().total));
  k.download_f32(r.grads.data(), model.grads(), model.table().total);
  return r;
}

double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); i++) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  return std::sqrt(diff / norm);
}

TEST(Cuda, ModelLossAndGradientsMatchTheCpuAndRepeatBitwise) {
  REQUIRE_GPU();
  auto cpu = make_cpu_kernels();
  auto gpu = make_cuda_kernels({0, 0.25});
  // fp32: every gradient to 1e-4 relative; 16-bit: the gradient vector to a few percent of
  // its norm (activations rounded at every layer).
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(t));
    const ModelRun c = model_run(*cpu, t), g = model_run(*gpu, t), again = model_run(*gpu, t);
    EXPECT_NEAR(g.loss, c.loss, (t == DType::f32 ? 1e-5 : 1e-2) * c.loss);
    if (t == DType::f32)
      EXPECT_TRUE(test::all_close(g.grads, c.grads, 1e-3, 1e-5));
    else
      EXPECT_LT(relative_difference(g.grads, c.grads), 5e-2);
    EXPECT_EQ(again.loss, g.loss);  // the same GPU, the same algorithms: bitwise
    EXPECT_EQ(again.grads, g.grads);
  }
}

// For a profiler the backend times its operators with CUDA events: each one heard of once, with
// its FLOPs, between the host's issuing it and the wait for the device after it, in the order
// the stream ran them; nothing without an observer.
TEST(Cuda, OperatorsAreTimedWithEventsForAProfiler) {
  REQUIRE_GPU();
  using Clock = std::chrono::steady_clock;
  auto gpu = make_cuda_kernels({0, 0.25});
  const int64_t N = 512;
  const int IC = 256, OC = 768;
  const DPtr inp = gpu->alloc(N * IC, DType::f32),
             weight = gpu->alloc(int64_t(OC) * IC, DType::f32);
  const DPtr bias = gpu->alloc(OC, DType::f32), out = gpu->alloc(N * OC, DType::f32);
  const DPtr mean = gpu->alloc(N, DType::f32), rstd = gpu->alloc(N, DType::f32);
  const DPtr normed = gpu->alloc(N * OC, DType::f32);
  struct Heard {
    std::string op;
    double flops;
    Clock::time_point t0, t1;
  };
  std::vector<Heard> heard;
  gpu->set_op_observer(
      [&](const char* op, double flops, Clock::time_point t0, Clock::time_point t1) {
        heard.push_back({op, flops, t0, t1});
      });
  const auto issued = Clock::now();
  for (int i = 0; i < 3; i++) gpu->matmul_forward(out, inp, weight, bias, N, IC, OC);
  gpu->layernorm_forward(normed, mean, rstd, out, bias, bias, N, OC);
  gpu->synchronize();
  const auto waited = Clock::now();
  ASSERT_EQ(heard.size(), 4u);
  for (size_t i = 0; i < heard.size(); i++) {
    const Heard& h = heard[i];
    EXPECT_EQ(h.op, i < 3 ? "matmul_forward" : "layernorm_forward");
    EXPECT_EQ(h.flops, i < 3 ? 2.0 * N * IC * OC : 0.0);
    EXPECT_LT(h.t0, h.t1) << i;
    // (The anchor's clock is the host's after a wait: allow it a millisecond.)
    EXPECT_GE(h.t0, issued - std::chrono::milliseconds(1)) << i;
    EXPECT_LE(h.t1, waited + std::chrono::milliseconds(1)) << i;
    if (i > 0) {
      EXPECT_GE(h.t0, heard[i - 1].t1 - std::chrono::microseconds(50)) << i;
    }
  }
  gpu->set_op_observer({});
  gpu->matmul_forward(out, inp, weight, bias, N, IC, OC);
  gpu->synchronize();
  EXPECT_EQ(heard.size(), 4u);
  for (DPtr p : {inp, weight, bias, out, mean, rstd, normed}) gpu->free(p);
}

}  // namespace
}  // namespace trainer
