#pragma once
// One line per step on stdout and the same fields as one JSON object per line in
// <out_dir>/metrics.jsonl.
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace trainer {

struct StepStats {
  int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0;
  bool skipped = false;  // non-finite loss or gradient norm: no update applied
  // Seconds per phase: waiting for data, forward, backward, norm + optimizer, and the total.
  double data_s = 0, forward_s = 0, backward_s = 0, optimizer_s = 0, total_s = 0;
  double tokens_per_s = 0, mfu = 0;
};

class MetricsLog {
 public:
  explicit MetricsLog(const std::string& path);
  void step(const StepStats& s, bool print);
  void event(const nlohmann::json& record);  // validation, samples, checkpoints

 private:
  std::ofstream out_;
};

}  // namespace trainer
