#include "trainer/train.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <thread>

#include "comm/bus_bandwidth.h"
#include "comm/grad_reducer.h"
#include "comm/parallel_dims.h"
#include "comm/rank_groups.h"
#include "io/atomic_file.h"
#include "io/data_loader.h"
#include "io/dataset.h"
#include "io/safetensors.h"
#include "io/tokenizer.h"
#include "kernels/cpu/host_memory.h"
#include "model/init.h"
#include "model/stage_executor.h"
#include "trainer/adamw.h"
#include "trainer/batch_schedule.h"
#include "trainer/blas_setup.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_interval.h"
#include "trainer/checkpoint_writer.h"
#include "trainer/comm_budget.h"
#include "trainer/device.h"
#include "trainer/gpu_health.h"
#include "trainer/hf_format.h"
#include "trainer/llmc_format.h"
#include "trainer/loss_scaler.h"
#include "trainer/lr_schedule.h"
#include "trainer/memory_budget.h"
#include "trainer/metrics.h"
#include "trainer/node_shards.h"
#include "trainer/pipeline.h"
#include "trainer/planner.h"
#include "trainer/report_error.h"
#include "trainer/run.h"
#include "trainer/run_dir.h"
#include "trainer/sampler.h"
#include "trainer/start_report.h"
#include "trainer/step_guard.h"
#include "trainer/trace.h"

namespace trainer {
namespace {

// SIGTERM / SIGUSR1 (what Slurm sends before preemption or the time limit): finish the step,
// checkpoint, exit with kExitRequeue. A signal handler can only set a flag.
volatile std::sig_atomic_t stop_requested = 0;
extern "C" void request_stop(int) {
  stop_requested = 1;
}

// Where the run starts: the checkpoint [checkpoint] resume names (empty for a fresh start).
// "auto" takes the newest checkpoint in out_dir that verifies, saying why newer ones do not.
std::string resume_file(const Config& cfg, bool report) {
  const std::string& r = cfg.checkpoint.resume;
  if (r == "none") return "";
  if (r != "auto") return resolve_checkpoint(r);
  std::vector<std::string> rejected;
  const std::string found = newest_valid_checkpoint(checkpoint_dir(cfg), cfg.model, rejected);
  if (report)
    for (const std::string& why : rejected)
      fmt::print(stderr, "trainer: skipping an unusable checkpoint: {}\n", why);
  return found;
}

// An overflow injected for tests (TRAINER_INJECT_INF): one infinite gradient on one rank, in
// the flat buffer before the reduction spreads it, or under ZeRO-2 and -3 (which keep none) in the
// rank's reduced shard, at an element the gradient norm counts.
void inject_overflow(Run& run, int64_t step, bool reduced) {
  if (run.inject_inf.first != step || run.inject_inf.second != run.world.rank()) return;
  if (reduced != (run.cfg.parallel.zero >= 2)) return;
  const float inf = INFINITY;
  if (!reduced) return run.kernels->upload_f32(run.model.grads(), &inf, 1);
  if (!run.norm_ranges.empty())
    run.kernels->upload_f32(run.optimizer.grads() + run.norm_ranges.front().offset, &inf, 1);
}

// One optimizer step: the micro-batches through the pipeline, gradient reduction, the global
// norm, clipping and the update.
StepStats train_step(Run& run, int64_t step, bool checkpoint_due) {
  const Config& cfg = run.cfg;
  const int B = cfg.train.micro_batch, T = cfg.model.seq_len;
  const int M = run.schedule.accum(step, run.samples_at(step));
  const int dp = run.dims.dp();
  // Ranks whose gradients are averaged: the data-parallel ones, and with context parallelism
  // their peers, each with its mean over its chunks of the same sequences.
  const int replicas = run.dims.replicas();
  StepStats s;
  s.step = step;
  s.batch = int64_t(B) * M * dp;
  const auto t_step = Clock::now();
  const int64_t faults_before = page_faults();
  const auto& all = run.all_groups;
  std::vector<Communicator::Traffic> before;
  for (const auto& g : all) before.push_back(g.comm->traffic());
  // The profile's spans (recorded only in the profiled steps): the step, made of its phases.
  Trace::Phases phase(&run.trace, "step", "phase", "forward and backward");

  run.model.zero_grad();
  run.reducer.start_step(step);
  if (run.gatherer) run.gatherer->take_stats();  // evaluation's and sampling's gathers aside
  PipeTimes times;
  // Gradients of loss x scale (fp16), averaged over the micro-batches and replicas.
  const double scale = run.scaler.scale();
  s.loss_scale = scale;
  s.data_queue = run.loader->ready_batches();
  s.data_rows = run.loader->ready_rows();
  // Dropout's masks: a function of (seed, step, micro-batch x dp + dp rank), as the data is.
  run.model.train_mode(mix64(uint64_t(cfg.run.seed) ^ mix64(uint64_t(step))), run.me.dp, dp);
  const double loss_sum = run.pipe.step(
      M,
      [&]() -> const Batch& {
        const Trace::Span wait(&run.trace, "data", "phase");
        return run.loader->next();
      },
      float(scale / (M * run.gradient_replicas())), [&] { run.reducer.arm(); }, times);
  run.model.eval_mode();
  inject_overflow(run, step, false);
  s.forward_s = times.forward_s;
  s.backward_s = times.backward_s;
  s.phases_timed = times.timed;
  s.data_s = run.loader->take_wait_seconds();

  // The tied embedding's two copies (first and last stage) get the sum of both gradients
  // (an untied model has none: its head is the last stage's own parameter).
  phase.next("gradient reduction");
  if (run.tied_embedding && run.groups.emb->size() > 1)
    run.groups.emb->all_reduce(run.model.grad(*run.tied_embedding), run.tied_embedding->numel,
                               ReduceOp::sum);
  run.reducer.ready(0);
  // 1-bit Adam's and DGC's compressed steps exchange momentum: what joins it is first clipped by
  // the norm of the gradients before their exchange, and a skipped step exchanges nothing.
  const bool exchanges_momentum = run.reducer.exchanges_momentum();
  if (!exchanges_momentum) run.reducer.finish();
  inject_overflow(run, step, true);
  if (run.gatherer) {
    const ParamGatherer::Stats g = run.gatherer->take_stats();
    s.param_gathers = g.gathers;
    s.param_ready = g.ready;
    s.param_waited = g.waited;
  }

  const auto t_opt = Clock::now();
  phase.next("loss and norm");
  // The step's mean loss and squared gradient norm, summed over the world: each loss once per
  // data-parallel replica, each gradient element once.
  const bool zero = cfg.parallel.zero >= 1;
  const DPtr grads = run.optimizer.grads();
  // The fifth sum is the world's peak FLOP/s: each rank's, this step's matmuls included. With
  // outer steps each node has gradients of its own: their squared norms follow, one per node
  // (the first sum is then theirs together).
  const int workers = run.outer ? run.outer->workers() : 1;
  std::vector<double> sums(5 + (workers > 1 ? workers : 0));
  sums[2] = double(stop_requested);
  sums[3] = double(checkpoint_due);
  sums[4] = run.kernels->peak_flops(compute_dtype(cfg.precision));
  if (run.model.shard().last_stage() && run.me.tp == 0) sums[0] = loss_sum / M / replicas;
  if (auto it = run.inject_nan.find(step); it != run.inject_nan.end()) {
    run.inject_nan.erase(it);
    if (run.world.rank() == 0) sums[0] = NAN;
  }
  // Each element once: a ZeRO piece, or the first replica's (with outer steps, of each node).
  // Before an exchange of momentum, each rank's own gradients: the norm is then the replicas'
  // root mean square, an upper bound of the mean gradient's (Cauchy-Schwarz).
  const bool counts_norm =
      zero || (run.outer ? run.groups.intra->rank() == 0 : run.replica_leader());
  if (exchanges_momentum)
    sums[1] = run.kernels->sum_squares(run.model.grads(), run.local_norm_ranges) *
              run.gradient_replicas();
  else if (counts_norm)
    sums[1] = run.kernels->sum_squares(grads, run.norm_ranges);
  if (workers > 1) sums[5 + run.groups.inter->rank()] = sums[1];
  run.world.comm().all_reduce(host_ptr(sums.data()), int64_t(sums.size()), ReduceOp::sum);
  s.stop = sums[2] > 0;  // a signal reached some rank: every rank stops after this step
  s.checkpoint_due = sums[3] > 0;
  s.loss = sums[0];
  // The norm the step guard watches is the same on every rank: with outer steps, the nodes'
  // root mean square; each node clips by its own.
  s.grad_norm = std::sqrt(sums[1] / workers) / scale;
  const double own_norm =
      workers > 1 ? std::sqrt(sums[5 + run.groups.inter->rank()]) / scale : s.grad_norm;
  s.lr = lr_at(cfg.optim, step, cfg.train.steps);
  // Every rank sees the same sums, so every rank skips the same steps.
  const bool overflow = !std::isfinite(s.loss) || !std::isfinite(s.grad_norm);
  // From the freeze on (1-bit Adam, DGC) the norm is the replicas' root mean square, larger than
  // the mean gradient's the guard's window holds: the window starts afresh.
  if (exchanges_momentum && step == cfg.optim.freeze_step) run.guard.forget_norms();
  const StepGuard::Verdict verdict = run.guard.check(s.loss, s.grad_norm, s.bad);
  s.rollback = verdict == StepGuard::Verdict::rollback;
  s.skipped = overflow || verdict != StepGuard::Verdict::good;
  run.scaler.update(overflow);
  const double max_norm = cfg.optim.max_grad_norm;
  const double clip = max_norm > 0 && own_norm > max_norm ? max_norm / own_norm : 1.0;
  // The gradients scaled (clipped, the loss scale undone) where they are used: in the update, or
  // as they join the momentum exchanged.
  double update_scale = clip / scale;
  if (exchanges_momentum) {
    phase.next("momentum exchange");
    if (s.skipped) {
      run.reducer.skip();
    } else {
      if (!run.reducer.momentum_ready())
        run.reducer.start_momentum([&](int64_t at, float* dst, int64_t n) {
          run.optimizer.read_state(AdamW::State::m, at, dst, n);
        });
      run.reducer.set_gradient_scale(float(update_scale));
      run.reducer.finish();
      update_scale = 1;
    }
  }
  const std::vector<int>& started = run.reducer.started_with_layers_left();
  s.buckets = int(started.size());
  for (int layers_left : started) s.buckets_overlapped += layers_left > 0;
  s.first_bucket_layers_left = started.empty() ? -1 : started.front();
  phase.next("optimizer");
  if (!s.skipped) {
    run.optimizer.update(float(s.lr), float(update_scale), step + 1);
    run.gather_params();
  }
  // The nodes meet (on schedule, whether or not this step updated).
  if (run.outer && run.outer->due(step, cfg.train.steps)) {
    phase.next("outer step");
    run.outer->step(step + 1);
    run.gather_params();
    s.outer_step = true;
  }
  if (run.optimizer.offloaded()) {
    const AdamW::OffloadStats o = run.optimizer.take_offload_stats();
    s.offload_segments = o.segments;
    s.offload_update_s = o.update_s;
    s.offload_wait_s = o.waited_s;
  }
  run.kernels->synchronize();  // the update's kernels, on a GPU, have finished
  s.optimizer_s = seconds_since(t_opt);
  phase.end();

  for (size_t i = 0; i < all.size(); i++) {
    const Communicator::Traffic now = all[i].comm->traffic();
    const int64_t sent = now.bytes_sent - before[i].bytes_sent;
    s.bytes_sent += sent;
    if (sent) s.bytes_by_group[all[i].name] += sent;
    const double waited = now.wait_s - before[i].wait_s;
    (i + 1 == all.size() ? s.pipe_wait_s : s.comm_s) += waited;
  }
  const GradReducer::CompressionStats compression = run.reducer.take_compression_stats();
  s.compress_s = compression.seconds;
  s.bytes_uncompressed = compression.uncompressed_bytes;
  s.total_s = seconds_since(t_step);
  s.page_faults = page_faults() - faults_before;
  s.bubble = s.pipe_wait_s / s.total_s;
  const double tokens = double(B) * T * M * dp;
  s.tokens_per_s = tokens / s.total_s;
  s.peak_flops = sums[4];
  s.mfu = s.peak_flops > 0 ? run.flops_per_token * s.tokens_per_s / s.peak_flops : 0;
  return s;
}

// The end of [profile]'s steps: each rank's trace file, and rank 0's table of where its traced
// steps' time went: the phases, and the operators that took the most (with their GFLOP/s).
void finish_profile(Run& run) {
  run.kernels->synchronize();  // a GPU's last operators heard of
  run.trace.set_recording(false);
  run.kernels->set_op_observer({});  // and no more timed
  const std::filesystem::path dir = std::filesystem::path(run.cfg.run.out_dir) / "trace";
  std::filesystem::create_directories(dir);
  run.trace.write((dir / fmt::format("rank_{}.json", run.world.rank())).string());
  if (run.world.rank() != 0) return;
  const std::vector<Trace::Total> steps = run.trace.totals("step");
  if (steps.empty()) return;
  const double step_s = steps[0].seconds;
  fmt::print(
      "profile: {} steps traced ({}/rank_<r>.json; scripts/merge_traces.py joins them), "
      "{:.1f} ms a step on rank 0:\n",
      steps[0].calls, dir.string(), 1e3 * step_s / double(steps[0].calls));
  fmt::print("  {:32} {:>7} {:>10} {:>7} {:>9}\n", "phase / operator", "calls", "ms", "% step",
             "GFLOP/s");
  for (const char* category : {"phase", "op", "comm_wait"}) {
    const std::vector<Trace::Total> totals = run.trace.totals(category);
    for (size_t i = 0; i < std::min<size_t>(totals.size(), 8); i++) {
      const Trace::Total& t = totals[i];
      fmt::print(
          "  {:32} {:7} {:10.1f} {:6.1f}% {:>9}\n", t.name, t.calls, 1e3 * t.seconds,
          100 * t.seconds / step_s,
          t.flops > 0 && t.seconds > 0 ? fmt::format("{:.1f}", t.flops / t.seconds / 1e9) : "");
    }
  }
  // Transfers in flight (overlapping compute; their waits above are what was exposed).
  const std::vector<Trace::Total> transfers = run.trace.totals("collective");
  if (!transfers.empty())
    fmt::print("  {:32} {:>7} {:>10} {:>7} {:>9}\n", "transfer (in flight)", "calls", "ms", "MB",
               "GB/s");
  for (size_t i = 0; i < std::min<size_t>(transfers.size(), 8); i++) {
    const Trace::Total& t = transfers[i];
    fmt::print("  {:32} {:7} {:10.1f} {:7.1f} {:9.2f}\n", t.name, t.calls, 1e3 * t.seconds,
               t.bytes / 1e6, t.seconds > 0 ? t.bytes / t.seconds / 1e9 : 0.0);
  }
}

// Every rank read the tokenizer's files itself: they must be the same files everywhere (a
// collective; every rank gets the same answer).
void check_one_tokenizer(World& world, const Tokenizer& tokenizer, const TokenizerConfig& cfg) {
  const uint64_t h = tokenizer.identity_hash();
  // The largest and (negated) smallest of each 32-bit half, which doubles hold exactly.
  double halves[4] = {double(h >> 32), double(h & 0xffffffffu)};
  halves[2] = -halves[0], halves[3] = -halves[1];
  world.comm().all_reduce(host_ptr(halves), 4, ReduceOp::max);
  if (halves[0] != -halves[2] || halves[1] != -halves[3])
    throw ConfigError(fmt::format(
        "[tokenizer] {}: the ranks read different files (their identity hashes differ): every "
        "node needs the same tokenizer files",
        tokenizer_name(cfg)));
}

// Whether a stop signal reached any rank (a collective: every rank gets the same answer).
bool stop_agreed(World& world) {
  double stop = stop_requested;
  world.comm().all_reduce(host_ptr(&stop), 1, ReduceOp::max);
  return stop > 0;
}

}  // namespace

void catch_stop_signals() {
  std::signal(SIGTERM, request_stop);
  std::signal(SIGUSR1, request_stop);
  // A file-size limit (ulimit -f) must fail the write, not kill the process.
  std::signal(SIGXFSZ, SIG_IGN);
}

int train(const std::string& config_path, const std::vector<std::string>& overrides, World& world,
          bool dry_run) {
  catch_stop_signals();
  // A test stands in for a slow start-up (large shards to validate, a checkpoint to verify).
  if (const char* delay = std::getenv("TRAINER_TEST_STARTUP_DELAY"))
    std::this_thread::sleep_for(std::chrono::duration<double>(std::atof(delay)));
  // Inputs are validated (config, layout, data files) before anything is written.
  Config cfg;
  std::unique_ptr<Run> run_ptr;
  std::string resume, init;
  NodePeers node = node_peers(world);  // who shares this node and its cores
  // Rank 0 alone picks the checkpoint to resume from (reading it back whole), or for a fresh
  // start the one to take the weights from, and tells the others, so that every rank starts
  // from the same one.
  if (auto failed = agree_on_setup(world, [&] {
        cfg = load_config(config_path, overrides);
        if (world.rank() != 0) return;
        check_fresh_run_dir(cfg, config_path);
        resume = resume_file(cfg, true);
        if (resume.empty() && !cfg.init.from.empty()) {
          init = resolve_checkpoint(cfg.init.from);
          check_weights(init, cfg.model);
        }
      }))
    return *failed;
  broadcast_string(world.comm(), resume, 0);
  broadcast_string(world.comm(), init, 0);
  // Each stage that holds a collective is entered by every rank or by none.
  GpuPlacement placement;
  std::unique_ptr<Kernels> kernels;
  if (auto failed = agree_on_setup(world, [&] {
        omp_set_num_threads(threads_per_rank(cfg.run.threads, node.core_share));
        if (resume.empty()) return;
        checkpoint_config(resume);  // a readable checkpoint of ours
        check_same_model(resume, cfg.model);
        const int64_t at = checkpoint_step(resume);
        if (at >= cfg.train.steps)
          throw ConfigError(fmt::format(
              "{}: [train] steps = {}, but the checkpoint to resume from ({}) is at step {}: "
              "nothing left to train (set train.steps above {})",
              config_path, cfg.train.steps, resume, at, at));
      }))
    return *failed;
  // [comm] budget_ms: the way across nodes that keeps within it (method = "auto" takes it, so
  // before anything is sized by the config).
  CommAdvice comm_advice;
  if (auto failed = agree_on_setup(
          world, [&] { comm_advice = advise_communication(cfg, world, config_path); }))
    return *failed;
  release_freed_memory();  // what reading the config and a checkpoint left (check_memory reads
                           // the memory available)
  if (auto failed = agree_on_setup(world, [&] {
        placement = place_on_gpus(cfg, world, config_path);
        kernels = make_kernels(cfg, placement);
        check_memory(cfg, world, *kernels, config_path);
      }))
    return *failed;
  // The MFU peak: configured, a GPU's data sheet, or measured on the CPU by one rank while the
  // others wait, so that they do not compete, and taken by all. Before the model is allocated,
  // so that the measurement's matrices are not part of training's peak memory.
  double peak = cfg.run.peak_tflops * 1e12;
  if (peak <= 0 && cfg.run.device == "cpu") {
    if (world.rank() == 0) peak = kernels->measure_peak_flops();
    world.comm().broadcast(host_ptr(&peak), 1, 0);
  }
  if (peak > 0) kernels->set_peak_flops(peak);
  // The bandwidth of an all-reduce among this node's ranks, for the step's estimate: on the CPU
  // copies through shared memory on the ranks' own cores, no data sheet's figure. Every rank
  // takes part (a rank alone on its node too).
  if (cfg.run.device == "cpu" && world.size() > 1)
    node.gbps = all_reduce_gbps(*node.comm, world.comm(), 8 << 20);
  release_freed_memory();  // the measurements' buffers, and MPI's
  // What the process holds before the model: the measured side of the memory plan is above it.
  const ResidentMemory before_model = resident_memory();
  if (auto failed = agree_on_setup(world, [&] {
        run_ptr = std::make_unique<Run>(cfg, world, config_path, placement, std::move(kernels),
                                        std::move(node));
        check_one_tokenizer(world, *run_ptr->tokenizer, cfg.tokenizer);
        if (!resume.empty())
          check_same_tokenizer(resume, *run_ptr->tokenizer, tokenizer_name(cfg.tokenizer));
      }))
    return *failed;
  Run& run = *run_ptr;
  const bool leader = world.rank() == 0;
  const std::string ckpt_dir = checkpoint_dir(cfg);

  world.set_collective_timeout(cfg.faults.collective_timeout_s);  // not over the measurement
  if (dry_run) {
    if (leader) {
      print_start(run);
      print_dry_run(run);
    }
    world.comm().barrier();
    return 0;
  }

  // A stop signal during start-up (MPI, data, verifying checkpoints): nothing is trained or
  // written yet, so every rank exits 75 at once and a requeue loses nothing.
  if (stop_agreed(world)) {
    if (leader) fmt::print("stopped by a signal during start-up, nothing written: exit 75\n");
    return kExitRequeue;
  }

  namespace fs = std::filesystem;
  std::optional<MetricsLog> log;
  if (leader) {
    if (cfg.run.overwrite) remove_run_files(cfg);
    fs::create_directories(cfg.run.out_dir);
    write_file_atomic((fs::path(cfg.run.out_dir) / "config.toml").string(), config_to_toml(cfg));
    log.emplace((fs::path(cfg.run.out_dir) / "metrics.jsonl").string(), !resume.empty());
    remove_incomplete_checkpoints(ckpt_dir);  // a crash mid-write left them
    if (const double s = print_start(run); s > 0) log->event({{"planned_step_s", s}});
    if (!comm_advice.ways.empty()) {
      fmt::print("{}\n", comm_advice.line);
      nlohmann::json ways = nlohmann::json::array();
      for (const CommWay& w : comm_advice.ways)
        ways.push_back({{"way", w.name}, {"inter_bytes", w.bytes}, {"ms", w.ms}});
      log->event({{"comm_budget_ms", cfg.comm.budget_ms},
                  {"inter_node_gbps", comm_advice.gbps},
                  {"comm_ways", ways},
                  {"comm_chosen", comm_advice.ways[size_t(comm_advice.chosen)].name},
                  {"comm_auto", comm_advice.applied}});
    }
  }

  if (run.gatherer) {  // ZeRO-3: this rank's pieces only
    run.optimizer.init_shard(cfg.run.seed);
  } else if (run.optimizer.master()) {  // exact fp32 values for the master, rounded for the model
    run.optimizer.init_parameters(cfg.run.seed);
  } else {
    run.model.init_parameters(cfg.run.seed);
  }
  if (run.optimizer.master() && cfg.precision.stochastic_rounding)
    run.optimizer.set_stochastic_rounding(cfg.run.seed);
  int64_t step = 0;
  if (!init.empty())  // a warm start: the weights only, checked by rank 0 above
    load_weights(init, run.model, &run.optimizer);
  if (run.gatherer) run.gather_params();  // ZeRO-3: the held units whole
  if (run.outer) run.outer->reset();      // the outer weights start as every node's
  if (!init.empty()) {
    if (leader) {
      fmt::print(
          "initialized from {} ({}; optimizer state, step, schedule and data order start "
          "fresh)\n",
          init,
          SafetensorsFile::is_one(init) ? std::string("safetensors weights")
          : HfDirectory::is_one(init)   ? std::string("weights in transformers' layout")
          : LlmcFile::is_one(init)      ? std::string("weights in llm.c's format")
                                        : fmt::format("weights of step {}", checkpoint_step(init)));
      log->event({{"step", 0}, {"init_from", init}});
    }
  }
  if (resume.empty()) {
    run.start_data(0, 0);
  } else {
    step = restore(run, resume, leader);
    if (leader) {
      fmt::print("resumed from {} at step {} (data position: sample {})\n", resume, step,
                 run.data_samples);
      log->event({{"step", step}, {"resumed_from", resume}});
    }
  }
  // The launcher's view of the run (trainer/run_dir.h): running until every rank has finished.
  auto set_status = [&](const RunStatus& status) {
    if (!leader) return;
    try {
      write_run_status(cfg, status);
    } catch (const std::exception& e) {  // the exit code still tells
      fmt::print(stderr, "trainer: warning: cannot write the run's status: {}\n", e.what());
    }
  };
  auto finish = [&](int code, const std::string& state, int64_t at, const std::string& reason) {
    world.comm().barrier();  // every rank's checkpoint writer has finished
    set_status({state, code, at, reason});
    return code;
  };
  set_status({"running", -1, step, resume.empty() ? "started" : "resumed from " + resume});
  if (leader && cfg.checkpoint.async && !run.writer.threaded())
    fmt::print(
        "checkpoints: written synchronously, not in the background: a writer thread on several "
        "ranks needs MPI_THREAD_MULTIPLE, which this MPI library did not provide\n");
  // The snapshot buffers are touched now, so that the first periodic checkpoint's stall is a
  // copy, not the page faults of allocating gigabytes; the second copy is the first estimate of
  // a checkpoint's stall, for every_steps = "auto".
  const bool auto_interval = cfg.checkpoint.every_steps == CheckpointConfig::kAutoSteps;
  CheckpointCosts costs{0, 0, cfg.checkpoint.mtbf_hours * 3600};
  SnapshotCopy snapshot_copy = SnapshotCopy::none;  // what the memory plan counts of it
  if ((cfg.checkpoint.async || auto_interval) &&
      (cfg.checkpoint.every_steps != 0 || cfg.checkpoint.every_minutes > 0)) {
    take_snapshot(run.model, &run.optimizer, run.writes_checkpoint(), run.writer.snapshot());
    snapshot_copy = SnapshotCopy::touched;
    if (costs.mtbf_s > 0) {
      const auto t0 = Clock::now();
      take_snapshot(run.model, &run.optimizer, run.writes_checkpoint(), run.writer.snapshot());
      costs.stall_s = seconds_since(t0);
    }
  }
  // Young/Daly's interval from the measured costs (rank 0; trainer/checkpoint_interval.h).
  IntervalAdvisor advisor(cfg.checkpoint, cfg.train.steps, costs);
  auto evaluate = [&](int64_t at) {
    const double val = validation_loss(run);
    if (!leader) return;
    fmt::print("step {:6d} | val loss {:.4f}\n", at, val);
    log->event({{"step", at}, {"val_loss", val}});
  };
  auto sample = [&](int64_t at) {
    const std::string text = sample_text(run, at);
    if (!leader) return;
    if (takes_text(run.tokenizer.get(), cfg.model.vocab_size))
      fmt::print("step {:6d} | sample:\n{}{}\n---\n", at, cfg.train.sample_prompt, text);
    else
      fmt::print(
          "step {:6d} | sample (token ids after token 0: a vocabulary of {} tokens has no "
          "tokenizer): {}\n",
          at, cfg.model.vocab_size, text);
    log->event({{"step", at}, {"sample", text}});
  };
  // A finished write, as every rank saw it: logged by rank 0; false if it failed.
  // The newest checkpoint a rollback could return to: the run's start, or one written or being
  // written (a failed write falls back to the last one written).
  int64_t last_checkpoint_step = resume.empty() ? -1 : step,
          last_written_step = last_checkpoint_step;
  auto report = [&](const std::optional<CheckpointWriter::Result>& r) {
    if (!r) return true;
    if (!r->error.empty()) {
      last_checkpoint_step = last_written_step;
      if (leader) {
        fmt::print(stderr, "trainer: {} (the previous checkpoints are intact)\n", r->error);
        log->event({{"step", r->step}, {"checkpoint_error", r->error}});
      }
      return false;
    }
    last_written_step = r->step;
    if (leader) {
      fmt::print("step {:6d} | checkpoint {} written ({:.0f} ms)\n", r->step, r->dir,
                 r->write_s * 1e3);
      log->event({{"step", r->step}, {"checkpoint", r->dir}, {"write_ms", r->write_s * 1e3}});
      advisor.costs.write_s = r->write_s;
      if (r->step < cfg.train.steps) advisor.advise(*log);  // the final one changes nothing
    }
    return true;
  };
  // Waits for the write in flight and reports it. A write that hangs (a dead peer inside a
  // parallel HDF5 collective, a stuck file system) ends the job like a hung collective.
  auto await_writer = [&]() {
    const double limit = cfg.faults.checkpoint_timeout_s;
    if (!run.writer.finishes_within(limit)) end_hung_checkpoint(world, limit, run.writer.writing());
    return report(run.writer.wait());
  };
  auto last_checkpoint_time = Clock::now();
  // Training pays only for copying its state to host memory (the stall); the writer thread does
  // the rest unless `sync`. Returns false if a synchronous write failed.
  // protective: written after a bad step, whose gradients the compressors' error-feedback
  // residuals already hold: the checkpoint leaves them out (a resume from it starts them at zero).
  auto checkpoint = [&](int64_t at, bool sync, bool protective = false) {
    const auto t0 = Clock::now();
    bool ok = await_writer();  // one write at a time
    run.fill_snapshot(at, protective);
    snapshot_copy = SnapshotCopy::taken;
    const Snapshot& snap = run.writer.snapshot();
    const double mb = double(snap.params.size() * (snap.has_moments ? 3 : 1)) * 4 / (1 << 20);
    // In the background unless asked to wait (the final and the signalled checkpoints, or
    // async = false) or unable to (no writer thread).
    const bool background = !sync && cfg.checkpoint.async && run.writer.threaded();
    run.writer.start();
    if (!background) ok = await_writer();    // this one decides (an earlier failure was reported)
    const double stall = seconds_since(t0);  // what the step was blocked for
    last_checkpoint_time = Clock::now();
    last_checkpoint_step = at;
    advisor.costs.stall_s = stall;
    if (leader) {
      fmt::print(
          "step {:6d} | checkpoint: training stalled {:.0f} ms ({:.1f} MB copied on rank 0{})\n",
          at, stall * 1e3, mb, background ? "" : ", written synchronously");
      log->event({{"step", at}, {"checkpoint_stall_ms", stall * 1e3}, {"async", background}});
    }
    return ok;
  };
  // Too many bad steps in a row: back to the newest checkpoint this run wrote or started from.
  // The same bad steps coming back after kMaxRollbacks rollbacks to one checkpoint (the data is
  // not skipped, or the model itself has gone bad) end the run instead of looping.
  constexpr int kMaxRollbacks = 3;
  std::string last_target;
  int rollbacks = 0;
  auto roll_back = [&](int64_t bad_step) {
    await_writer();
    const std::string target =
        !run.writer.last_written().empty() ? run.writer.last_written() + "/state.h5" : resume;
    if (target.empty())
      throw TrainingDiverged(
          fmt::format("{} bad steps in a row up to step {} and no checkpoint to roll back to "
                      "(set [checkpoint] every_steps)",
                      cfg.faults.max_bad_steps, bad_step));
    rollbacks = target == last_target ? rollbacks + 1 : 1;
    last_target = target;
    if (rollbacks > kMaxRollbacks)
      throw TrainingDiverged(fmt::format(
          "{} bad steps in a row up to step {} after {} rollbacks to {}: the bad steps come back",
          cfg.faults.max_bad_steps, bad_step, kMaxRollbacks, target));
    // With skip_data_on_rollback the batches since the checkpoint are not tried again.
    const int64_t at = restore(
        run, target, false, cfg.faults.skip_data_on_rollback ? run.samples_at(bad_step + 1) : -1);
    if (leader) {
      fmt::print(stderr,
                 "trainer: {} bad steps in a row up to step {}: rolled back to {} (step {}){}\n",
                 cfg.faults.max_bad_steps, bad_step, target, at,
                 cfg.faults.skip_data_on_rollback
                     ? fmt::format(", skipping to sample {}", run.data_samples)
                     : "");
      log->event({{"step", bad_step},
                  {"rollback_to", target},
                  {"rollback_step", at},
                  {"data_samples", run.data_samples}});
    }
    return at;
  };

  // ... or while the weights were initialised or restored: the run's checkpoints already hold
  // everything, so it stops without another.
  if (stop_agreed(world)) {
    if (leader) fmt::print("stopped by a signal before step {}, nothing trained: exit 75\n", step);
    return finish(kExitRequeue, "stopped", step,
                  fmt::format("stopped by a signal before step {}; nothing trained", step));
  }
  // GPU health from NVML at the log interval (trainer/gpu_health.h).
  std::optional<GpuHealthWatch> gpu_health;
  if (cfg.run.device == "cuda")
    gpu_health.emplace(cuda_device_uuid(placement.device), world.comm());
  if (gpu_health) gpu_health->read(step, log ? &*log : nullptr);  // the counts a run starts from

  const auto training_start = Clock::now();
  const int64_t first_step = step;
  DataWaitWatch data_wait;
  while (step < cfg.train.steps) {
    world.set_step(step);
    if (cfg.train.val_every > 0 && step % cfg.train.val_every == 0) evaluate(step);
    if (cfg.train.sample_every > 0 && step % cfg.train.sample_every == 0) sample(step);
    // Rank 0's clock and advice, agreed in the step's all-reduce.
    const bool time_due =
        leader && ((cfg.checkpoint.every_minutes > 0 &&
                    seconds_since(last_checkpoint_time) >= cfg.checkpoint.every_minutes * 60) ||
                   (advisor.auto_every() > 0 && (step + 1) % advisor.auto_every() == 0));
    StepStats stats;
    try {
      run.trace.set_recording(cfg.profile.on() && step >= cfg.profile.steps[0] &&
                              step <= cfg.profile.steps[1]);
      stats = train_step(run, step, time_due);
      // Where the run stands: the clock, the tokens so far, and the time to the end at this
      // process's pace so far (evaluations, samples and checkpoints included).
      stats.total_steps = cfg.train.steps;
      stats.time =
          std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
              .count();
      stats.tokens = run.tokens_at(step + 1);
      stats.elapsed_s = seconds_since(training_start);
      stats.eta_s = stats.elapsed_s / double(step + 1 - first_step) *
                    double(std::max<int64_t>(0, cfg.train.steps - step - 1));
      if (stats.rollback) {
        if (leader) log->step(stats, true);
        step = roll_back(step);
        continue;
      }
    } catch (const TrainingDiverged& e) {  // every rank decides the same: one line, no abort
      set_status({"failed", kExitDiverged, step, e.what()});
      if (leader) return report_error(std::current_exception());
      return kExitDiverged;
    }
    if (leader) log->step(stats, step % cfg.train.log_every == 0 || step + 1 == cfg.train.steps);
    if (step > first_step && leader) {
      // The first interval, from the copy, after three steps.
      if (advisor.step_timed(stats.total_s) == 3 && auto_interval) advisor.advise(*log);
    }
    // The first bad step after good ones was skipped: the weights are still the last good
    // state. A checkpoint of it (unless one is recent) makes a rollback after more bad steps
    // lose little. (Not when the nodes met after it: the outer step moved the weights.)
    if (cfg.checkpoint.protect && !stats.bad.empty() && run.guard.bad_in_a_row() == 1 &&
        !stats.outer_step &&
        (last_checkpoint_step < 0 ||
         step - last_checkpoint_step > cfg.checkpoint.protect_min_steps)) {
      if (leader) {
        fmt::print(
            "step {:6d} | a bad step after good ones ({}): protective checkpoint of step {}\n",
            step, stats.bad, step);
        log->event({{"step", step}, {"protective_checkpoint", step}});
      }
      checkpoint(step, false, true);
    }
    // The step was good but a GPU's memory is failing: its result is saved (below, as the
    // step after it) while it still can be.
    const bool ecc_alarm = gpu_health && step % cfg.train.log_every == 0 &&
                           gpu_health->read(step, log ? &*log : nullptr) && stats.bad.empty() &&
                           cfg.checkpoint.protect;
    if (leader && data_wait.starved(stats.data_s, stats.total_s)) {
      const std::string warning = fmt::format(
          "data loading is on the critical path: rank 0 waited for data more than {:.0f}% of "
          "the step for {} steps in a row ({:.1f} of {:.1f} ms at step {}; data_ms in "
          "metrics.jsonl): raise data.prefetch, or look at the storage",
          100 * data_wait.share(), data_wait.steps(), stats.data_s * 1e3, stats.total_s * 1e3,
          step);
      fmt::print("warning: {}\n", warning);
      log->event({{"step", step}, {"warning", warning}});
    }
    report(run.writer.poll());
    step++;
    // Preempted: a checkpoint of the finished steps, then "requeue me" (after the last step the
    // run simply finishes).
    if (stats.stop && step < cfg.train.steps) {
      const bool ok = checkpoint(step, true);
      const int code = ok ? kExitRequeue : 1;
      if (leader) fmt::print("stopped by a signal after step {}: exit {}\n", step - 1, code);
      return finish(code, ok ? "stopped" : "failed", step,
                    ok ? fmt::format("stopped by a signal; checkpoint of step {} written", step)
                       : "stopped by a signal; the checkpoint could not be written");
    }
    // Not in the middle of bad steps: a rollback must find the state from before them.
    const bool every = cfg.checkpoint.every_steps > 0 && step % cfg.checkpoint.every_steps == 0;
    if (ecc_alarm && leader) log->event({{"step", step}, {"protective_checkpoint", step}});
    if ((every || stats.checkpoint_due || ecc_alarm) && step < cfg.train.steps &&
        run.guard.bad_in_a_row() == 0) {
      const Trace::Span span(&run.trace, "checkpoint", "phase");
      checkpoint(step, false);
    }
    if (cfg.profile.on() &&
        step - 1 == std::min<int64_t>(cfg.profile.steps[1], cfg.train.steps - 1))
      finish_profile(run);
  }
  report_memory(run, before_model, snapshot_copy, log ? &*log : nullptr);
  if (leader) {
    if (run.scaler.overflows() > 0)
      fmt::print("skipped steps (non-finite gradients): {}, loss scale now {}\n",
                 run.scaler.overflows(), run.scaler.scale());
    log->event({{"skipped_steps", run.scaler.overflows()}});
  }
  const int64_t done = step;  // train.steps, or later for a run resumed past it
  if (cfg.train.val_every > 0) evaluate(done);
  if (cfg.train.sample_every > 0) sample(done);
  const bool ok = checkpoint(done, true);
  return finish(ok ? 0 : 1, ok ? "finished" : "failed", done,
                ok ? fmt::format("finished; checkpoint of step {} written", done)
                   : "finished training, but the final checkpoint could not be written");
}

}  // namespace trainer
