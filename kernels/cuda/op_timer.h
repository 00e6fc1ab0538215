#pragma once
// Operators on a CUDA stream, timed for a profiler (Kernels::set_op_observer) with events: one
// recorded before and one after each operator, read back without waiting as later operators are
// issued, and all of them when the host synchronizes with the stream. The GPU's times become
// host clock times through an anchor: an event the host waited for on an idle stream, at the
// moment the wait returned. Without an observer nothing is recorded.
#include <cuda_runtime.h>

#include <chrono>
#include <deque>
#include <utility>
#include <vector>

#include "kernels/kernels.h"

namespace trainer::cuda {

class OpTimer {
 public:
  explicit OpTimer(cudaStream_t stream) : stream_(stream) {}
  ~OpTimer();
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

  // Starts timing (waits for the stream, to anchor the clocks), or with an empty observer stops
  // it (what is pending is dropped).
  void set_observer(Kernels::OpObserver observer);
  bool on() const { return bool(observer_); }

  // Issues operator `op`, f(), which executes `flops` (0: not counted) on the stream.
  template <class F>
  void timed(const char* op, double flops, F&& f) {
    if (!observer_) return f();
    Pending p{op, flops, take(), take()};
    record(p.start);
    try {
      f();
    } catch (...) {
      free_.insert(free_.end(), {p.start, p.end});
      throw;
    }
    record(p.end);
    pending_.push_back(p);
    deliver(false);
  }
  // As timed(), for an operator that may decline: f() returns false when it issued nothing (a
  // fused GEMM cuBLASLt has no algorithm for), and then nothing is heard of it.
  template <class F>
  bool timed_if(const char* op, double flops, F&& f) {
    if (!observer_) return f();
    bool ran = false;
    const cudaEvent_t start = take();
    record(start);
    try {
      ran = f();
    } catch (...) {
      free_.push_back(start);
      throw;
    }
    if (!ran) {
      free_.push_back(start);  // (recorded again when it is next taken)
      return false;
    }
    const cudaEvent_t end = take();
    record(end);
    pending_.push_back({op, flops, start, end});
    deliver(false);
    return true;
  }
  // After the host has waited for the stream: every pending operator to the observer, and the
  // clocks anchored again (a float's milliseconds since an old anchor lose precision).
  void synchronized();

 private:
  struct Pending {
    const char* op;
    double flops;
    cudaEvent_t start, end;
  };
  cudaEvent_t take();
  void record(cudaEvent_t e);
  // The finished operators in order (all of them with `all`: the stream is idle).
  void deliver(bool all);
  void anchor();

  cudaStream_t stream_;
  Kernels::OpObserver observer_;
  cudaEvent_t anchor_ = nullptr;
  std::chrono::steady_clock::time_point anchor_time_;
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> free_;
};

}  // namespace trainer::cuda
