#include "trainer/trace.h"

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>

#include "io/atomic_file.h"

namespace trainer {

int Trace::thread_id() {
  const std::thread::id me = std::this_thread::get_id();
  const auto it = std::find(threads_.begin(), threads_.end(), me);
  if (it != threads_.end()) return int(it - threads_.begin());
  threads_.push_back(me);
  return int(threads_.size()) - 1;
}

int Trace::track_id(const std::string& track) {
  const auto it = std::find(tracks_.begin(), tracks_.end(), track);
  if (it != tracks_.end()) return kTrackBase + int(it - tracks_.begin());
  tracks_.push_back(track);
  return kTrackBase + int(tracks_.size()) - 1;
}

void Trace::add(std::string name, const char* category, Clock::time_point t0, Clock::time_point t1,
                double flops, const std::string& track, double bytes) {
  using us = std::chrono::duration<double, std::micro>;
  if (t0.time_since_epoch().count() < since_.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(mu_);
  // The steady clock's own epoch (the machine's monotonic clock): ranks on one node line up.
  events_.push_back({std::move(name), category, us(t0.time_since_epoch()).count(),
                     us(t1 - t0).count(), flops, bytes,
                     track.empty() ? thread_id() : track_id(track)});
}

void Trace::write(const std::string& path) const {
  nlohmann::json events = nlohmann::json::array();
  std::lock_guard<std::mutex> lock(mu_);
  events.push_back({{"name", "process_name"},
                    {"ph", "M"},
                    {"pid", rank_},
                    {"tid", 0},
                    {"ts", 0},
                    {"args", {{"name", "rank " + std::to_string(rank_)}}}});
  for (size_t i = 0; i < tracks_.size(); i++)
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", rank_},
                      {"tid", kTrackBase + int(i)},
                      {"ts", 0},
                      {"args", {{"name", tracks_[i]}}}});
  for (const Event& e : events_) {
    nlohmann::json j = {{"name", e.name},  {"cat", e.category}, {"ph", "X"},   {"ts", e.ts_us},
                        {"dur", e.dur_us}, {"pid", rank_},      {"tid", e.tid}};
    if (e.flops > 0)
      j["args"] = {{"flops", e.flops},
                   {"gflop_per_s", e.dur_us > 0 ? e.flops / e.dur_us / 1e3 : 0.0}};
    if (e.bytes >= 0) j["args"] = {{"bytes", e.bytes}};
    events.push_back(std::move(j));
  }
  write_file_atomic(path,
                    nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump());
}

std::vector<Trace::Total> Trace::totals(const std::string& category) const {
  std::map<std::string, Total> by_name;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Event& e : events_) {
      if (category != e.category) continue;
      Total& t = by_name[e.name];
      t.name = e.name;
      t.calls++;
      t.seconds += e.dur_us / 1e6;
      t.flops += e.flops;
      t.bytes += std::max(0.0, e.bytes);
    }
  }
  std::vector<Total> v;
  for (auto& [name, t] : by_name) v.push_back(t);
  std::sort(v.begin(), v.end(),
            [](const Total& a, const Total& b) { return a.seconds > b.seconds; });
  return v;
}

}  // namespace trainer
