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
    f();
    record(p.end);
    pending_.push_back(p);
    deliver(false);
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
