#include "trainer/train.h"

#include <fmt/format.h>
#include <omp.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "io/atomic_file.h"
#include "io/dataset.h"
#include "io/tokenizer.h"
#include "model/gpt.h"
#include "trainer/adamw.h"
#include "trainer/blas_setup.h"
#include "trainer/checkpoint.h"
#include "trainer/lr_schedule.h"
#include "trainer/metrics.h"
#include "trainer/peak_flops.h"
#include "trainer/sampler.h"

namespace trainer {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Everything a step touches, built once.
struct Run {
  const Config& cfg;
  std::unique_ptr<Kernels> kernels;
  Dataset train_data, val_data;
  GPT model;
  AdamW optimizer;
  DataLoader loader;
  double flops_per_token;  // 6N + 12 L C T, as PaLM/nanoGPT count them
  double peak_flops;

  Run(const Config& c, std::unique_ptr<Kernels> k)
      : cfg(c),
        kernels(std::move(k)),
        train_data(c.data.train, c.model.vocab_size, c.model.seq_len),
        val_data(c.data.val, c.model.vocab_size, c.model.seq_len),
        model(c.model, *kernels, DType::f32, c.train.micro_batch, c.model.seq_len),
        optimizer(model, c.optim),
        loader(train_data, c.train.micro_batch, c.model.seq_len, c.train.grad_accum, c.run.seed,
               c.data.prefetch, 0),
        flops_per_token(6.0 * double(gpt2_flop_params(c.model)) +
                        12.0 * c.model.n_layer * c.model.d_model * c.model.seq_len),
        peak_flops(c.run.peak_tflops > 0 ? c.run.peak_tflops * 1e12 : measure_sgemm_flops()) {}
};

// One optimizer step: micro-batches forward and backward, then norm, clip, update.
StepStats train_step(Run& run, int64_t step) {
  const Config& cfg = run.cfg;
  const int B = cfg.train.micro_batch, T = cfg.model.seq_len, accum = cfg.train.grad_accum;
  StepStats s;
  s.step = step;
  const auto t_step = Clock::now();

  run.model.zero_grad();
  for (int micro = 0; micro < accum; micro++) {
    const Batch& batch = run.loader.next();
    auto t0 = Clock::now();
    s.loss += run.model.forward(batch.inputs.data(), batch.targets.data(), B, T) / accum;
    s.forward_s += seconds_since(t0);
    t0 = Clock::now();
    run.model.backward(1.0f / float(accum));
    s.backward_s += seconds_since(t0);
  }
  s.data_s = run.loader.take_wait_seconds();

  const auto t_opt = Clock::now();
  s.grad_norm = std::sqrt(run.kernels->sum_squares(run.model.grads(), run.model.table().total));
  s.lr = lr_at(cfg.optim, step, cfg.train.steps);
  s.skipped = !std::isfinite(s.loss) || !std::isfinite(s.grad_norm);
  if (!s.skipped) {
    const double max_norm = cfg.optim.max_grad_norm;
    const float clip =
        max_norm > 0 && s.grad_norm > max_norm ? float(max_norm / s.grad_norm) : 1.0f;
    run.optimizer.update(float(s.lr), clip, step + 1);
  }
  s.optimizer_s = seconds_since(t_opt);

  s.total_s = seconds_since(t_step);
  const double tokens = double(B) * T * accum;
  s.tokens_per_s = tokens / s.total_s;
  s.mfu = run.flops_per_token * s.tokens_per_s / run.peak_flops;
  return s;
}

double validation_loss(Run& run) {
  const int B = run.cfg.train.micro_batch, T = run.cfg.model.seq_len;
  Batch batch;
  double total = 0;
  for (int i = 0; i < run.cfg.train.val_batches; i++) {
    validation_batch(run.val_data, i, B, T, batch);
    total += run.model.forward(batch.inputs.data(), batch.targets.data(), B, T);
  }
  return total / run.cfg.train.val_batches;
}

std::string sample_text(Run& run, int64_t step) {
  SampleOptions opts{run.cfg.train.sample_tokens, run.cfg.train.sample_temperature,
                     run.cfg.train.sample_top_k, run.cfg.run.seed + uint64_t(step)};
  return byte_decode(sample_tokens(run.model, run.cfg.model.seq_len,
                                   byte_encode(run.cfg.train.sample_prompt), opts));
}

}  // namespace

int train(const Config& cfg) {
  if (cfg.run.threads > 0) omp_set_num_threads(cfg.run.threads);
  // Inputs are validated (data files opened and checked) before anything is written.
  Run run(cfg, make_cpu_kernels());

  namespace fs = std::filesystem;
  fs::create_directories(cfg.run.out_dir);
  write_file_atomic((fs::path(cfg.run.out_dir) / "config.toml").string(), config_to_toml(cfg));
  MetricsLog log((fs::path(cfg.run.out_dir) / "metrics.jsonl").string());

  const int64_t params = run.model.table().total;
  fmt::print("trainer {} | run {} | device cpu, {} threads, OpenBLAS {} kernels\n", TRAINER_VERSION,
             cfg.run.name, omp_get_max_threads(), blas_core_name());
  fmt::print(
      "model: {} layers, {} heads, d_model {}, seq_len {}, vocab {} (padded {}), {:.2f}M params\n",
      cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.seq_len,
      cfg.model.vocab_size, cfg.model.padded_vocab(), double(params) / 1e6);
  fmt::print(
      "data: {} train tokens ({} windows), {} val tokens | batch {} x {} x accum {} = {} "
      "tokens/step\n",
      run.train_data.tokens(), run.train_data.windows(), run.val_data.tokens(),
      cfg.train.micro_batch, cfg.model.seq_len, cfg.train.grad_accum,
      int64_t(cfg.train.micro_batch) * cfg.model.seq_len * cfg.train.grad_accum);
  fmt::print("MFU peak: {:.1f} GFLOP/s ({}), {:.1f} MFLOP/token\n", run.peak_flops / 1e9,
             cfg.run.peak_tflops > 0 ? "configured" : "measured sgemm", run.flops_per_token / 1e6);

  run.model.init_parameters(cfg.run.seed);
  const int64_t tokens_per_step =
      int64_t(cfg.train.micro_batch) * cfg.model.seq_len * cfg.train.grad_accum;
  auto evaluate = [&](int64_t step) {
    const double val = validation_loss(run);
    fmt::print("step {:6d} | val loss {:.4f}\n", step, val);
    log.event({{"step", step}, {"val_loss", val}});
  };
  auto sample = [&](int64_t step) {
    const std::string text = sample_text(run, step);
    fmt::print("step {:6d} | sample:\n{}{}\n---\n", step, cfg.train.sample_prompt, text);
    log.event({{"step", step}, {"sample", text}});
  };
  auto checkpoint = [&](int64_t step) {
    const auto t0 = Clock::now();
    const std::string dir = save_checkpoint(cfg.run.out_dir, cfg, run.model, &run.optimizer,
                                            {step, step * tokens_per_step});
    fmt::print("step {:6d} | checkpoint {} ({:.0f} ms)\n", step, dir, seconds_since(t0) * 1e3);
    log.event({{"step", step}, {"checkpoint", dir}});
  };

  for (int64_t step = 0; step < cfg.train.steps; step++) {
    if (cfg.train.val_every > 0 && step % cfg.train.val_every == 0) evaluate(step);
    if (cfg.train.sample_every > 0 && step % cfg.train.sample_every == 0) sample(step);
    const StepStats stats = train_step(run, step);
    log.step(stats, step % cfg.train.log_every == 0 || step + 1 == cfg.train.steps);
    if (cfg.train.checkpoint_every > 0 && (step + 1) % cfg.train.checkpoint_every == 0 &&
        step + 1 < cfg.train.steps)
      checkpoint(step + 1);
  }
  const int64_t done = cfg.train.steps;
  if (cfg.train.val_every > 0) evaluate(done);
  if (cfg.train.sample_every > 0) sample(done);
  checkpoint(done);
  return 0;
}

}  // namespace trainer
