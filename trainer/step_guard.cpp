#include "trainer/step_guard.h"

#include <fmt/format.h>

#include <cmath>

namespace trainer {

StepGuard::StepGuard(const FaultsConfig& cfg, bool overflows_are_skipped_by_scaler)
    : cfg_(cfg), scaler_skips_overflows_(overflows_are_skipped_by_scaler) {}

double StepGuard::Window::zscore(double x, size_t size) const {
  if (values.size() < size) return 0;
  double mean = 0, var = 0;
  for (double v : values) mean += v;
  mean /= double(values.size());
  for (double v : values) var += (v - mean) * (v - mean);
  const double sd = std::sqrt(var / double(values.size() - 1));
  // A flat window (sd 0) would make any change infinite: measure against 1e-3 of the mean.
  return (x - mean) / std::max(sd, 1e-3 * std::abs(mean) + 1e-12);
}

void StepGuard::Window::push(double x, size_t size) {
  values.push_back(x);
  if (values.size() > size) values.pop_front();
}

void StepGuard::restore(const std::vector<double>& losses, const std::vector<double>& norms) {
  loss_.values.assign(losses.begin(), losses.end());
  norm_.values.assign(norms.begin(), norms.end());
  bad_in_a_row_ = 0;
}

StepGuard::Verdict StepGuard::check(double loss, double grad_norm, std::string& why) {
  why.clear();
  const size_t window = size_t(cfg_.spike_window);
  if (!std::isfinite(loss)) {
    why = fmt::format("loss is {}", loss);
  } else if (!std::isfinite(grad_norm)) {
    if (scaler_skips_overflows_) return Verdict::good;  // the loss scaler skips and backs off
    why = fmt::format("gradient norm is {}", grad_norm);
  } else if (cfg_.spike_zscore > 0) {
    const double zl = loss_.zscore(loss, window), zn = norm_.zscore(grad_norm, window);
    if (zl > cfg_.spike_zscore)
      why = fmt::format("loss {:.4f} spiked (z-score {:.1f} over the last {} steps)", loss, zl,
                        window);
    else if (zn > cfg_.spike_zscore)
      why = fmt::format("gradient norm {:.4f} spiked (z-score {:.1f} over the last {} steps)",
                        grad_norm, zn, window);
  }
  if (why.empty()) {
    bad_in_a_row_ = 0;
    loss_.push(loss, window);
    norm_.push(grad_norm, window);
    return Verdict::good;
  }
  bad_in_a_row_++;
  return cfg_.max_bad_steps > 0 && bad_in_a_row_ >= cfg_.max_bad_steps ? Verdict::rollback
                                                                       : Verdict::bad;
}

}  // namespace trainer
