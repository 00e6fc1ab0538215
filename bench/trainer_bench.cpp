// trainer_bench: throughput of one training step (forward, backward, norm, clip, AdamW) on a
// named workload, with random tokens, printed as one JSON line. bench/run.sh compares it with
// bench/torch_bench.py on the same workloads.
//
//   trainer_bench --workload W-S|W-M|W-L [--warmup N] [--steps N] [--threads N] [--seed N]
//                 [--device cpu|cuda] [--dtype fp32|bf16|fp16] [--batch B] [--ops]
//
// --ops adds "ops": each backend operator's milliseconds and calls per timed step, and for
// matmul and attention calls their GFLOP/s (where the step's time goes, beyond the phases).
//
// On the GPU the phases are timed after synchronising the device, MFU is against the GPU's
// data-sheet peak for the dtype (dense tensor-core FLOP/s for 16-bit), and peak_gpu_mb is the
// most of the memory arena ever in use.
#include <omp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "io/config.h"
#include "kernels/cpu/host_memory.h"
#include "kernels/kernels.h"
#include "model/model_definition.h"
#include "model/stage_executor.h"
#include "trainer/adamw.h"
#include "trainer/blas_setup.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Workload {
  std::string name;
  trainer::ModelConfig model;
  int B;
  int default_warmup, default_steps;
};

Workload workload(const std::string& name) {
  Workload w;
  w.name = name;
  w.model.vocab_size = 50257;
  if (name == "W-S") {
    w.model.n_layer = 6, w.model.n_head = 6, w.model.d_model = 384, w.model.seq_len = 256;
    w.B = 4, w.default_warmup = 2, w.default_steps = 5;
  } else if (name == "W-M") {
    w.model.n_layer = 12, w.model.n_head = 12, w.model.d_model = 768, w.model.seq_len = 1024;
    w.B = 1, w.default_warmup = 1, w.default_steps = 3;
  } else if (name == "W-L") {  // a 125M Llama: GQA 12/4 heads, SwiGLU 2048, untied head
    w.model.arch = trainer::Arch::llama;
    w.model.vocab_size = 32000;
    w.model.n_layer = 12, w.model.n_head = 12, w.model.d_model = 768, w.model.seq_len = 1024;
    w.model.n_kv_head = 4, w.model.ffn_hidden = 2048, w.model.tie_embeddings = false;
    w.B = 1, w.default_warmup = 1, w.default_steps = 3;
  } else {
    throw std::invalid_argument("unknown workload '" + name + "' (W-S, W-M or W-L)");
  }
  return w;
}

struct Options {
  std::string workload = "W-S";
  int warmup = -1, steps = -1;  // -1: the workload's default
  int threads = 2;
  uint64_t seed = 1337;
  std::string device = "cpu";
  std::string dtype = "fp32";
  int batch = 0;  // 0: the workload's
  std::string recompute = "none";
  bool ops = false;
};

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; i++) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::puts(
          "usage: trainer_bench --workload W-S|W-M|W-L [--warmup N] [--steps N] [--threads N]"
          " [--seed N] [--device cpu|cuda] [--dtype fp32|bf16|fp16] [--batch B]"
          " [--recompute none|selective|full] [--ops]");
      std::exit(0);
    }
    if (arg == "--ops") {
      o.ops = true;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument("missing value after " + arg);
    const std::string value = argv[++i];
    if (arg == "--workload") {
      o.workload = value;
    } else if (arg == "--warmup") {
      o.warmup = std::stoi(value);
    } else if (arg == "--steps") {
      o.steps = std::stoi(value);
    } else if (arg == "--threads") {
      o.threads = std::stoi(value);
    } else if (arg == "--seed") {
      o.seed = std::stoull(value);
    } else if (arg == "--device") {
      if (value != "cpu" && value != "cuda") throw std::invalid_argument("--device cpu|cuda");
      o.device = value;
    } else if (arg == "--dtype") {
      if (value != "fp32" && value != "bf16" && value != "fp16")
        throw std::invalid_argument("--dtype fp32|bf16|fp16");
      o.dtype = value;
    } else if (arg == "--batch") {
      o.batch = std::stoi(value);
    } else if (arg == "--recompute") {
      trainer::parse_recompute(value);  // throws on anything else
      o.recompute = value;
    } else {
      throw std::invalid_argument("unknown option " + arg);
    }
  }
  return o;
}

// CPU time spent by the whole machine (busy + stolen by the hypervisor) and by this process,
// so that a run can say whether something else competed for the cores while it was timed.
struct CpuSample {
  Clock::time_point wall;
  double machine_s = 0, self_s = 0;
  int64_t page_faults = 0;
};

CpuSample cpu_sample() {
  CpuSample s;
  s.wall = Clock::now();
  std::ifstream stat("/proc/stat");
  std::string cpu;
  double user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  if (stat >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal)
    s.machine_s = (user + nice + system + irq + softirq + steal) / double(sysconf(_SC_CLK_TCK));
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  s.self_s = double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
             1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
  s.page_faults = trainer::page_faults();
  return s;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int run(const Options& opt) {
  const Workload w = workload(opt.workload);
  const int warmup = opt.warmup >= 0 ? opt.warmup : w.default_warmup;
  const int steps = opt.steps > 0 ? opt.steps : w.default_steps;
  const int B = opt.batch > 0 ? opt.batch : w.B, T = w.model.seq_len;
  omp_set_num_threads(opt.threads);
  const bool gpu = opt.device == "cuda";
  const trainer::DType dtype = opt.dtype == "bf16"   ? trainer::DType::bf16
                               : opt.dtype == "fp16" ? trainer::DType::f16
                                                     : trainer::DType::f32;
  if (!gpu && dtype != trainer::DType::f32)
    throw std::invalid_argument("16-bit dtypes are benchmarked on the GPU (--device cuda)");

  trainer::OptimConfig optim;  // defaults: lr 3e-4, betas 0.9/0.95, eps 1e-8, wd 0.1, clip 1.0
  auto kernels = gpu ? trainer::make_cuda_kernels({}) : trainer::make_cpu_kernels();
  trainer::StageOptions model_options;
  model_options.grad_dtype = trainer::DType::f32;  // mixed precision keeps fp32 gradients
  model_options.recompute = trainer::parse_recompute(opt.recompute);
  // What the plan says the model holds (weights, gradients, activations), before it is made.
  const trainer::StageExecutor::Memory planned =
      trainer::StageExecutor::memory_needed(w.model, dtype, B, T, model_options);
  trainer::StageExecutor model(w.model, *kernels, dtype, B, T, model_options);
  model.init_parameters(opt.seed);
  trainer::AdamW optimizer(model, optim);
  if (optimizer.master()) model.init_parameters(opt.seed, optimizer.master());

  std::mt19937_64 rng(opt.seed);
  std::uniform_int_distribution<int32_t> token(0, w.model.vocab_size - 1);
  std::vector<int32_t> tokens(size_t(B) * T), targets(size_t(B) * T);
  for (auto& t : tokens) t = token(rng);
  for (auto& t : targets) t = token(rng);

  // CPU: the best of the start-up sgemm bursts, raised by any faster call of the run itself
  // (read after the run). GPU: the data sheet.
  if (!gpu) kernels->measure_peak_flops();
  const double flops_per_token = trainer::flops_per_token(w.model);
  const double palm_flops_per_token = trainer::palm_flops_per_token(w.model);  // mfu_palm's

  // --ops: each operator's calls, seconds and FLOPs over the timed steps.
  struct OpTotals {
    int64_t calls = 0;
    double seconds = 0, flops = 0;
  };
  std::map<std::string, OpTotals> ops;
  bool timing_ops = false;
  if (opt.ops)
    kernels->set_op_observer([&](const char* op, double flops, auto t0, auto t1) {
      if (!timing_ops) return;
      OpTotals& o = ops[op];
      o.calls++;
      o.seconds += std::chrono::duration<double>(t1 - t0).count();
      o.flops += flops;
    });

  // The same work as train_step with one micro-batch, each phase timed.
  std::vector<double> total_s, forward_s, backward_s, optimizer_s;
  double loss = 0, first_loss = 0;
  CpuSample cpu0;
  trainer::Kernels::MatmulTotals mm0;
  for (int step = 0; step < warmup + steps; step++) {
    if (step == warmup) cpu0 = cpu_sample(), mm0 = kernels->matmul_totals(), timing_ops = true;
    const auto t_step = Clock::now();
    model.zero_grad();
    auto t0 = Clock::now();
    // Returns the loss: synchronises.
    loss = model.training_forward(0, tokens.data(), targets.data(), B, T, 1.0f);
    if (step == 0) first_loss = loss;
    const double fwd = seconds_since(t0);
    t0 = Clock::now();
    model.backward(1.0f);
    kernels->synchronize();
    const double bwd = seconds_since(t0);
    t0 = Clock::now();
    const double norm = std::sqrt(kernels->sum_squares(model.grads(), model.table().total));
    if (std::isfinite(loss) && std::isfinite(norm)) {
      const double max_norm = optim.max_grad_norm;
      const float clip = max_norm > 0 && norm > max_norm ? float(max_norm / norm) : 1.0f;
      optimizer.update(float(optim.lr), clip, step + 1);
    }
    kernels->synchronize();
    const double opt_s = seconds_since(t0);
    const double total = seconds_since(t_step);
    if (step < warmup) continue;
    total_s.push_back(total);
    forward_s.push_back(fwd);
    backward_s.push_back(bwd);
    optimizer_s.push_back(opt_s);
  }

  const CpuSample cpu1 = cpu_sample();
  // Inside matmul and attention calls (CPU): their time per step and their own rate, so that
  // MFU splits into how fast the products run and how much of the step is anything else.
  const trainer::Kernels::MatmulTotals mm1 = kernels->matmul_totals();
  const double matmul_s = (mm1.seconds - mm0.seconds) / steps;
  const double matmul_flops = (mm1.flops - mm0.flops) / steps;
  const double timed_s = std::chrono::duration<double>(cpu1.wall - cpu0.wall).count();
  const double self_cores = (cpu1.self_s - cpu0.self_s) / timed_s;
  const double other_cores =
      std::max(0.0, (cpu1.machine_s - cpu0.machine_s) / timed_s - self_cores);

  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const double step_s = median(total_s);
  const double tokens_per_s = double(B) * T / step_s;
  const double peak = kernels->peak_flops(dtype);
  nlohmann::ordered_json out = {
      {"framework", "trainer"},
      {"workload", w.name},
      {"tokens_per_s", tokens_per_s},
      {"ms_per_step", step_s * 1e3},
      {"device", kernels->name()},
      {"dtype", opt.dtype},
      {"mfu", peak > 0 ? flops_per_token * tokens_per_s / peak : 0.0},
      {"mfu_palm", peak > 0 ? palm_flops_per_token * tokens_per_s / peak : 0.0},
      {"peak_gflops", peak / 1e9},
      {"matmul_ms", matmul_s * 1e3},  // per step, in matmul and attention calls
      {"matmul_gflops", matmul_s > 0 ? matmul_flops / matmul_s / 1e9 : 0.0},
      {"matmul_share", matmul_s / step_s},  // of the step's time
      {"peak_gpu_mb", double(kernels->memory().peak) / (1 << 20)},
      {"recompute", opt.recompute},
      // The model's planned bytes (weights, gradients, activations) and AdamW's state (two fp32
      // moments, and fp32 master weights for 16-bit models).
      {"planned_activations_mb", double(planned.activations + planned.stats) / (1 << 20)},
      {"planned_mb",
       (double(planned.total()) + double(model.table().total) * 4 * (optimizer.master() ? 3 : 2)) /
           (1 << 20)},
      {"flops_per_token", flops_per_token},
      {"matmul_params", trainer::matmul_params(w.model)},
      {"threads", omp_get_max_threads()},
      {"blas_core", trainer::blas_core_name()},
      {"peak_rss_mb", double(usage.ru_maxrss) / 1024.0},  // ru_maxrss is in KiB on Linux
      {"batch", B},
      {"seq_len", T},
      {"warmup", warmup},
      {"steps", steps},
      {"forward_ms", median(forward_s) * 1e3},
      {"backward_ms", median(backward_s) * 1e3},
      {"optimizer_ms", median(optimizer_s) * 1e3},
      // Pages touched for the first time per step: 0 once warm (buffers and freed blocks are
      // reused); thousands mean memory handed back to the system and faulted in again.
      {"page_faults_per_step", double(cpu1.page_faults - cpu0.page_faults) / steps},
      {"first_loss", first_loss},  // a sanity check: the losses should track PyTorch's
      {"final_loss", loss},
      {"self_cpu_cores", self_cores},    // about `threads` when OpenMP had the cores to itself
      {"other_cpu_cores", other_cores},  // other processes and steal: > 0.1 means a noisy run
  };
  if (opt.ops) {
    nlohmann::ordered_json table = nlohmann::ordered_json::object();
    for (const auto& [name, o] : ops) {
      table[name] = {{"ms_per_step", o.seconds / steps * 1e3},
                     {"calls_per_step", double(o.calls) / steps}};
      if (o.flops > 0) table[name]["gflops"] = o.flops / o.seconds / 1e9;
    }
    out["ops"] = std::move(table);
  }
  std::puts(out.dump().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  trainer::ensure_fast_blas(argv);
  trainer::keep_freed_memory();  // as the trainer does: freed blocks are reused, not faulted in
                                 // again
  try {
    return run(parse_args(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trainer_bench: %s\n", e.what());
    return 2;
  }
}
