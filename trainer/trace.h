#pragma once
// A profile of one rank: the Chrome / Perfetto trace-event format's complete events ("ph": "X"),
// each with a name, a category, its start (microseconds of the machine's monotonic clock, so
// that the ranks of a node line up) and duration, and the thread that ran it (its own track),
// the process being the rank, written as <out_dir>/trace/rank_<r>.json
// (scripts/merge_traces.py joins the ranks into one file, a process each). Nothing is recorded
// outside the profiled steps; a run without [profile] installs no hooks at all.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace trainer {

class Trace {
 public:
  using Clock = std::chrono::steady_clock;

  explicit Trace(int rank) : rank_(rank) {}

  bool recording() const { return recording_.load(std::memory_order_relaxed); }
  // From off to on: a span that began earlier is not part of the recording (a GPU's operators
  // are heard of after they ran, perhaps before the recording began).
  void set_recording(bool on) {
    if (on && !recording())
      since_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
    recording_.store(on, std::memory_order_relaxed);
  }

  // A span from t0 to t1 (thread-safe); flops > 0 for an operator whose FLOPs are known, bytes
  // (>= 0) for a transfer. On the calling thread's track, or on the named one: a transfer in
  // flight overlaps the thread's own spans without nesting in them, so it has a track of its
  // own, one that no other span overlaps (events on one track must nest).
  void add(std::string name, const char* category, Clock::time_point t0, Clock::time_point t1,
           double flops = 0, const std::string& track = "", double bytes = -1);

  // Records [construction, destruction) as one span when the trace is recording.
  class Span {
   public:
    Span(Trace* trace, const char* name, const char* category)
        : trace_(trace && trace->recording() ? trace : nullptr),
          name_(name),
          category_(category),
          t0_(trace_ ? Clock::now() : Clock::time_point{}) {}
    ~Span() {
      if (trace_) trace_->add(name_, category_, t0_, Clock::now());
    }
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;

   private:
    Trace* trace_;
    const char* name_;
    const char* category_;
    Clock::time_point t0_;
  };

  // A whole (a step, category `whole`, named so) made of consecutive phases (category `part`):
  // each phase ends at the instant the next begins and the whole ends with the last, so the
  // phases cover it exactly. Recording a span takes a lock that another thread (a transfer's)
  // may hold, and a preempted holder makes that wait milliseconds on a shared core: the wait
  // then belongs to a phase instead of falling between two.
  class Phases {
   public:
    Phases(Trace* trace, const char* whole, const char* part, const char* first)
        : trace_(trace && trace->recording() ? trace : nullptr),
          whole_(whole),
          part_(part),
          name_(first),
          begin_(trace_ ? Clock::now() : Clock::time_point{}),
          t0_(begin_) {}
    ~Phases() { end(); }
    void next(const char* name) {
      if (!trace_ || !name_) return;
      const Clock::time_point t = Clock::now();
      trace_->add(name_, part_, t0_, t);
      name_ = name;
      t0_ = t;
    }
    void end() {
      if (!trace_ || !name_) return;
      const Clock::time_point t = Clock::now();
      trace_->add(name_, part_, t0_, t);
      trace_->add(whole_, whole_, begin_, t);
      name_ = nullptr;
    }
    Phases(const Phases&) = delete;
    Phases& operator=(const Phases&) = delete;

   private:
    Trace* trace_;
    const char *whole_, *part_, *name_;
    Clock::time_point begin_, t0_;
  };

  // The events as trace-event JSON.
  void write(const std::string& path) const;

  // Per name, over the events of `category`: calls, seconds and FLOPs, most time first.
  struct Total {
    std::string name;
    int64_t calls = 0;
    double seconds = 0, flops = 0, bytes = 0;
  };
  std::vector<Total> totals(const std::string& category) const;

 private:
  struct Event {
    std::string name;
    const char* category;
    double ts_us, dur_us, flops, bytes;
    int tid;
  };
  // Small numbers, in order of first appearance (under mu_): threads, then named tracks.
  int thread_id();
  int track_id(const std::string& track);

  int rank_;
  std::atomic<bool> recording_{false};
  std::atomic<Clock::rep> since_{0};  // when the recording last began
  mutable std::mutex mu_;
  // A deque: recording an event never moves the ones before it (a vector's growth copied every
  // event so far inside the traced step, 80-100 us at the end of a 1.3 ms one).
  std::deque<Event> events_;
  std::vector<std::thread::id> threads_;
  std::vector<std::string> tracks_;  // tids kTrackBase + i
  static constexpr int kTrackBase = 1000;
};

}  // namespace trainer
