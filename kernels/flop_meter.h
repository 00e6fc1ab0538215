#pragma once
// The best matrix-multiply rate a backend has been seen to reach: the MFU denominator on the
// CPU. Every matmul and attention call is timed with the FLOPs it certainly executed, and the
// highest rate any call reached is kept, together with a floor (a start-up burst measurement
// or a configured peak). The model's FLOP count per step never exceeds the FLOPs its calls
// executed and the step lasts at least as long as its calls together, so the model's FLOP/s
// cannot exceed the best rate of a single call: MFU above 100% is impossible by construction.
#include <atomic>
#include <chrono>
#include <functional>
#include <utility>

namespace trainer {

// The multiply-adds of causal attention's forward (QK^T and AV over the lower triangle, the
// diagonal included): a lower bound on what the blocked kernels execute. Backward is twice this.
inline double causal_attention_flops(int B, int T, int C) {
  return 2.0 * 2.0 * B * C * (double(T) * (T + 1) / 2);
}

class FlopMeter {
 public:
  // Runs operator `op`, f(), which executes at least `flops`, and keeps its rate if it is the
  // best so far; an observer (a profiler) hears of the call.
  using Observer =
      std::function<void(const char* op, double flops, std::chrono::steady_clock::time_point t0,
                         std::chrono::steady_clock::time_point t1)>;
  template <class F>
  void timed(const char* op, double flops, F&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const auto t1 = std::chrono::steady_clock::now();
    record(flops, std::chrono::duration<double>(t1 - t0).count());
    if (observer_) observer_(op, flops, t0, t1);
  }
  void set_observer(Observer o) { observer_ = std::move(o); }
  bool observed() const { return bool(observer_); }
  // An operator that is not a matrix multiply, timed for the observer only (neither its rate nor
  // its time is the MFU's).
  void observe(const char* op, std::chrono::steady_clock::time_point t0,
               std::chrono::steady_clock::time_point t1) {
    if (observer_) observer_(op, 0, t0, t1);
  }
  void record(double flops, double seconds) {
    flops_.fetch_add(flops, std::memory_order_relaxed);
    seconds_.fetch_add(seconds, std::memory_order_relaxed);
    if (seconds > 0) raise(flops / seconds);
  }
  // Keeps `flops_per_s` if it is above the best so far (thread-safe: calls may come from
  // several threads).
  void raise(double flops_per_s) {
    double best = best_.load(std::memory_order_relaxed);
    while (flops_per_s > best &&
           !best_.compare_exchange_weak(best, flops_per_s, std::memory_order_relaxed)) {
    }
  }
  double best() const { return best_.load(std::memory_order_relaxed); }
  // The FLOPs and seconds of every timed call so far: where a step's time goes (matrix
  // multiplies at what rate, and everything else).
  double total_flops() const { return flops_.load(std::memory_order_relaxed); }
  double total_seconds() const { return seconds_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> best_{0}, flops_{0}, seconds_{0};
  Observer observer_;
};

// A backend operator that is not a matrix multiply, from construction to destruction, for a
// profiler: nothing but a test of a flag when none observes. A call that stages 16-bit
// arguments and calls itself in fp32 is one operator (the outermost span on the thread).
class OpSpan {
 public:
  OpSpan(FlopMeter& meter, const char* op) : meter_(meter), op_(op), observed_(meter.observed()) {
    if (!observed_) return;
    outermost_ = depth()++ == 0;
    if (outermost_) t0_ = std::chrono::steady_clock::now();
  }
  ~OpSpan() {
    if (!observed_) return;
    depth()--;
    if (outermost_) meter_.observe(op_, t0_, std::chrono::steady_clock::now());
  }
  OpSpan(const OpSpan&) = delete;
  OpSpan& operator=(const OpSpan&) = delete;

 private:
  static int& depth() {
    thread_local int d = 0;
    return d;
  }
  FlopMeter& meter_;
  const char* op_;
  bool observed_, outermost_ = false;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace trainer
