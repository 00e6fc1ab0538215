// Mixed precision: the loss scaler's rules, and kernels on 16-bit storage, which must equal
// the fp32 kernel on the widened inputs with every output rounded to its storage format.
#include <gtest/gtest.h>

#include "kernels/half.h"
#include "test_util.h"
#include "trainer/loss_scaler.h"

namespace trainer {
namespace {

PrecisionConfig fp16(int growth_interval = 3, int hysteresis = 1) {
  PrecisionConfig p;
  p.compute = "fp16";
  p.initial_scale = 1024;
  p.growth_interval = growth_interval;
  p.hysteresis = hysteresis;
  p.min_scale = 256;
  p.max_min_scale_overflows = 3;
  return p;
}

TEST(LossScaler, GrowsAfterTheIntervalAndBacksOffOnOverflow) {
  LossScaler s(fp16());
  EXPECT_TRUE(s.dynamic());
  EXPECT_EQ(s.scale(), 1024);
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 1024);
  s.update(false);  // the third clean step in a row
  EXPECT_EQ(s.scale(), 2048);
  s.update(false);
  s.update(true);  // an overflow halves the scale and restarts the interval
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_EQ(s.overflows(), 1);
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 1024);
  s.update(false);
  EXPECT_EQ(s.scale(), 2048);
}

TEST(LossScaler, HysteresisToleratesOverflowsBeforeBackingOff) {
  LossScaler s(fp16(100, 2));
  s.update(true);
  EXPECT_EQ(s.scale(), 1024);
  s.update(true);
  EXPECT_EQ(s.scale(), 512);
  s.update(true);
  EXPECT_EQ(s.scale(), 512);
  s.update(true);
  EXPECT_EQ(s.scale(), 256);
  EXPECT_EQ(s.overflows(), 4);
}

TEST(LossScaler, OverflowsAtTheMinimumScaleAreAnErrorNotALoop) {
  LossScaler s(fp16(100, 1));
  s.update(true);   // 512
  s.update(true);   // 256 = min
  s.update(true);   // at the minimum: 1
  s.update(false);  // a clean step resets the count
  s.update(true);
  s.update(true);
  EXPECT_EQ(s.scale(), 256);
  try {
    s.update(true);
    FAIL() << "expected TrainingDiverged";
  } catch (const TrainingDiverged& e) {
    EXPECT_STREQ(e.what(),
                 "the gradients overflowed in 3 steps in a row at the minimum loss scale 256 "
                 "(precision.min_scale): the loss or the gradients are not finite even unscaled");
  }
}

TEST(LossScaler, StaticAndUnscaledPrecisions) {
  PrecisionConfig p = fp16();
  p.loss_scale = 8192;  // the seed use case's static scale
  LossScaler fixed(p);
  EXPECT_FALSE(fixed.dynamic());
  for (bool overflow : {true, false, false, false, true}) fixed.update(overflow);
  EXPECT_EQ(fixed.scale(), 8192);
  EXPECT_EQ(fixed.overflows(), 2);
  p.compute = "bf16";
  EXPECT_EQ(LossScaler(p).scale(), 1);
}

template <class H>
std::vector<H> narrow(const std::vector<float>& v) {
  std::vector<H> out(v.size());
  for (size_t i = 0; i < v.size(); i++) {
    if constexpr (std::is_same_v<H, bf16>)
      out[i] = to_bf16(v[i]);
    else
      out[i] = to_f16(v[i]);
  }
  return out;
}
template <class H>
std::vector<float> widen(const std::vector<H>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); i++) out[i] = to_float(v[i]);
  return out;
}
template <class H>
std::vector<uint16_t> bits(const std::vector<H>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); i++) out[i] = v[i].bits;
  return out;
}

// A linear layer's forward and backward, and a layernorm's backward (accumulating outputs), on
// 16-bit buffers, bit for bit against fp32 on the same (rounded) values, then rounded.
template <class H>
void check_staged_kernels() {
  test::Device d;
  const int N = 24, IC = 40, OC = 33;
  auto x = narrow<H>(test::random_vector(N * IC, 1)),
       w = narrow<H>(test::random_vector(OC * IC, 2));
  auto b = narrow<H>(test::random_vector(OC, 3)), dy = narrow<H>(test::random_vector(N * OC, 4));
  auto dw0 = narrow<H>(test::random_vector(OC * IC, 5));
  // 16-bit storage.
  DPtr y16 = d.upload(std::vector<H>(N * OC)), dx16 = d.upload(std::vector<H>(N * IC));
  DPtr dw16 = d.upload(dw0), db32 = d.upload(std::vector<float>(OC, 0.5f));
  d.k->matmul_forward(y16, d.upload(x), d.upload(w), d.upload(b), N, IC, OC);
  d.k->matmul_backward(dx16, dw16, db32, d.upload(dy), d.upload(x), d.upload(w), N, IC, OC);
  // fp32 on the same values.
  DPtr y = d.upload(std::vector<float>(N * OC)), dx = d.upload(std::vector<float>(N * IC));
  DPtr dw = d.upload(widen(dw0)), db = d.upload(std::vector<float>(OC, 0.5f));
  d.k->matmul_forward(y, d.upload(widen(x)), d.upload(widen(w)), d.upload(widen(b)), N, IC, OC);
  d.k->matmul_backward(dx, dw, db, d.upload(widen(dy)), d.upload(widen(x)), d.upload(widen(w)), N,
                       IC, OC);
  EXPECT_EQ(bits(d.download<H>(y16, N * OC)), bits(narrow<H>(d.download<float>(y, N * OC))));
  EXPECT_EQ(bits(d.download<H>(dx16, N * IC)), bits(narrow<H>(d.download<float>(dx, N * IC))));
  EXPECT_EQ(bits(d.download<H>(dw16, OC * IC)), bits(narrow<H>(d.download<float>(dw, OC * IC))));
  EXPECT_EQ(d.download<float>(db32, OC), d.download<float>(db, OC));  // fp32 gradient stays fp32

  // convert: fp32 -> 16-bit rounds to nearest even; back is exact.
  auto v = test::random_vector(1000, 6, 100.0);
  DPtr h = d.upload(std::vector<H>(1000)), back = d.upload(std::vector<float>(1000));
  d.k->convert(h, d.upload(v), 1000, 0);
  EXPECT_EQ(bits(d.download<H>(h, 1000)), bits(narrow<H>(v)));
  d.k->convert(back, h, 1000, 0);
  EXPECT_EQ(d.download<float>(back, 1000), widen(narrow<H>(v)));
}

TEST(StagedKernels, Bf16EqualsRoundedFp32) {
  check_staged_kernels<bf16>();
}
TEST(StagedKernels, Fp16EqualsRoundedFp32) {
  check_staged_kernels<f16>();
}

TEST(StagedKernels, StochasticConvertIsDeterministicAndUnbiased) {
  test::Device d;
  const int n = 100000;
  std::vector<float> v(n, 1.0f + 0x1p-10f);  // a quarter of the way from 1 to the next bf16
  DPtr a = d.upload(std::vector<bf16>(n)), b = d.upload(std::vector<bf16>(n));
  d.k->convert(a, d.upload(v), n, 7);
  d.k->convert(b, d.upload(v), n, 7);
  const auto ha = d.download<bf16>(a, n);
  EXPECT_EQ(bits(ha), bits(d.download<bf16>(b, n)));
  double mean = 0;
  for (bf16 x : ha) mean += to_float(x) / n;
  EXPECT_NEAR(mean, 1.0 + 0x1p-10, 0x1p-7 * 0.02);  // within 2% of one bf16 step
}

}  // namespace
}  // namespace trainer
