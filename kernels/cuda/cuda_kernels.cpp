// The CUDA backend: device memory from one arena, every kernel on one compute stream (so the
// host never waits except where a value comes back), token ids copied on their own stream from
// pinned memory, GEMMs through cuBLASLt, attention by query blocks (kernels/blocked_attention.h).
#include "kernels/cuda/cuda_kernels.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/arena.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/op_timer.h"
#include "kernels/cuda/ops.h"
#include "kernels/flop_meter.h"
#include "kernels/token_index.h"

namespace trainer {
namespace cuda {

void fail(const std::string& message, const char* call, const char* file, int line) {
  throw std::runtime_error(fmt::format("{} failed: {} ({}:{})", call, message, file, line));
}

namespace {

constexpr int64_t kGemmWorkspace = 32 << 20;  // cuBLASLt's workspace (Hopper wants 32 MiB)
// Left free outside the arena: NCCL's buffers (created after the arena, per communicator), the
// CUDA context's growth and cuBLASLt's own allocations.
constexpr int64_t kOutsideArena = int64_t(3) << 30;

// Token ids arrive in host memory; each call copies them to the device through a pinned slot on
// the copy stream, and the compute stream waits for that copy only. A slot is reused only after
// the kernels that read its previous contents have run (the `consumed` event).
class TokenRing {
 public:
  struct Slot {
    int32_t* pinned = nullptr;
    int32_t* device = nullptr;
    int64_t capacity = 0, arena_offset = -1;
    cudaEvent_t copied = nullptr, consumed = nullptr;
  };

  TokenRing() {
    for (Slot& s : slots_) {
      CUDA_CHECK(cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming));
      CUDA_CHECK(cudaEventCreateWithFlags(&s.consumed, cudaEventDisableTiming));
    }
  }
  ~TokenRing() {
    for (Slot& s : slots_) {
      if (s.pinned) cudaFreeHost(s.pinned);
      cudaEventDestroy(s.copied);
      cudaEventDestroy(s.consumed);
    }
  }
  Slot& next() { return slots_[next_++ % slots_.size()]; }

 private:
  std::array<Slot, 8> slots_;
  size_t next_ = 0;
};

class CudaKernels final : public Kernels {
 public:
  explicit CudaKernels(const CudaOptions& o) : device_(o.device) {
    CUDA_CHECK(cudaSetDevice(device_));
    CUDA_CHECK(cudaGetDeviceProperties(&props_, device_));
    CUDA_CHECK(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking));
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    // A share of the whole GPU (so that ranks sharing it get equal parts whatever order they
    // start in), within what is free now less what must stay outside.
    const int64_t outside = std::max(int64_t(double(free_bytes) * 0.05),
                                     std::min(kOutsideArena, int64_t(total_bytes) / 8));
    const int64_t reserve =
        std::min(int64_t(double(total_bytes) * o.memory_fraction), int64_t(free_bytes) - outside);
    if (reserve < 4 * kGemmWorkspace)
      throw std::runtime_error(fmt::format(
          "GPU {}: {:.0f} MiB free of {:.0f} MiB, too little to reserve the trainer's memory "
          "(another process is using the GPU?)",
          device_, free_bytes / 1048576.0, total_bytes / 1048576.0));
    CUDA_CHECK(cudaMalloc(&base_, size_t(reserve)));
    arena_.emplace(reserve);
    workspace_ = raw_alloc(kGemmWorkspace);
    gemm_.emplace(compute_, workspace_, size_t(kGemmWorkspace));
    sum_partials_ = static_cast<double*>(raw_alloc(kSumBlocks * sizeof(double)));
    sum_result_ = static_cast<double*>(raw_alloc(sizeof(double)));
    CUDA_CHECK(cudaMallocHost(&host_result_, sizeof(double)));
    ring_.emplace();  // its events belong to this device
    timer_.emplace(compute_);
  }
  ~CudaKernels() override {
    cudaStreamSynchronize(compute_);
    cudaStreamSynchronize(copy_);
    timer_.reset();
    gemm_.reset();
    ring_.reset();
    if (host_result_) cudaFreeHost(host_result_);
    cudaFree(base_);
    cudaStreamDestroy(copy_);
    cudaStreamDestroy(compute_);
  }

  std::string name() const override {
    return fmt::format("cuda:{} ({}, sm_{}{})", device_, props_.name, props_.major, props_.minor);
  }
  cudaStream_t stream() const { return compute_; }
  int device() const { return device_; }

  // --- memory ---------------------------------------------------------------------------------
  DPtr alloc(int64_t elems, DType dtype) override {
    const int64_t bytes = elems * int64_t(dtype_size(dtype));
    DPtr p{static_cast<std::byte*>(raw_alloc(bytes)), dtype, true};
    CUDA_CHECK(cudaMemsetAsync(p.p, 0, size_t(std::max<int64_t>(bytes, 0)), compute_));
    return p;
  }
  void free(DPtr p) override {
    if (p) arena_->release(p.p - base_);
  }
  void zero(DPtr p, int64_t elems) override {
    CUDA_CHECK(cudaMemsetAsync(p.p, 0, size_t(elems) * dtype_size(p.dtype), compute_));
  }
  void copy_to_host(void* dst, DPtr src, int64_t elems) override {
    CUDA_CHECK(cudaMemcpyAsync(dst, src.p, size_t(elems) * dtype_size(src.dtype),
                               cudaMemcpyDeviceToHost, compute_));
    CUDA_CHECK(cudaStreamSynchronize(compute_));
  }
  void copy_from_host(DPtr dst, const void* src, int64_t elems) override {
    CUDA_CHECK(cudaMemcpyAsync(dst.p, src, size_t(elems) * dtype_size(dst.dtype),
                               cudaMemcpyHostToDevice, compute_));
    CUDA_CHECK(cudaStreamSynchronize(compute_));  // the caller may free `src` on return
  }
  void* alloc_host(int64_t bytes) override {
    void* p = nullptr;
    CUDA_CHECK(cudaMallocHost(&p, size_t(std::max<int64_t>(bytes, 1))));
    return p;
  }
  void free_host(void* p) noexcept override { cudaFreeHost(p); }
  void synchronize() override {
    CUDA_CHECK(cudaStreamSynchronize(compute_));
    timer_->synchronized();
  }
  void set_op_observer(OpObserver observer) override { timer_->set_observer(std::move(observer)); }
  MemoryUse memory() const override { return {arena_->capacity(), arena_->peak()}; }
  double peak_flops(DType dtype) const override;
  void set_peak_flops(double flops_per_s) override { configured_peak_ = flops_per_s; }

  // --- kernels --------------------------------------------------------------------------------
  void encoder_forward(DPtr out, const int32_t* tokens, DPtr wte, DPtr wpe, int B, int T, int C,
                       VocabSlice v) override {
    Upload t(*this, tokens, int64_t(B) * T);
    timer_->timed("encoder_forward", 0,
                  [&] { cuda::encoder_forward(compute_, out, t.device, wte, wpe, B, T, C, v); });
  }
  void encoder_backward(DPtr dwte, DPtr dwpe, DPtr dout, const int32_t* tokens, int B, int T, int C,
                        VocabSlice v) override {
    token_index_.build(tokens, int64_t(B) * T, v);
    const std::vector<int32_t>& index = token_index_.data();
    Upload t(*this, index.data(), int64_t(index.size()));
    timer_->timed("encoder_backward", 0, [&] {
      cuda::encoder_backward(compute_, dwte, dwpe, dout, t.device, token_index_.distinct(), B, T, C,
                             v);
    });
  }
  void layernorm_forward(DPtr out, DPtr mean, DPtr rstd, DPtr inp, DPtr weight, DPtr bias,
                         int64_t N, int C) override {
    timer_->timed("layernorm_forward", 0, [&] {
      cuda::layernorm_forward(compute_, out, mean, rstd, inp, weight, bias, N, C);
    });
  }
  void residual_layernorm_forward(DPtr res, DPtr out, DPtr mean, DPtr rstd, DPtr a, DPtr b,
                                  DPtr weight, DPtr bias, int64_t N, int C) override {
    timer_->timed("residual_layernorm_forward", 0, [&] {
      cuda::residual_layernorm_forward(compute_, res, out, mean, rstd, a, b, weight, bias, N, C);
    });
  }
  void layernorm_backward(DPtr dinp, DPtr dweight, DPtr dbias, DPtr dout, DPtr inp, DPtr weight,
                          DPtr mean, DPtr rstd, int64_t N, int C) override {
    timer_->timed("layernorm_backward", 0, [&] {
      cuda::layernorm_backward(compute_, dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C,
                               scratch(2 * int64_t(kColumnChunks) * C));
    });
  }
  void rmsnorm_forward(DPtr out, DPtr rstd, DPtr inp, DPtr weight, int64_t N, int C,
                       float eps) override {
    timer_->timed("rmsnorm_forward", 0,
                  [&] { cuda::rmsnorm_forward(compute_, out, rstd, inp, weight, N, C, eps); });
  }
  void rmsnorm_backward(DPtr dinp, DPtr dweight, DPtr dout, DPtr inp, DPtr weight, DPtr rstd,
                        int64_t N, int C) override {
    timer_->timed("rmsnorm_backward", 0, [&] {
      cuda::rmsnorm_backward(compute_, dinp, dweight, dout, inp, weight, rstd, N, C,
                             scratch(2 * int64_t(kColumnChunks) * C));
    });
  }
  void matmul_forward(DPtr out, DPtr inp, DPtr weight, DPtr bias, int64_t N, int IC,
                      int OC) override {
    if (N == 0) return;
    timer_->timed("matmul_forward", 2.0 * double(N) * IC * OC, [&] {
      gemm_->run(gemm_plan::linear_forward(out, inp, weight, bias, rows(N), IC, OC));
    });
  }
  void matmul_backward(DPtr dinp, DPtr dweight, DPtr dbias, DPtr dout, DPtr inp, DPtr weight,
                       int64_t N, int IC, int OC) override {
    if (N == 0) return;
    timer_->timed("matmul_backward", (dinp ? 4.0 : 2.0) * double(N) * IC * OC, [&] {
      if (dinp) gemm_->run(gemm_plan::linear_backward_input(dinp, dout, weight, rows(N), IC, OC));
      gemm_->run(gemm_plan::linear_backward_weight(dweight, dout, inp, rows(N), IC, OC));
      if (dbias)
        cuda::bias_backward(compute_, dbias, dout, N, OC, scratch(int64_t(kColumnChunks) * OC));
    });
  }
  // The GELU in the GEMM's epilogue when cuBLASLt has one for the shape, else the two kernels.
  // 16-bit only: cuBLASLt's GELU may use a faster tanh than ours, and fp32 runs are the ones
  // compared with the CPU at 1e-4 (in 16 bits that difference is below one rounding).
  void matmul_gelu_forward(DPtr pre, DPtr out, DPtr inp, DPtr weight, DPtr bias, int64_t N, int IC,
                           int OC) override {
    if (N == 0) return;
    // (The fallback's GEMM and GELU are timed as themselves.)
    bool fused = false;
    if (is_half(out.dtype))
      fused = timer_->timed_if("matmul_gelu_forward", 2.0 * double(N) * IC * OC, [&] {
        return gemm_->try_run(
            gemm_plan::linear_gelu_forward(pre, out, inp, weight, bias, rows(N), IC, OC));
      });
    if (!fused) Kernels::matmul_gelu_forward(pre, out, inp, weight, bias, N, IC, OC);
  }
  void matmul_backward_gelu(DPtr dinp, DPtr dweight, DPtr dbias, DPtr dout, DPtr inp, DPtr weight,
                            DPtr pre, int64_t N, int IC, int OC) override {
    if (N == 0) return;
    bool fused = false;
    if (dinp && is_half(dinp.dtype))
      fused = timer_->timed_if("matmul_backward_input_gelu", 2.0 * double(N) * IC * OC, [&] {
        return gemm_->try_run(
            gemm_plan::linear_backward_input_gelu(dinp, dout, weight, pre, rows(N), IC, OC));
      });
    if (!fused)
      return Kernels::matmul_backward_gelu(dinp, dweight, dbias, dout, inp, weight, pre, N, IC, OC);
    matmul_backward(DPtr{}, dweight, dbias, dout, inp, weight, N, IC, OC);
  }
  // Attention by query blocks (kernels/blocked_attention.h): lse holds each row's log-sum-exp.
  using Kernels::attention_backward;  // the multi-head overloads
  using Kernels::attention_forward;
  void attention_forward(DPtr out, DPtr lse, DPtr qkv, int B, int T, int C, int NH,
                         int NKV) override;
  void attention_backward(DPtr dqkv, DPtr dout, DPtr qkv, DPtr out, DPtr lse, int B, int T, int C,
                          int NH, int NKV) override;
  void attention_inference(DPtr out, DPtr qkv, int T, int q0, int C, int NH, int NKV) override {
    cuda::attention_inference(compute_, out, qkv, T, q0, C, NH, NKV);
  }
  void rope_forward(DPtr qkv, DPtr cos_sin, int B, int T, int NH, int NKV, int hs,
                    int pos0) override {
    timer_->timed("rope_forward", 0,
                  [&] { cuda::rope(compute_, qkv, cos_sin, B, T, NH, NKV, hs, pos0, false); });
  }
  void rope_backward(DPtr dqkv, DPtr cos_sin, int B, int T, int NH, int NKV, int hs,
                     int pos0) override {
    timer_->timed("rope_backward", 0,
                  [&] { cuda::rope(compute_, dqkv, cos_sin, B, T, NH, NKV, hs, pos0, true); });
  }
  void swiglu_forward(DPtr out, DPtr gate_up, int64_t N, int F) override {
    timer_->timed("swiglu_forward", 0, [&] { cuda::swiglu_forward(compute_, out, gate_up, N, F); });
  }
  void swiglu_backward(DPtr d_gate_up, DPtr dout, DPtr gate_up, int64_t N, int F) override {
    timer_->timed("swiglu_backward", 0,
                  [&] { cuda::swiglu_backward(compute_, d_gate_up, dout, gate_up, N, F); });
  }
  void dropout(DPtr x, int64_t n, float p, uint64_t seed, int64_t offset) override {
    cuda::dropout(compute_, x, n, p, seed, offset);
  }
  void gelu_forward(DPtr out, DPtr inp, int64_t n) override {
    timer_->timed("gelu_forward", 0, [&] { cuda::gelu_forward(compute_, out, inp, n); });
  }
  void gelu_backward(DPtr dinp, DPtr inp, DPtr dout, int64_t n) override {
    timer_->timed("gelu_backward", 0, [&] { cuda::gelu_backward(compute_, dinp, inp, dout, n); });
  }
  void residual_forward(DPtr out, DPtr a, DPtr b, int64_t n) override {
    timer_->timed("residual_forward", 0, [&] { cuda::residual_forward(compute_, out, a, b, n); });
  }
  void crossentropy_stats(DPtr rowmax, DPtr sumexp, DPtr target_logit, DPtr logits,
                          const int32_t* targets, int64_t N, VocabSlice v) override {
    Upload t(*this, targets, N);
    timer_->timed("crossentropy_stats", 0, [&] {
      cuda::crossentropy_stats(compute_, rowmax, sumexp, target_logit, logits, t.device, N, v);
    });
  }
  void crossentropy_rebase(DPtr rowmax, DPtr sumexp, DPtr group_max, int64_t N) override {
    timer_->timed("crossentropy_rebase", 0,
                  [&] { cuda::crossentropy_rebase(compute_, rowmax, sumexp, group_max, N); });
  }
  double crossentropy_loss(DPtr losses, DPtr rowmax, DPtr sumexp, DPtr target_logit,
                           int64_t N) override {
    if (N == 0) return 0;
    cuda::crossentropy_loss(compute_, losses, rowmax, sumexp, target_logit, N, sum_partials_,
                            sum_result_);
    return fetch_result();
  }
  void crossentropy_backward(DPtr logits, DPtr rowmax, DPtr sumexp, const int32_t* targets,
                             float dloss, int64_t N, VocabSlice v) override {
    Upload t(*this, targets, N);
    timer_->timed("crossentropy_backward", 0, [&] {
      cuda::crossentropy_backward(compute_, logits, rowmax, sumexp, t.device, dloss, N, v);
    });
  }
  void convert(DPtr dst, DPtr src, int64_t n, uint64_t stochastic_seed) override {
    cuda::convert(compute_, dst, src, n, stochastic_seed);
  }
  bool asynchronous() const override { return true; }
  double sum_squares(DPtr x, const std::vector<Range>& ranges) override {
    if (ranges.empty()) return 0;
    if (ranges != ranges_) {  // the same ranges every step: uploaded once
      const int64_t bytes = int64_t(ranges.size() * sizeof(Range));
      if (bytes > ranges_capacity_) {
        if (ranges_device_) arena_->release(reinterpret_cast<std::byte*>(ranges_device_) - base_);
        ranges_device_ = static_cast<Range*>(raw_alloc(bytes));
        ranges_capacity_ = bytes;
      }
      ranges_ = ranges;
      CUDA_CHECK(cudaMemcpyAsync(ranges_device_, ranges_.data(), size_t(bytes),
                                 cudaMemcpyHostToDevice, compute_));
      CUDA_CHECK(cudaStreamSynchronize(compute_));  // ranges_ may change before the copy ran
    }
    cuda::sum_squares_ranges(compute_, x, ranges_device_, int(ranges.size()), sum_partials_,
                             sum_result_);
    return fetch_result();
  }
  double sum_squares(DPtr x, int64_t n) override {
    if (n <= 0) return 0;
    cuda::sum_values(compute_, x, n, sum_partials_, sum_result_, 1.0, true);
    return fetch_result();
  }
  void adamw_update(DPtr param, DPtr grad, DPtr m, DPtr v, int64_t n,
                    const AdamWArgs& args) override {
    timer_->timed("adamw_update", 0,
                  [&] { cuda::adamw_update(compute_, param, grad, m, v, n, args); });
  }

 private:
  // Token ids on the device for the kernels enqueued while this lives (see TokenRing).
  struct Upload {
    Upload(CudaKernels& k, const int32_t* host, int64_t n) : k_(k), slot_(k.ring_->next()) {
      TokenRing::Slot& s = slot_;
      if (s.capacity < n) k.grow(s, n);
      device = s.device;
      if (n == 0) return;  // nothing to copy (and memcpy must not see null pointers)
      CUDA_CHECK(cudaEventSynchronize(s.copied));  // the slot's previous copy has left `pinned`
      std::memcpy(s.pinned, host, size_t(n) * sizeof(int32_t));
      CUDA_CHECK(cudaStreamWaitEvent(k.copy_, s.consumed, 0));
      CUDA_CHECK(cudaMemcpyAsync(s.device, s.pinned, size_t(n) * sizeof(int32_t),
                                 cudaMemcpyHostToDevice, k.copy_));
      CUDA_CHECK(cudaEventRecord(s.copied, k.copy_));
      CUDA_CHECK(cudaStreamWaitEvent(k.compute_, s.copied, 0));
    }
    ~Upload() { cudaEventRecord(slot_.consumed, k_.compute_); }
    Upload(const Upload&) = delete;
    Upload& operator=(const Upload&) = delete;
    const int32_t* device = nullptr;

   private:
    CudaKernels& k_;
    TokenRing::Slot& slot_;
  };

  // A slot too small for n ids: doubled at least, so that growth stops early (the embedding
  // backward's index varies in length from batch to batch).
  void grow(TokenRing::Slot& s, int64_t n) {
    const int64_t capacity = std::max(n, 2 * s.capacity);
    const size_t bytes = size_t(capacity) * sizeof(int32_t);
    // Everything enqueued has run: the slot's old buffers are no longer read, and the arena
    // memory the copy stream is about to write has no pending compute-stream user either.
    CUDA_CHECK(cudaStreamSynchronize(compute_));
    CUDA_CHECK(cudaStreamSynchronize(copy_));
    auto* device = static_cast<int32_t*>(raw_alloc(int64_t(bytes)));
    const int64_t offset = reinterpret_cast<std::byte*>(device) - base_;
    int32_t* pinned = nullptr;
    if (const cudaError_t e = cudaMallocHost(&pinned, bytes); e != cudaSuccess) {
      arena_->release(offset);
      CUDA_CHECK(e);
    }
    if (s.pinned) cudaFreeHost(s.pinned);
    if (s.arena_offset >= 0) arena_->release(s.arena_offset);
    s.pinned = pinned;
    s.device = device;
    s.arena_offset = offset;
    s.capacity = capacity;
  }

  static int rows(int64_t N) {
    if (N > INT32_MAX) throw std::length_error("CUDA GEMM with more than 2^31 rows");
    return int(N);
  }

  void* raw_alloc(int64_t bytes) {
    const auto offset = arena_->allocate(bytes);
    if (!offset)
      throw std::runtime_error(fmt::format(
          "GPU memory: {:.1f} MiB asked for, {:.1f} of the {:.1f} MiB reserved at start-up in "
          "use (largest free piece {:.1f} MiB); raise [run] gpu_memory_fraction or lower "
          "train.micro_batch",
          bytes / 1048576.0, arena_->in_use() / 1048576.0, arena_->capacity() / 1048576.0,
          arena_->largest_free() / 1048576.0));
    return base_ + *offset;
  }

  // Scratch memory for column reductions and attention, grown (in the first steps) and reused:
  // all users are on the compute stream, so a later kernel never overtakes an earlier one that
  // still reads it, and none keeps data in it from one call to the next.
  std::byte* scratch_bytes(int64_t bytes) {
    if (scratch_bytes_ < bytes) {
      if (scratch_) arena_->release(scratch_ - base_);
      scratch_ = nullptr;
      scratch_bytes_ = 0;
      scratch_ = static_cast<std::byte*>(raw_alloc(bytes));
      scratch_bytes_ = bytes;
    }
    return scratch_;
  }
  float* scratch(int64_t n) {
    return reinterpret_cast<float*>(scratch_bytes(n * int64_t(sizeof(float))));
  }
  AttentionScratch attention_scratch(const AttentionShape& s, DType act);

  double fetch_result() {
    CUDA_CHECK(cudaMemcpyAsync(host_result_, sum_result_, sizeof(double), cudaMemcpyDeviceToHost,
                               compute_));
    CUDA_CHECK(cudaStreamSynchronize(compute_));
    return *host_result_;
  }

  int device_;
  cudaDeviceProp props_{};
  double configured_peak_ = 0;  // [run] peak_tflops, replacing the data sheet
  cudaStream_t compute_ = nullptr, copy_ = nullptr;
  std::byte* base_ = nullptr;
  std::optional<Arena> arena_;
  void* workspace_ = nullptr;
  std::optional<Gemm> gemm_;
  std::optional<TokenRing> ring_;
  std::optional<OpTimer> timer_;  // for a profiler: operators timed with events
  std::byte* scratch_ = nullptr;
  int64_t scratch_bytes_ = 0;
  double *sum_partials_ = nullptr, *sum_result_ = nullptr, *host_result_ = nullptr;
  std::vector<Range> ranges_;  // the ranges sum_squares last uploaded to ranges_device_
  Range* ranges_device_ = nullptr;
  int64_t ranges_capacity_ = 0;
  TokenIndex token_index_;  // the embedding backward's rows and positions
};

// The blocked attention's device steps: cuBLASLt and the kernels of attention.cu.
class CudaAttentionSteps final : public AttentionSteps {
 public:
  CudaAttentionSteps(cudaStream_t stream, Gemm& gemm) : s_(stream), gemm_(gemm) {}
  void gemm(const GemmCall& c) override { gemm_.run(c); }
  void to_heads(DPtr dst, HeadSide side, DPtr src, int64_t width, int64_t column0,
                const AttentionShape& sh) override {
    cuda::attention_to_heads(s_, dst, side, src, width, column0, sh);
  }
  void from_heads(DPtr dst, int64_t width, int64_t column0, DPtr src, HeadSide side,
                  const AttentionShape& sh) override {
    cuda::attention_from_heads(s_, dst, width, column0, src, side, sh);
  }
  void softmax_rows(DPtr p, DPtr lse, DPtr s, QueryBlock blk, const AttentionShape& sh) override {
    cuda::attention_softmax_rows(s_, p, lse, s, blk, sh);
  }
  void probs_rows(DPtr p, DPtr s, DPtr lse, QueryBlock blk, const AttentionShape& sh) override {
    cuda::attention_probs_rows(s_, p, s, lse, blk, sh);
  }
  void dsoftmax_rows(DPtr p, DPtr dp, DPtr D, QueryBlock blk, const AttentionShape& sh) override {
    cuda::attention_dsoftmax_rows(s_, p, dp, D, blk, sh);
  }
  void row_dots(DPtr D, DPtr dout, DPtr out, const AttentionShape& sh) override {
    cuda::attention_row_dots(s_, D, dout, out, sh);
  }
  void zero(DPtr p, int64_t n) override {
    CUDA_CHECK(cudaMemsetAsync(p.p, 0, size_t(n) * dtype_size(p.dtype), s_));
  }

 private:
  cudaStream_t s_;
  Gemm& gemm_;
};

// One scratch piece per AttentionScratch field, 256-byte aligned: head-major copies and
// probabilities in the activation dtype, scores, accumulators and row statistics in fp32.
AttentionScratch CudaKernels::attention_scratch(const AttentionShape& s, DType act) {
  const AttentionScratchSizes n = attention_scratch_sizes(s);
  const std::array<std::pair<int64_t, DType>, 10> parts{{{n.head_major, act},
                                                         {n.kv_head_major, act},
                                                         {n.kv_head_major, act},
                                                         {n.head_major, act},
                                                         {n.head_major, act},
                                                         {n.kv_head_major, DType::f32},
                                                         {n.kv_head_major, DType::f32},
                                                         {n.block, DType::f32},
                                                         {n.block, act},
                                                         {n.rows, DType::f32}}};
  std::array<int64_t, 10> at{};
  int64_t bytes = 0;
  for (size_t i = 0; i < parts.size(); i++) {
    at[i] = bytes;
    bytes += (parts[i].first * int64_t(dtype_size(parts[i].second)) + 255) / 256 * 256;
  }
  std::byte* base = scratch_bytes(bytes);
  auto field = [&](size_t i) { return DPtr{base + at[i], parts[i].second, true}; };
  return {field(0), field(1), field(2), field(3), field(4),
          field(5), field(6), field(7), field(8), field(9)};
}

void CudaKernels::attention_forward(DPtr out, DPtr lse, DPtr qkv, int B, int T, int C, int NH,
                                    int NKV) {
  if (int64_t(B) * T == 0) return;
  const AttentionShape shape{B, T, C, NH, NKV};
  CudaAttentionSteps steps(compute_, *gemm_);
  timer_->timed("attention_forward", causal_attention_flops(B, T, C), [&] {
    blocked_attention_forward(steps, attention_scratch(shape, out.dtype), out, lse, qkv, shape);
  });
}

void CudaKernels::attention_backward(DPtr dqkv, DPtr dout, DPtr qkv, DPtr out, DPtr lse, int B,
                                     int T, int C, int NH, int NKV) {
  if (int64_t(B) * T == 0) return;
  const AttentionShape shape{B, T, C, NH, NKV};
  CudaAttentionSteps steps(compute_, *gemm_);
  timer_->timed("attention_backward", 2 * causal_attention_flops(B, T, C), [&] {
    blocked_attention_backward(steps, attention_scratch(shape, dout.dtype), dqkv, dout, qkv, out,
                               lse, shape);
  });
}

// Dense peak of the tensor cores (16-bit) or of the fp32 units (fp32 GEMMs do not use TF32),
// per NVIDIA's data sheets for H100/H200 (SXM, NVL, PCIe) and A100; 0 (unknown) for other GPUs,
// where [run] peak_tflops gives the MFU denominator.
double CudaKernels::peak_flops(DType dtype) const {
  if (configured_peak_ > 0) return configured_peak_;
  const bool half = is_half(dtype);
  const std::string name = props_.name;
  const auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if (props_.major == 9) {
    if (has("NVL")) return half ? 835e12 : 60e12;
    if (has("PCIe")) return half ? 756e12 : 51e12;
    return half ? 989e12 : 67e12;
  }
  if (props_.major == 8 && props_.minor == 0) return half ? 312e12 : 19.5e12;
  return 0;
}

}  // namespace
}  // namespace cuda

cudaStream_t cuda::compute_stream(Kernels& k) {
  auto* c = dynamic_cast<CudaKernels*>(&k);
  if (!c) throw std::logic_error("compute_stream: not the CUDA backend");
  return c->stream();
}
int cuda::device_of(Kernels& k) {
  auto* c = dynamic_cast<CudaKernels*>(&k);
  if (!c) throw std::logic_error("device_of: not the CUDA backend");
  return c->device();
}

bool cuda_built() {
  return true;
}

std::array<std::byte, 16> cuda_device_uuid(int device) {
  cudaDeviceProp props{};
  CUDA_CHECK(cudaGetDeviceProperties(&props, device));
  std::array<std::byte, 16> uuid{};
  static_assert(sizeof(props.uuid) == uuid.size());
  std::memcpy(uuid.data(), &props.uuid, uuid.size());
  return uuid;
}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" / "no driver" error
    return 0;
  }
  return n;
}

std::unique_ptr<Kernels> make_cuda_kernels(const CudaOptions& options) {
  const int n = cuda_device_count();
  if (n == 0)
    throw std::runtime_error("no CUDA device visible to this process ([run] device = \"cuda\")");
  if (options.device < 0 || options.device >= n)
    throw std::runtime_error(
        fmt::format("CUDA device {} asked for, {} visible", options.device, n));
  return std::make_unique<cuda::CudaKernels>(options);
}

}  // namespace trainer
