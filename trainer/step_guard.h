#pragma once
// Decides whether a step's update may be applied. A step is bad when its loss (or, outside
// dynamic fp16 loss scaling, where overflows are the scaler's business, its gradient norm) is
// not finite, or when either spikes: more than `spike_zscore` standard deviations above the
// mean of the last `spike_window` good steps (once the window is full). A bad step is skipped;
// `max_bad_steps` bad steps in a row call for a rollback to the last checkpoint. Every rank sees
// the same loss and norm (all-reduced), so every rank decides the same.
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "io/config.h"

namespace trainer {

class StepGuard {
 public:
  StepGuard(const FaultsConfig& cfg, bool overflows_are_skipped_by_scaler);

  enum class Verdict { good, bad, rollback };
  // `why` says what was wrong with a bad step.
  Verdict check(double loss, double grad_norm, std::string& why);
  // The windows of recent good losses and gradient norms (oldest first), for checkpoints; a
  // restored run or a rollback sets them back, and the run of bad steps ends.
  std::vector<double> recent_losses() const { return {loss_.values.begin(), loss_.values.end()}; }
  std::vector<double> recent_norms() const { return {norm_.values.begin(), norm_.values.end()}; }
  void restore(const std::vector<double>& losses, const std::vector<double>& norms);
  // The norms' window starts afresh (when the norm starts meaning something else).
  void forget_norms() { norm_.values.clear(); }
  int bad_in_a_row() const { return bad_in_a_row_; }

 private:
  struct Window {
    std::deque<double> values;
    // The z-score of x against the window; 0 until the window is full.
    double zscore(double x, size_t size) const;
    void push(double x, size_t size);
  };
  FaultsConfig cfg_;
  bool scaler_skips_overflows_;
  Window loss_, norm_;
  int bad_in_a_row_ = 0;
};

}  // namespace trainer
