// The CPU backend: dispatches each interface call to the template instantiation for the
// dtype of its arguments.
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>

#include "kernels/cpu/cpu_ops.h"

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
  }
  throw std::logic_error("unknown dtype");
}

class CpuKernels final : public Kernels {
 public:
  std::string name() const override { return "cpu"; }

  DPtr alloc(int64_t elems, DType dtype) override {
    size_t bytes = std::max<size_t>(64, (elems * dtype_size(dtype) + 63) / 64 * 64);
    void* p = std::aligned_alloc(64, bytes);
    if (!p) throw std::bad_alloc();
    std::memset(p, 0, bytes);
    return {static_cast<std::byte*>(p), dtype};
  }
  void free(DPtr p) override { std::free(p.p); }
  void zero(DPtr p, int64_t elems) override { std::memset(p.p, 0, elems * dtype_size(p.dtype)); }
  void copy_to_host(void* dst, DPtr src, int64_t elems) override {
    std::memcpy(dst, src.p, elems * dtype_size(src.dtype));
  }
  void copy_from_host(DPtr dst, const void* src, int64_t elems) override {
    std::memcpy(dst.p, src, elems * dtype_size(dst.dtype));
  }

  void encoder_forward(DPtr out, const int32_t* tokens, DPtr wte, DPtr wpe, int B, int T, int C,
                       VocabSlice v) override {
    dispatch(out.dtype, [&]<class S>(S) {
      cpu::encoder_forward(out.as<S>(), tokens, wte.as<S>(), wpe ? wpe.as<S>() : nullptr, B, T, C,
                           v);
    });
  }
  void encoder_backward(DPtr dwte, DPtr dwpe, DPtr dout, const int32_t* tokens, int B, int T, int C,
                        VocabSlice v) override {
    dispatch(dout.dtype, [&]<class S>(S) {
      cpu::encoder_backward(dwte.as<S>(), dwpe ? dwpe.as<S>() : nullptr, dout.as<S>(), tokens, B, T,
                            C, v);
    });
  }
  void layernorm_forward(DPtr out, DPtr mean, DPtr rstd, DPtr inp, DPtr weight, DPtr bias,
                         int64_t N, int C) override {
    dispatch(out.dtype, [&]<class S>(S) {
      cpu::layernorm_forward(out.as<S>(), mean.as<S>(), rstd.as<S>(), inp.as<S>(), weight.as<S>(),
                             bias.as<S>(), N, C);
    });
  }
  void layernorm_backward(DPtr dinp, DPtr dweight, DPtr dbias, DPtr dout, DPtr inp, DPtr weight,
                          DPtr mean, DPtr rstd, int64_t N, int C) override {
    dispatch(dout.dtype, [&]<class S>(S) {
      cpu::layernorm_backward(dinp.as<S>(), dweight.as<S>(), dbias.as<S>(), dout.as<S>(),
                              inp.as<S>(), weight.as<S>(), mean.as<S>(), rstd.as<S>(), N, C,
                              scratch_);
    });
  }
  void matmul_forward(DPtr out, DPtr inp, DPtr weight, DPtr bias, int64_t N, int IC,
                      int OC) override {
    dispatch(out.dtype, [&]<class S>(S) {
      cpu::matmul_forward(out.as<S>(), inp.as<S>(), weight.as<S>(), bias ? bias.as<S>() : nullptr,
                          N, IC, OC);
    });
  }
  void matmul_backward(DPtr dinp, DPtr dweight, DPtr dbias, DPtr dout, DPtr inp, DPtr weight,
                       int64_t N, int IC, int OC) override {
    dispatch(dout.dtype, [&]<class S>(S) {
      cpu::matmul_backward(dinp ? dinp.as<S>() : nullptr, dweight.as<S>(),
                           dbias ? dbias.as<S>() : nullptr, dout.as<S>(), inp.as<S>(),
                           weight.as<S>(), N, IC, OC);
    });
  }
  void attention_forward(DPtr out, DPtr att, DPtr qkv, int B, int T, int C, int NH) override {
    dispatch(out.dtype, [&]<class S>(S) {
      cpu::attention_forward(out.as<S>(), att.as<S>(), qkv.as<S>(), B, T, C, NH);
    });
  }
  void attention_backward(DPtr dqkv, DPtr datt, DPtr dout, DPtr qkv, DPtr att, int B, int T, int C,
                          int NH) override {
    dispatch(dout.dtype, [&]<class S>(S) {
      cpu::attention_backward(dqkv.as<S>(), datt.as<S>(), dout.as<S>(), qkv.as<S>(), att.as<S>(), B,
                              T, C, NH);
    });
  }
  void gelu_forward(DPtr out, DPtr inp, int64_t n) override {
    dispatch(out.dtype, [&]<class S>(S) { cpu::gelu_forward(out.as<S>(), inp.as<S>(), n); });
  }
  void gelu_backward(DPtr dinp, DPtr inp, DPtr dout, int64_t n) override {
    dispatch(dout.dtype,
             [&]<class S>(S) { cpu::gelu_backward(dinp.as<S>(), inp.as<S>(), dout.as<S>(), n); });
  }
  void residual_forward(DPtr out, DPtr a, DPtr b, int64_t n) override {
    dispatch(out.dtype,
             [&]<class S>(S) { cpu::residual_forward(out.as<S>(), a.as<S>(), b.as<S>(), n); });
  }
  void crossentropy_max(DPtr rowmax, DPtr logits, int64_t N, VocabSlice v) override {
    dispatch(logits.dtype,
             [&]<class S>(S) { cpu::crossentropy_max(rowmax.as<S>(), logits.as<S>(), N, v); });
  }
  void crossentropy_sumexp(DPtr sumexp, DPtr target_logit, DPtr logits, DPtr rowmax,
                           const int32_t* targets, int64_t N, VocabSlice v) override {
    dispatch(logits.dtype, [&]<class S>(S) {
      cpu::crossentropy_sumexp(sumexp.as<S>(), target_logit.as<S>(), logits.as<S>(), rowmax.as<S>(),
                               targets, N, v);
    });
  }
  double crossentropy_finish(DPtr losses, DPtr probs, DPtr rowmax, DPtr sumexp, DPtr target_logit,
                             int64_t N, VocabSlice v) override {
    return dispatch(probs.dtype, [&]<class S>(S) {
      return cpu::crossentropy_finish(losses.as<S>(), probs.as<S>(), rowmax.as<S>(), sumexp.as<S>(),
                                      target_logit.as<S>(), N, v);
    });
  }
  void crossentropy_backward(DPtr probs, const int32_t* targets, float dloss, int64_t N,
                             VocabSlice v) override {
    dispatch(probs.dtype,
             [&]<class S>(S) { cpu::crossentropy_backward(probs.as<S>(), targets, dloss, N, v); });
  }
  double sum_squares(DPtr x, int64_t n) override {
    return dispatch(x.dtype, [&]<class S>(S) { return cpu::sum_squares(x.as<S>(), n); });
  }
  void adamw_update(DPtr param, DPtr grad, DPtr m, DPtr v, int64_t n,
                    const AdamWArgs& args) override {
    dispatch(param.dtype, [&]<class S>(S) {
      cpu::adamw_update(param.as<S>(), grad.as<S>(), m.as<S>(), v.as<S>(), n, args);
    });
  }

 private:
  std::vector<double> scratch_;  // per-thread partial sums, sized once
};

}  // namespace

std::unique_ptr<Kernels> make_cpu_kernels() {
  return std::make_unique<CpuKernels>();
}

}  // namespace trainer
