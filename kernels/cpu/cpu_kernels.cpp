// The CPU backend: dispatches each interface call to the template instantiation for the
// dtype of its arguments.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/host_memory.h"
#include "kernels/flop_meter.h"

namespace trainer {
namespace {

// Calls f(T{}) with T the C++ type of dtype.
template <class F>
decltype(auto) dispatch(DType t, F&& f) {
  switch (t) {
    case DType::f32:
      return f(float{});
    case DType::f64:
      return f(double{});
    case DType::bf16:
    case DType::f16:
    case DType::u8:
      break;  // 16-bit: computed in fp32 through Staging; bytes: not a kernel dtype
  }
  throw std::logic_error("kernel dispatched on a 16-bit dtype");
}

// Scratch buffers for staging, kept between kernel calls: a step stages the same sizes again
// and again, and fresh large allocations would fault their pages in every time.
class ScratchPool {
 public:
  float* take(int64_t n) {
    for (Buffer& b : buffers_)
      if (!b.busy && b.size >= n) {
        b.busy = true;
        return b.data.get();
      }
    buffers_.push_back(
        {std::make_unique_for_overwrite<float[]>(size_t(std::max<int64_t>(n, 1))), n, true});
    return buffers_.back().data.get();
  }
  void release(const float* p) {
    for (Buffer& b : buffers_)
      if (b.data.get() == p) b.busy = false;
  }

 private:
  struct Buffer {
    std::unique_ptr<float[]> data;
    int64_t size;
    bool busy;
  };
  std::vector<Buffer> buffers_;
};

// fp32 views of kernel arguments stored in 16-bit formats, so that every kernel computes in fp32
// while its inputs and outputs really are bf16/fp16 values: inputs are widened into scratch,
// outputs are computed in scratch and rounded to their storage format (to nearest, ties to
// even) when the views go away. Accumulating outputs start from their stored values.
class Staging {
 public:
  explicit Staging(ScratchPool& pool) : pool_(pool) {}
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging() {
    for (const Output& o : outputs_) narrow(o.dst, o.scratch, o.n);
    for (const float* p : taken_) pool_.release(p);
  }
  static bool any_half(std::initializer_list<DPtr> args) {
    for (DPtr a : args)
      if (a && is_half(a.dtype)) return true;
    return false;
  }
  DPtr in(DPtr p, int64_t n) {
    if (!p || !is_half(p.dtype)) return p;
    float* f = take(n);
    widen(f, p, n);
    return {reinterpret_cast<std::byte*>(f), DType::f32};
  }
  DPtr out(DPtr p, int64_t n, bool accumulate = false) {
    if (!p || !is_half(p.dtype)) return p;
    float* f = take(n);
    if (accumulate) widen(f, p, n);
    outputs_.push_back({p, n, f});
    return {reinterpret_cast<std::byte*>(f), DType::f32};
  }
  DPtr inout(DPtr p, int64_t n) { return out(p, n, true); }

  // fp16 through the compiler's _Float16 (IEEE round to nearest even; F16C instructions where
  // the CPU has them), checked against kernels/half.h on all 65536 patterns by the tests.
  static void widen(float* dst, DPtr src, int64_t n) {
    if (src.dtype == DType::bf16) {
      const bf16* s = src.as<bf16>();
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < n; i++) dst[i] = to_float(s[i]);
    } else {
      const _Float16* s = reinterpret_cast<const _Float16*>(src.p);
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < n; i++) dst[i] = float(s[i]);
    }
  }
  static void narrow(DPtr dst, const float* src, int64_t n) {
    if (dst.dtype == DType::bf16) {
      bf16* d = dst.as<bf16>();
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < n; i++) d[i] = to_bf16(src[i]);
    } else {
      _Float16* d = reinterpret_cast<_Float16*>(dst.p);
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < n; i++) d[i] = _Float16(src[i]);
    }
  }

 private:
  struct Output {
    DPtr dst;
    int64_t n;
    float* scratch;
  };
  float* take(int64_t n) {
    taken_.push_back(pool_.take(n));
    return taken_.back();
  }
  ScratchPool& pool_;
  std::vector<float*> taken_;
  std::vector<Output> outputs_;
};

// The row length of qkv: NH query heads, NKV key heads and NKV value heads of C / NH each.
int64_t qkv_width(int C, int NH, int NKV) {
  return C + 2 * int64_t(NKV) * (C / NH);
}

class CpuKernels final : public Kernels {
 public:
  std::string name() const override { return "cpu"; }

  double peak_flops(DType) const override { return meter_.best(); }
  MatmulTotals matmul_totals() const override {
    return {meter_.total_flops(), meter_.total_seconds()};
  }
  void set_peak_flops(double flops_per_s) override { meter_.raise(flops_per_s); }
  void set_op_observer(OpObserver observer) override { meter_.set_observer(std::move(observer)); }
  // The best of several short sgemm bursts at the size of a large layer, each timed alone so
  // that a disturbance (another process, a page fault, threads waking up) spoils one burst
  // and not the measurement; about 0.3 s on two cores.
  double measure_peak_flops() override {
    constexpr int n = 1024, bursts = 12;
    std::vector<float> a(size_t(n) * n, 0.5f), b(size_t(n) * n, 0.25f), c(size_t(n) * n);
    auto burst = [&] {
      cpu::gemm<float>(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    };
    burst();  // warms up caches and threads
    FlopMeter best;
    for (int r = 0; r < bursts; r++) best.timed("peak burst", 2.0 * n * n * n, burst);
    meter_.raise(best.best());
    return best.best();
  }

  DPtr alloc(int64_t elems, DType dtype) override {
    return {static_cast<std::byte*>(allocate_host_memory(size_t(elems) * dtype_size(dtype))),
            dtype};
  }
  void free(DPtr p) override { free_host_memory(p.p); }
  void zero(DPtr p, int64_t elems) override {
    const OpSpan span(meter_, "zero");
    cpu::zero_bytes(p.p, size_t(elems) * dtype_size(p.dtype));
  }
  void copy_to_host(void* dst, DPtr src, int64_t elems) override {
    std::memcpy(dst, src.p, elems * dtype_size(src.dtype));
  }
  void copy_from_host(DPtr dst, const void* src, int64_t elems) override {
    std::memcpy(dst.p, src, elems * dtype_size(dst.dtype));
  }
  void* alloc_host(int64_t bytes) override { return allocate_host_memory(size_t(bytes)); }
  void free_host(void* p) noexcept override { free_host_memory(p); }

  void encoder_forward(DPtr out, const int32_t* tokens, DPtr wte, DPtr wpe, int B, int T, int C,
                       VocabSlice v) override {
    const OpSpan span(meter_, "encoder_forward");
    if (Staging::any_half({out, wte, wpe})) {
      Staging s(pool_);
      return encoder_forward(s.out(out, int64_t(B) * T * C), tokens,
                             s.in(wte, int64_t(v.width) * C), s.in(wpe, int64_t(T) * C), B, T, C,
                             v);
    }
    dispatch(out.dtype, [&]<class S>(S) {
      cpu::encoder_forward(out.as<S>(), tokens, wte.as<S>(), wpe ? wpe.as<S>() : nullptr, B, T, C,
                           v);
    });
  }
  void encoder_backward(DPtr dwte, DPtr dwpe, DPtr dout, const int32_t* tokens, int B, int T, int C,
                        VocabSlice v) override {
    const OpSpan span(meter_, "encoder_backward");
    if (Staging::any_half({dwte, dwpe, dout})) {
      Staging s(pool_);
      return encoder_backward(s.inout(dwte, int64_t(v.width) * C), s.inout(dwpe, int64_t(T) * C),
                              s.in(dout, int64_t(B) * T * C), tokens, B, T, C, v);
    }
    dispatch(dout.dtype, [&]<class S>(S) {
      cpu::encoder_backward(dwte.as<S>(), dwpe ? dwpe.as<S>() : nullptr, dout.as<S>(), tokens, B, T,
                            C, v);
    });
  }
  void layernorm_forward(DPtr out, DPtr mean, DPtr rstd, DPtr inp, DPtr weight, DPtr bias,
                         int64_t N, int C) override {
    const OpSpan span(meter_, "layernorm_forward");
    if (Staging::any_half({out, mean, rstd, inp, weight, bias})) {
      Staging s(pool_);
      return layernorm_forward(s.out(out, N * C), s.out(mean, N), s.out(rstd, N), s.in(inp, N * C),
                               s.in(weight, C), s.in(bias, C), N, C);
    }
    dispatch(out.dtype, [&]<class S>(S) {
      cpu::layernorm_forward(out.as<S>(), mean.as<S>(), rstd.as<S>(), inp.as<S>(), weight.as<S>(),
                             bias ? bias.as<S>() : nullptr, N, C);
    });
  }
  void layernorm_backward(DPtr dinp, DPtr dweight, DPtr dbias, DPtr dout, DPtr inp, DPtr weight,
                          DPtr mean, DPtr rstd, int64_t N, int C) override {
    const OpSpan span(meter_, "layernorm_backward");
    if (Staging::any_half({dinp, dweight, dbias, dout, inp, weight, mean, rstd})) {
      Staging s(pool_);
      return layernorm_backward(s.inout(dinp, N * C), s.inout(dweight, C), s.inout(dbias, C),
                                s.in(dout, N * C), s.in(inp, N * C), s.in(weight, C), s.in(mean, N),
                                s.in(rstd, N), N, C);
    }
    dispatch(dout.dtype, [&]<class S>(S) {
      cpu::layernorm_backward(dinp.as<S>(), dweight.as<S>(), dbias ? dbias.as<S>() : nullptr,
                              dout.as<S>(), inp.as<S>(), weight.as<S>(), mean.as<S>(), rstd.as<S>(),
                              N, C, scratch_);
    });
  }
  void rmsnorm_forward(DPtr out, DPtr rstd, DPtr inp, DPtr weight, int64_t N, int C,
                       float eps) override {
    const OpSpan span(meter_, "rmsnorm_forward");
    if (Staging::any_half({out, rstd, inp, weight})) {
      Staging s(pool_);
      return rmsnorm_forward(s.out(out, N * C), s.out(rstd, N), s.in(inp, N * C), s.in(weight, C),
                             N, C, eps);
    }
    dispatch(out.dtype, [&]<class S>(S) {
      cpu::rmsnorm_forward(out.as<S>(), rstd.as<S>(), inp.as<S>(), weight.as<S>(), N, C, eps);
    });
  }
  void rmsnorm_backward(DPtr dinp, DPtr dweight, DPtr dout, DPtr inp, DPtr weight, DPtr rstd,
                        int64_t N, int C) override {
    const OpSpan span(meter_, "rmsnorm_backward");
    if (Staging::any_half({dinp, dweight, dout, inp, weight, rstd})) {
      Staging s(pool_);
      return rmsnorm_backward(s.inout(dinp, N * C), s.inout(dweight, C), s.in(dout, N * C),
                              s.in(inp, N * C), s.in(weight, C), s.in(rstd, N), N, C);
    }
    dispatch(dout.dtype, [&]<class S>(S) {
      cpu::rmsnorm_backward(dinp.as<S>(), dweight.as<S>(), dout.as<S>(), inp.as<S>(),
                            weight.as<S>(), rstd.as<S>(), N, C, scratch_);
    });
  }
  void matmul_forward(DPtr out, DPtr inp, DPtr weight, DPtr bias, int64_t N, int IC,
                      int OC) override {
    if (Staging::any_half({out, inp, weight, bias})) {
      Staging s(pool_);
      return matmul_forward(s.out(out, N * OC), s.in(inp, N * IC), s.in(weight, int64_t(OC) * IC),
                            s.in(bias, OC), N, IC, OC);
    }
    meter_.timed("matmul_forward", 2.0 * N * IC * OC, [&] {
      dispatch(out.dtype, [&]<class S>(S) {
        cpu::matmul_forward(out.as<S>(), inp.as<S>(), weight.as<S>(), bias ? bias.as<S>() : nullptr,
                            N, IC, OC);
      });
    });
  }
  void matmul_backward(DPtr dinp, DPtr dweight, DPtr dbias, DPtr dout, DPtr inp, DPtr weight,
                       int64_t N, int IC, int OC) override {
    if (Staging::any_half({dinp, dweight, dbias, dout, inp, weight})) {
      Staging s(pool_);
      return matmul_backward(s.out(dinp, N * IC), s.inout(dweight, int64_t(OC) * IC),
                             s.inout(dbias, OC), s.in(dout, N * OC), s.in(inp, N * IC),
                             s.in(weight, int64_t(OC) * IC), N, IC, OC);
    }
    meter_.timed("matmul_backward", (dinp ? 4.0 : 2.0) * N * IC * OC, [&] {
      dispatch(dout.dtype, [&]<class S>(S) {
        cpu::matmul_backward(dinp ? dinp.as<S>() : nullptr, dweight.as<S>(),
                             dbias ? dbias.as<S>() : nullptr, dout.as<S>(), inp.as<S>(),
                             weight.as<S>(), N, IC, OC);
      });
    });
  }
  using Kernels::attention_backward;  // the multi-head overloads
  using Kernels::attention_forward;
  // Model FLOPs, as the CUDA backend counts them: the backward's recomputed QK^T is not counted.
  void attention_forward(DPtr out, DPtr lse, DPtr qkv, int B, int T, int C, int NH,
                         int NKV) override {
    if (Staging::any_half({out, qkv})) {
      Staging s(pool_);
      return attention_forward(s.out(out, int64_t(B) * T * C), s.out(lse, int64_t(B) * NH * T),
                               s.in(qkv, int64_t(B) * T * qkv_width(C, NH, NKV)), B, T, C, NH, NKV);
    }
    meter_.timed("attention_forward", causal_attention_flops(B, T, C), [&] {
      dispatch(out.dtype, [&]<class S>(S) {
        cpu::attention_forward(out.as<S>(), lse.as<S>(), qkv.as<S>(), B, T, C, NH, NKV);
      });
    });
  }
  void attention_backward(DPtr dqkv, DPtr dout, DPtr qkv, DPtr out, DPtr lse, int B, int T, int C,
                          int NH, int NKV) override {
    if (Staging::any_half({dqkv, dout, qkv, out})) {
      Staging s(pool_);
      const int64_t qkv_elems = int64_t(B) * T * qkv_width(C, NH, NKV);
      return attention_backward(s.out(dqkv, qkv_elems), s.in(dout, int64_t(B) * T * C),
                                s.in(qkv, qkv_elems), s.in(out, int64_t(B) * T * C),
                                s.in(lse, int64_t(B) * NH * T), B, T, C, NH, NKV);
    }
    meter_.timed("attention_backward", 2 * causal_attention_flops(B, T, C), [&] {
      dispatch(dout.dtype, [&]<class S>(S) {
        cpu::attention_backward(dqkv.as<S>(), dout.as<S>(), qkv.as<S>(), out.as<S>(), lse.as<S>(),
                                B, T, C, NH, NKV);
      });
    });
  }
  void attention_part_forward(DPtr out, DPtr lse, DPtr q, DPtr kv,
                              const AttentionPart& p) override {
    const int64_t rows = int64_t(p.B) * p.T, width = qkv_width(p.C, p.NH, p.NKV);
    if (Staging::any_half({out, q, kv})) {
      Staging s(pool_);
      return attention_part_forward(s.inout(out, rows * p.C), s.inout(lse, rows * p.NH),
                                    s.in(q, rows * width), s.in(kv, rows * width), p);
    }
    meter_.timed(
        "attention_part_forward", 4.0 * double(cpu::attention_part_pairs(p)) * (p.C / p.NH), [&] {
          dispatch(out.dtype, [&]<class S>(S) {
            cpu::attention_part_forward(out.as<S>(), lse.as<S>(), q.as<S>(), kv.as<S>(), p);
          });
        });
  }
  void attention_part_backward(DPtr dq, DPtr dkv, DPtr dout, DPtr q, DPtr kv, DPtr out, DPtr lse,
                               const AttentionPart& p) override {
    const int64_t rows = int64_t(p.B) * p.T, width = qkv_width(p.C, p.NH, p.NKV);
    if (Staging::any_half({dq, dkv, dout, q, kv, out})) {
      Staging s(pool_);
      return attention_part_backward(s.inout(dq, rows * width), s.inout(dkv, rows * width),
                                     s.in(dout, rows * p.C), s.in(q, rows * width),
                                     s.in(kv, rows * width), s.in(out, rows * p.C),
                                     s.in(lse, rows * p.NH), p);
    }
    meter_.timed("attention_part_backward",
                 8.0 * double(cpu::attention_part_pairs(p)) * (p.C / p.NH), [&] {
                   dispatch(out.dtype, [&]<class S>(S) {
                     cpu::attention_part_backward(dq.as<S>(), dkv.as<S>(), dout.as<S>(), q.as<S>(),
                                                  kv.as<S>(), out.as<S>(), lse.as<S>(), p);
                   });
                 });
  }
  void attention_inference(DPtr out, DPtr qkv, int T, int q0, int C, int NH, int NKV) override {
    if (Staging::any_half({out, qkv})) {
      Staging s(pool_);
      return attention_inference(s.out(out, int64_t(T - q0) * C),
                                 s.in(qkv, int64_t(T) * qkv_width(C, NH, NKV)), T, q0, C, NH, NKV);
    }
    dispatch(out.dtype, [&]<class S>(S) {
      cpu::attention_inference(out.as<S>(), qkv.as<S>(), T, q0, C, NH, NKV);
    });
  }
  void rope_forward(DPtr qkv, DPtr cos_sin, int B, int T, int NH, int NKV, int hs,
                    int pos0) override {
    rope(qkv, cos_sin, B, T, NH, NKV, hs, pos0, false);
  }
  void rope_backward(DPtr dqkv, DPtr cos_sin, int B, int T, int NH, int NKV, int hs,
                     int pos0) override {
    rope(dqkv, cos_sin, B, T, NH, NKV, hs, pos0, true);
  }
  void swiglu_forward(DPtr out, DPtr gate_up, int64_t N, int F) override {
    const OpSpan span(meter_, "swiglu_forward");
    if (Staging::any_half({out, gate_up})) {
      Staging s(pool_);
      return swiglu_forward(s.out(out, N * F), s.in(gate_up, 2 * N * F), N, F);
    }
    dispatch(out.dtype,
             [&]<class S>(S) { cpu::swiglu_forward(out.as<S>(), gate_up.as<S>(), N, F); });
  }
  void swiglu_backward(DPtr d_gate_up, DPtr dout, DPtr gate_up, int64_t N, int F) override {
    const OpSpan span(meter_, "swiglu_backward");
    if (Staging::any_half({d_gate_up, dout, gate_up})) {
      Staging s(pool_);
      return swiglu_backward(s.out(d_gate_up, 2 * N * F), s.in(dout, N * F),
                             s.in(gate_up, 2 * N * F), N, F);
    }
    dispatch(dout.dtype, [&]<class S>(S) {
      cpu::swiglu_backward(d_gate_up.as<S>(), dout.as<S>(), gate_up.as<S>(), N, F);
    });
  }
  void dropout(DPtr x, int64_t n, float p, uint64_t seed, int64_t offset) override {
    if (p == 0) return;  // a no-op, and no 16-bit staging round trip either
    const OpSpan span(meter_, "dropout");
    if (Staging::any_half({x})) {
      Staging s(pool_);
      return dropout(s.inout(x, n), n, p, seed, offset);
    }
    dispatch(x.dtype, [&]<class S>(S) { cpu::dropout(x.as<S>(), n, p, seed, offset); });
  }
  void gelu_forward(DPtr out, DPtr inp, int64_t n) override {
    const OpSpan span(meter_, "gelu_forward");
    if (Staging::any_half({out, inp})) {
      Staging s(pool_);
      return gelu_forward(s.out(out, n), s.in(inp, n), n);
    }
    dispatch(out.dtype, [&]<class S>(S) { cpu::gelu_forward(out.as<S>(), inp.as<S>(), n); });
  }
  void gelu_backward(DPtr dinp, DPtr inp, DPtr dout, int64_t n) override {
    const OpSpan span(meter_, "gelu_backward");
    if (Staging::any_half({dinp, inp, dout})) {
      Staging s(pool_);
      return gelu_backward(s.out(dinp, n), s.in(inp, n), s.in(dout, n), n);
    }
    dispatch(dout.dtype,
             [&]<class S>(S) { cpu::gelu_backward(dinp.as<S>(), inp.as<S>(), dout.as<S>(), n); });
  }
  void residual_forward(DPtr out, DPtr a, DPtr b, int64_t n) override {
    const OpSpan span(meter_, "residual_forward");
    if (Staging::any_half({out, a, b})) {
      Staging s(pool_);
      return residual_forward(s.out(out, n), s.in(a, n), s.in(b, n), n);
    }
    dispatch(out.dtype,
             [&]<class S>(S) { cpu::residual_forward(out.as<S>(), a.as<S>(), b.as<S>(), n); });
  }
  void crossentropy_stats(DPtr rowmax, DPtr sumexp, DPtr target_logit, DPtr logits,
                          const int32_t* targets, int64_t N, VocabSlice v) override {
    const OpSpan span(meter_, "crossentropy_stats");
    if (Staging::any_half({rowmax, sumexp, target_logit, logits})) {
      Staging s(pool_);
      return crossentropy_stats(s.out(rowmax, N), s.out(sumexp, N), s.out(target_logit, N),
                                s.in(logits, N * v.width), targets, N, v);
    }
    dispatch(logits.dtype, [&]<class S>(S) {
      cpu::crossentropy_stats(rowmax.as<S>(), sumexp.as<S>(), target_logit.as<S>(), logits.as<S>(),
                              targets, N, v);
    });
  }
  void crossentropy_rebase(DPtr rowmax, DPtr sumexp, DPtr group_max, int64_t N) override {
    const OpSpan span(meter_, "crossentropy_rebase");
    if (Staging::any_half({rowmax, sumexp, group_max})) {
      Staging s(pool_);
      return crossentropy_rebase(s.inout(rowmax, N), s.inout(sumexp, N), s.in(group_max, N), N);
    }
    dispatch(rowmax.dtype, [&]<class S>(S) {
      cpu::crossentropy_rebase(rowmax.as<S>(), sumexp.as<S>(), group_max.as<S>(), N);
    });
  }
  double crossentropy_loss(DPtr losses, DPtr rowmax, DPtr sumexp, DPtr target_logit,
                           int64_t N) override {
    const OpSpan span(meter_, "crossentropy_loss");
    if (Staging::any_half({losses, rowmax, sumexp, target_logit})) {
      Staging s(pool_);
      return crossentropy_loss(s.out(losses, N), s.in(rowmax, N), s.in(sumexp, N),
                               s.in(target_logit, N), N);
    }
    return dispatch(losses.dtype, [&]<class S>(S) {
      return cpu::crossentropy_loss(losses.as<S>(), rowmax.as<S>(), sumexp.as<S>(),
                                    target_logit.as<S>(), N);
    });
  }
  void crossentropy_backward(DPtr logits, DPtr rowmax, DPtr sumexp, const int32_t* targets,
                             float dloss, int64_t N, VocabSlice v) override {
    const OpSpan span(meter_, "crossentropy_backward");
    if (Staging::any_half({logits, rowmax, sumexp})) {
      Staging s(pool_);
      return crossentropy_backward(s.inout(logits, N * v.width), s.in(rowmax, N), s.in(sumexp, N),
                                   targets, dloss, N, v);
    }
    dispatch(logits.dtype, [&]<class S>(S) {
      cpu::crossentropy_backward(logits.as<S>(), rowmax.as<S>(), sumexp.as<S>(), targets, dloss, N,
                                 v);
    });
  }
  void crossentropy_stats_and_backward(DPtr rowmax, DPtr sumexp, DPtr target_logit, DPtr logits,
                                       const int32_t* targets, float dloss, int64_t N,
                                       VocabSlice v) override {
    const OpSpan span(meter_, "crossentropy_stats_and_backward");
    if (Staging::any_half({rowmax, sumexp, target_logit, logits})) {
      Staging s(pool_);
      return crossentropy_stats_and_backward(s.out(rowmax, N), s.out(sumexp, N),
                                             s.out(target_logit, N), s.inout(logits, N * v.width),
                                             targets, dloss, N, v);
    }
    dispatch(logits.dtype, [&]<class S>(S) {
      cpu::crossentropy_stats_and_backward(rowmax.as<S>(), sumexp.as<S>(), target_logit.as<S>(),
                                           logits.as<S>(), targets, dloss, N, v);
    });
  }
  void convert(DPtr dst, DPtr src, int64_t n, uint64_t stochastic_seed) override {
    const OpSpan span(meter_, "convert");
    if (dst.dtype == src.dtype) {
      if (dst.p != src.p) std::memcpy(dst.p, src.p, n * dtype_size(dst.dtype));
      return;
    }
    Staging s(pool_);
    const DPtr from = s.in(src, n);  // fp32 (or f64)
    if (dst.dtype == DType::bf16 && stochastic_seed != 0 && from.dtype == DType::f32) {
      const float* f = from.as<float>();
      bf16* d = dst.as<bf16>();
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; i++)  // counter-based bits: the same for any thread count
        d[i] = to_bf16_stochastic(f[i], uint32_t(random_bits(stochastic_seed, uint64_t(i))));
      return;
    }
    if (is_half(dst.dtype) && from.dtype == DType::f32)
      return Staging::narrow(dst, from.as<float>(), n);
    if (dst.dtype == DType::f32 && from.dtype == DType::f32) {
      std::memcpy(dst.p, from.p, n * 4);
      return;
    }
    dispatch(dst.dtype, [&]<class D>(D) {
      dispatch(from.dtype, [&]<class S>(S) {
        const S* f = from.as<S>();
        D* d = dst.as<D>();
        for (int64_t i = 0; i < n; i++) d[i] = D(f[i]);
      });
    });
  }
  double sum_squares(DPtr x, const std::vector<Range>& ranges) override {
    const OpSpan span(meter_, "sum_squares");
    double total = 0;
    for (const Range& r : ranges) total += sum_squares(x + r.offset, r.count);
    return total;
  }
  double sum_squares(DPtr x, int64_t n) override {
    const OpSpan span(meter_, "sum_squares");
    if (Staging::any_half({x})) {
      Staging s(pool_);
      return sum_squares(s.in(x, n), n);
    }
    return dispatch(x.dtype, [&]<class S>(S) { return cpu::sum_squares(x.as<S>(), n); });
  }
  void adamw_update(DPtr param, DPtr grad, DPtr m, DPtr v, int64_t n,
                    const AdamWArgs& args) override {
    const OpSpan span(meter_, "adamw_update");
    if (Staging::any_half({param, grad, m, v})) {
      Staging s(pool_);
      return adamw_update(s.inout(param, n), s.in(grad, n), s.inout(m, n), s.inout(v, n), n, args);
    }
    dispatch(param.dtype, [&]<class S>(S) {
      cpu::adamw_update(param.as<S>(), grad.as<S>(), m.as<S>(), v.as<S>(), n, args);
    });
  }

 private:
  // RoPE forward or (inverse) backward. The table is fp32 whatever the activations; f64
  // arguments rotate by its angles widened to double.
  void rope(DPtr qkv, DPtr cos_sin, int B, int T, int NH, int NKV, int hs, int pos0, bool inverse) {
    const OpSpan span(meter_, inverse ? "rope_backward" : "rope_forward");
    if (cos_sin.dtype != DType::f32)
      throw std::invalid_argument("rope: the cos/sin table must be f32, not " +
                                  std::string(dtype_name(cos_sin.dtype)));
    if (Staging::any_half({qkv})) {
      Staging s(pool_);
      const DPtr staged = s.inout(qkv, int64_t(B) * T * (NH + 2 * NKV) * hs);
      return rope(staged, cos_sin, B, T, NH, NKV, hs, pos0, inverse);
    }
    dispatch(qkv.dtype, [&]<class S>(S) {
      cpu::rope(qkv.as<S>(), cos_sin.as<float>(), B, T, NH, NKV, hs, pos0, inverse);
    });
  }

  std::vector<double> scratch_;  // per-thread partial sums, sized once
  ScratchPool pool_;
  FlopMeter meter_;
};

}  // namespace

std::unique_ptr<Kernels> make_cpu_kernels() {
  return std::make_unique<CpuKernels>();
}

}  // namespace trainer
