#include "trainer/metrics.h"

#include <fmt/format.h>

#include <algorithm>

#include "io/errors.h"

namespace trainer {

MetricsLog::MetricsLog(const std::string& path, bool append)
    : out_(path, append ? std::ios::app : std::ios::trunc) {
  if (!out_) throw ConfigError(path + ": cannot write metrics (check [run] out_dir)");
}

namespace {
// h:mm:ss
std::string clock_time(double seconds) {
  const int64_t s = std::max<int64_t>(0, int64_t(seconds + 0.5));
  return fmt::format("{}:{:02d}:{:02d}", s / 3600, s / 60 % 60, s % 60);
}
}  // namespace

void MetricsLog::step(const StepStats& s, bool print) {
  nlohmann::json j = {{"step", s.step},
                      {"time", s.time},
                      {"tokens", s.tokens},
                      {"batch", s.batch},
                      {"loss", s.loss},
                      {"lr", s.lr},
                      {"grad_norm", s.grad_norm},
                      {"skipped", s.skipped},
                      {"loss_scale", s.loss_scale},
                      {"ms", s.total_s * 1e3},
                      {"data_ms", s.data_s * 1e3},
                      {"data_queue", s.data_queue},
                      {"data_rows", s.data_rows},
                      {"optimizer_ms", s.optimizer_s * 1e3},
                      {"comm_exposed_ms", s.comm_s * 1e3},
                      {"bytes_sent", s.bytes_sent},
                      {"page_faults", s.page_faults},
                      {"buckets", s.buckets},
                      {"buckets_overlapped", s.buckets_overlapped},
                      {"first_bucket_layers_left", s.first_bucket_layers_left},
                      {"bytes_uncompressed", s.bytes_uncompressed},
                      {"compress_ms", s.compress_s * 1e3},
                      {"pipe_wait_ms", s.pipe_wait_s * 1e3},
                      {"bubble", s.bubble},
                      {"tokens_per_s", s.tokens_per_s},
                      {"mfu", s.mfu},
                      {"peak_flops", s.peak_flops}};
  if (s.phases_timed) {
    j["forward_ms"] = s.forward_s * 1e3;
    j["backward_ms"] = s.backward_s * 1e3;
  }
  if (!s.bytes_by_group.empty()) j["bytes_sent_groups"] = s.bytes_by_group;
  if (s.param_gathers >= 0) {
    j["param_gathers"] = s.param_gathers;
    j["param_ready"] = s.param_ready;
    j["param_waited"] = s.param_waited;
  }
  if (s.offload_segments >= 0) {
    j["offload_segments"] = s.offload_segments;
    j["offload_update_ms"] = s.offload_update_s * 1e3;
    j["offload_wait_ms"] = s.offload_wait_s * 1e3;
  }
  if (s.outer_step) j["outer_step"] = true;
  if (!s.bad.empty()) j["bad"] = s.bad;
  out_ << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  out_.flush();
  if (print)
    fmt::print(
        "step {:6d}/{} | loss {:.4f} | lr {:.2e} | norm {:.3f} | {:7.1f} ms (data {:.1f} {} opt "
        "{:.1f} comm {:.1f} pipe {:.1f}) | {:.2f} MB sent{}{} | {:7.0f} tok/s | MFU {:4.1f}% | {} "
        "elapsed, ETA {}{}\n",
        s.step, s.total_steps, s.loss, s.lr, s.grad_norm, s.total_s * 1e3, s.data_s * 1e3,
        s.phases_timed ? fmt::format("fwd {:.1f} bwd {:.1f}", s.forward_s * 1e3, s.backward_s * 1e3)
                       : std::string("fwd/bwd untimed"),
        s.optimizer_s * 1e3, s.comm_s * 1e3, s.pipe_wait_s * 1e3, double(s.bytes_sent) / 1e6,
        s.bytes_uncompressed > 0
            ? fmt::format(" (compressed buckets {:.2f} MB as fp32, {:.1f} ms)",
                          double(s.bytes_uncompressed) / 1e6, s.compress_s * 1e3)
            : "",
        s.outer_step ? " (outer step)" : "", s.tokens_per_s, 100 * s.mfu, clock_time(s.elapsed_s),
        clock_time(s.eta_s),
        !s.bad.empty() ? fmt::format(" | SKIPPED ({})", s.bad)
        : s.skipped ? fmt::format(" | SKIPPED (non-finite gradients, loss scale {})", s.loss_scale)
                    : "");
}

void MetricsLog::event(const nlohmann::json& record) {
  out_ << record.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  out_.flush();
}

}  // namespace trainer
