#pragma once
// One rank's run: everything a training step touches (the layout and its groups, the data, the
// stage executor, the gradient reducer, the optimizer, the pipeline, the checkpoint writer),
// built once by the constructor; and what sets a run up or restores it, shared by `trainer
// train` (trainer/train.cpp) and `trainer eval` (trainer/evaluate.cpp).

#include <fmt/format.h>

#include <chrono>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "comm/grad_reducer.h"
#include "comm/parallel_dims.h"
#include "comm/param_gatherer.h"
#include "comm/rank_groups.h"
#include "io/config.h"
#include "io/data_loader.h"
#include "io/dataset.h"
#include "io/tokenizer.h"
#include "model/stage_executor.h"
#include "trainer/adamw.h"
#include "trainer/batch_schedule.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_writer.h"
#include "trainer/device.h"
#include "trainer/loss_scaler.h"
#include "trainer/node_shards.h"
#include "trainer/outer_optimizer.h"
#include "trainer/pipeline.h"
#include "trainer/report_error.h"
#include "trainer/step_guard.h"
#include "trainer/trace.h"
#include "trainer/traced_communicator.h"

namespace trainer {

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A run of elements of one parameter in this rank's part of the flat buffers: all of them, or
// (ZeRO-1 and -2) the pieces of the data-parallel shard. Its gradient and optimizer state live at
// shard_offset.
struct Span {
  int64_t offset, count, shard_offset;
  const ParamInfo* param;
};
std::vector<Span> whole_spans(const ParamTable& table);
std::vector<Span> shard_spans(const ParamTable& table,
                              const std::vector<GradReducer::Piece>& pieces);
// The ranges of the optimizer's gradient buffer each rank counts in the global gradient norm.
std::vector<Range> owned_ranges(const std::vector<Span>& spans);
std::vector<AdamW::Segment> optimizer_segments(const std::vector<Span>& spans,
                                               const OptimConfig& cfg);

DType compute_dtype(const PrecisionConfig& p);
std::string_view precision_name(DType t);  // a buffer's type as [precision] names it

// Test hooks (environment variables; see run.cpp).
std::pair<int64_t, int> injected_overflow();
std::chrono::milliseconds injected_data_delay();
std::multiset<int64_t> injected_nan_steps();

// Ends the job when a checkpoint write hangs.
void end_hung_checkpoint(World& world, double limit, int64_t step);

// Everything a step touches, built once.
struct Run {
  const Config& cfg;
  World& world;
  ParallelDims dims;
  RankCoords me;
  BatchSchedule schedule;  // each step's micro-batches (a batch ramp changes them)
  GpuPlacement placement;
  std::unique_ptr<Kernels> kernels;  // before the groups: NCCL communicators need the GPU
  // [profile]: the trace of the profiled steps (trainer/trace.h). Besides the step's phases
  // (train_step), it hears the backend's timed operators, each layer's forward and backward
  // (its recomputation included) and every group's transfers: hooks installed only when a
  // profile is asked for.
  Trace trace;
  Groups groups;
  std::unique_ptr<Tokenizer> tokenizer;  // [tokenizer]: samples, checkpoints, the data's check
  // The ranks of this node (node_peers, before the Run): they share the decompression of
  // compressed shards, and their cores and bandwidth enter the planner's estimate of a step.
  NodePeers node;
  NodeShardDecompressor decompressor{*node.comm, cfg.data.cache_dir};
  std::vector<Dataset> train_data;  // one per source of the blend
  Dataset val_data;
  StageExecutor model;
  GradReducer reducer;
  std::unique_ptr<ParamGatherer> gatherer;  // ZeRO-3
  std::vector<Span> spans;  // what this rank updates and sums into the gradient norm
  // Of the spans, those this rank counts in the global gradient norm (each element once), as
  // ranges of the optimizer's gradient buffer: one fused sum per step.
  std::vector<Range> norm_ranges = owned_ranges(spans);
  // Those of this rank's own gradients, before any reduction, as ranges of the flat buffer: what
  // 1-bit Adam's steps measure, since they exchange momentum, not gradients.
  std::vector<Range> local_norm_ranges = owned_ranges(whole_spans(model.table()));
  AdamW optimizer;
  // [comm.outer]: DiLoCo across nodes; the reducer and the optimizer above are then the node's.
  std::unique_ptr<OuterOptimizer> outer;
  std::optional<DataLoader> loader;   // started where the run starts (and again on a rollback)
  BlendPlan blend;                    // how the sources mix (io/blend.h)
  BlendOrder blend_positions{blend};  // each source's position, for the checkpoints
  Pipeline pipe;
  LossScaler scaler;
  StepGuard guard;
  CheckpointWriter writer;
  std::pair<int64_t, int> inject_inf = injected_overflow();
  std::multiset<int64_t> inject_nan = injected_nan_steps();
  std::chrono::milliseconds inject_data_delay = injected_data_delay();
  double flops_per_token;  // model FLOPs, forward and backward (flops_per_token)

  // The run's tokenizer, whose ids must fit the model's vocabulary.
  static std::unique_ptr<Tokenizer> load_run_tokenizer(const Config& c, const std::string& origin) {
    auto t = load_tokenizer(c.tokenizer.kind, c.tokenizer.path, {c.tokenizer.pattern});
    if (c.tokenizer.kind != "bytes" && t->vocab_size() > c.model.vocab_size)
      throw ConfigError(
          fmt::format("{}: [model] vocab_size: {} is smaller than the {} tokens of [tokenizer] {}",
                      origin, c.model.vocab_size, t->vocab_size(), tokenizer_name(c.tokenizer)));
    return t;
  }

  static StageOptions model_options(const Config& c, const RankCoords& me, const ParallelDims& dims,
                                    Communicator* tp, Communicator* cp) {
    StageOptions o;
    o.shard = ModelShard::make(c.model, me.tp, dims.tp(), me.pp, dims.pp());
    o.shard->sequence_parallel = c.parallel.sequence_parallel && dims.tp() > 1;
    if (tp)
      o.tp = TensorParallel(
          tp->rank(), tp->size(),
          [tp](DPtr buf, int64_t n, bool max) {
            tp->all_reduce(buf, n, max ? ReduceOp::max : ReduceOp::sum);
          },
          [tp](DPtr send, DPtr recv, int64_t count) { tp->all_gather(send, recv, count); },
          [tp](DPtr send, DPtr recv, int64_t count) { tp->reduce_scatter(send, recv, count); });
    // Without the communicator (a memory plan), the group's size alone.
    if (dims.cp() > 1)
      o.cp = ContextParallel(
          me.cp, dims.cp(),
          !cp ? ContextParallel::Exchange{} : [cp](DPtr send, DPtr recv, int64_t n, int channel) {
            const int size = cp->size(), me = cp->rank();
            auto r = std::make_shared<Request>(cp->irecv(recv, n, (me + size - 1) % size, channel));
            auto s = std::make_shared<Request>(cp->isend(send, n, (me + 1) % size, channel));
            return std::function<void()>([r, s] {
              r->wait();
              s->wait();
            });
          });
    const BatchSchedule schedule(c.train, c.model.seq_len, dims.dp(), "");
    o.slots = Pipeline::slots(me.pp, dims.pp(), schedule.max_accum());
    o.total_multiple = 16 * int64_t(dims.replicas());
    o.grad_dtype = c.precision.grads == "fp32" ? DType::f32 : compute_dtype(c.precision);
    o.recompute = parse_recompute(c.memory.recompute);
    o.recompute_layers = c.memory.recompute_layers;
    o.windowed_grads = c.parallel.zero >= 2;
    o.windowed_params = c.parallel.zero == 3;
    return o;
  }

  static ReducerOptions reducer_options(const Config& c, const StageExecutor& model) {
    ReducerOptions o;
    // bucket_mb of the gradient buffer's real elements (2 bytes each for 16-bit gradients).
    o.bucket_elems = int64_t(c.parallel.bucket_mb * (1 << 20) / dtype_size(model.grad_dtype()));
    o.overlap = c.parallel.overlap;
    o.shard = c.parallel.zero >= 1;
    if (c.parallel.zero >= 2) o.units = model.grad_units();
    const CompressionConfig& z = c.comm.compression;
    o.compression = {z.method,         z.topk_ratio,      z.powersgd_rank,
                     z.error_feedback, z.warmup_steps,    int64_t(z.min_bucket_kb * 1024 / 4),
                     c.run.seed,       z.powersgd_budget, z.two_phase};
    // The warm-up as configured, then 1-bit momentum, or DGC's top-k of each rank's velocity.
    if (c.optim.name == "onebit_adam")
      o.momentum = {true, float(c.optim.betas[0]), c.optim.freeze_step,
                    CompressionOptions{"onebit", 0, 0, true, 0, 0, c.run.seed, 0, z.two_phase}};
    if (c.optim.name == "dgc_adam")
      o.momentum = {true,
                    float(c.optim.betas[0]),
                    c.optim.freeze_step,
                    CompressionOptions{"topk", c.optim.dgc_ratio, 0, true, 0, 0, c.run.seed},
                    true,
                    c.optim.dgc_masking,
                    c.optim.dgc_warmup_steps};
    for (const ParamInfo& p : model.table().params) {  // matrices as this rank holds them
      if (p.shape.size() == 2) {
        const int64_t cols = p.local_shape()[1];
        o.matrices.push_back({p.offset, p.numel / cols, cols});
      }
      // Copies that must stay equal: on every tensor-parallel rank, on both ends of the pipeline.
      if (p.has_copies(c.parallel.pp)) o.exact.push_back({p.offset, p.numel});
    }
    return o;
  }

  static std::vector<Dataset> load_sources(const Config& c, ShardDecompressor& decompressor) {
    std::vector<Dataset> v;
    for (const DataSource& s : training_sources(c.data))
      v.emplace_back(s.path, c.model.vocab_size, c.model.seq_len, c.data.format == "nanogpt",
                     decompressor);
    return v;
  }
  static BlendPlan fresh_blend(const Config& c) {
    std::vector<double> weights;
    for (const DataSource& s : training_sources(c.data)) weights.push_back(s.weight);
    return BlendPlan::fresh(weights);
  }

  // The layout for this world; its errors name the config file they come from.
  // The batch ramp's rows must divide among this layout's data-parallel ranks, checked here
  // with the config's name (model_options and memory_budget rebuild the schedule after).
  static ParallelDims layout(const Config& c, int world, const std::string& origin) {
    const ParallelDims dims = [&] {
      try {
        return ParallelDims::make(world, c.parallel.dp, c.parallel.tp, c.parallel.pp,
                                  c.parallel.order, c.model, c.parallel.cp);
      } catch (const ConfigError& e) {
        throw ConfigError(origin + ": " + e.what());
      }
    }();
    BatchSchedule(c.train, c.model.seq_len, dims.dp(), origin);
    return dims;
  }

  // Where the data order stands: the samples consumed before step data_step, and how many of
  // them rollbacks skipped.
  int64_t data_step = 0, data_samples = 0, data_skipped = 0;
  int64_t samples_at(int64_t step) const {
    return schedule.samples_at(step, data_step, data_samples);
  }
  // Tokens trained on before `step` (the samples rollbacks skipped were not trained on).
  int64_t tokens_at(int64_t step) const {
    return (samples_at(step) - data_skipped) * cfg.model.seq_len;
  }
  void start_data(int64_t step, int64_t samples) {
    loader.reset();
    data_step = step;
    data_samples = samples;
    // The loader's step k is the run's step + k.
    auto accum = [this, step](int64_t k, int64_t at) {
      if (inject_data_delay.count() > 0) std::this_thread::sleep_for(inject_data_delay);
      return schedule.accum(step + k, at);
    };
    // The loader's own copy of the order, from the known point a resume gave it.
    loader.emplace(train_data, blend_positions, cfg.train.micro_batch, cfg.model.seq_len, accum,
                   cfg.run.seed, cfg.data.prefetch, samples, me.dp, dims.dp());
  }
  bool blended() const { return train_data.size() > 1; }
  // The blend a resumed run continues: the checkpoint's, or where its weights differ from the
  // config's, the config's from the checkpoint's sample on with each source where it stood.
  void resume_blend(const TrainState& ts, bool report) {
    const size_t sources = train_data.size(), saved = std::max<size_t>(1, ts.blend.weights.size());
    if (saved != sources)
      throw ConfigError(fmt::format(
          "[data] sources: the checkpoint was trained on {} source{}, the config names {}: resume "
          "with the same sources, or start from its weights with [init] from",
          saved, saved == 1 ? "" : "s", sources));
    if (sources == 1) return;
    if (ts.blend.weights != blend.weights) {
      if (report)
        fmt::print(
            "data: the blend's weights change from [{}] to [{}] at sample {}; each source "
            "continues from its position [{}]\n",
            format_weights(ts.blend.weights), format_weights(blend.weights), ts.data_samples,
            fmt::join(ts.source_samples, ", "));
      blend = {blend.weights, ts.data_samples, ts.source_samples};
      blend_positions = BlendOrder(blend);
    } else {
      // The same mix: from the checkpoint's positions on, without replaying it from its start.
      blend = ts.blend;
      blend_positions = BlendOrder(blend, ts.data_samples, ts.source_samples);
    }
  }

  // The groups' wrapper, each group traced when `trace` is given.
  static GroupWrapper traced_groups(GroupWrapper wrap, Trace* trace) {
    if (!trace) return wrap;
    return [wrap, trace](std::unique_ptr<Communicator> c, const std::string& group) {
      return traced(wrap ? wrap(std::move(c), group) : std::move(c), *trace, group);
    };
  }
  // The checkpoint writer's own communicator (a single process writes without MPI-IO).
  static std::unique_ptr<Communicator> writer_comm(World& w) {
    return w.size() > 1 ? w.comm().dup() : nullptr;
  }

  Run(const Config& c, World& w, const std::string& origin, const GpuPlacement& gpu,
      std::unique_ptr<Kernels> k, NodePeers peers)
      : cfg(c),
        world(w),
        dims(layout(c, w.size(), origin)),
        me(dims.coords(w.rank())),
        schedule(c.train, c.model.seq_len, dims.dp(), origin),
        placement(gpu),
        kernels(std::move(k)),
        trace(w.rank()),
        groups(make_groups(
            w, dims, c.parallel, c.parallel.allreduce == "hierarchical" || c.comm.outer.on(),
            traced_groups(group_wrapper(gpu, w, *kernels), c.profile.on() ? &trace : nullptr))),
        tokenizer(load_run_tokenizer(c, origin)),
        node(std::move(peers)),
        train_data(load_sources(c, decompressor)),
        val_data(c.data.val, c.model.vocab_size, c.model.seq_len, c.data.format == "nanogpt",
                 decompressor),
        model(c.model, *kernels, compute_dtype(c.precision), c.train.micro_batch, c.model.seq_len,
              model_options(c, me, dims, groups.tp.get(), groups.cp.get())),
        // With outer steps, the node's ranks alone reduce the gradients of every step.
        reducer(*kernels, model.grads(), c.parallel.zero == 3 ? DPtr{} : model.params(),
                model.table().total, c.comm.outer.on() ? *groups.intra : *groups.dp,
                c.comm.outer.on() ? nullptr : groups.intra.get(),
                c.comm.outer.on() ? nullptr : groups.inter.get(), reducer_options(c, model)),
        gatherer(c.parallel.zero == 3
                     ? std::make_unique<ParamGatherer>(*kernels, model.params(), model.dtype(),
                                                       model.grad_units(), *groups.dp,
                                                       groups.intra.get(), groups.inter.get())
                     : nullptr),
        spans(c.parallel.zero ? shard_spans(model.table(), reducer.pieces())
                              : whole_spans(model.table())),
        optimizer(model, c.optim, optimizer_segments(spans, c.optim),
                  c.parallel.zero ? reducer.shard_grads() : model.grads(),
                  c.parallel.zero ? reducer.shard_elems() : model.table().total,
                  gatherer ? gatherer->shard() : DPtr{}, c.memory.offload_optimizer),
        blend(fresh_blend(c)),
        pipe(model, *groups.pp, groups.tp.get(), groups.cp.get(), schedule.max_accum(),
             c.train.micro_batch, c.model.seq_len, c.run.phase_timing),
        scaler(c.precision),
        guard(c.faults, scaler.dynamic()),
        writer(c.model, writer_comm(w), checkpoint_dir(c), c.checkpoint.keep_last,
               w.size() == 1 || w.thread_multiple(), c.faults.checkpoint_timeout_s,
               [&w, limit = c.faults.checkpoint_timeout_s](int64_t step) {
                 end_hung_checkpoint(w, limit, step);
               }),
        flops_per_token(trainer::flops_per_token(c.model)) {
    const std::string named = tokenizer_name(c.tokenizer);
    for (const Dataset& d : train_data) d.check_tokenizer(tokenizer->identity_hash(), named);
    val_data.check_tokenizer(tokenizer->identity_hash(), named);
    // Backward reports the gradients it has finished; the reducer starts their buckets (ZeRO-2:
    // backward writes into the reducer's windows, and each closing one starts its unit's).
    if (c.parallel.zero >= 2) model.set_gradient_windows(&reducer);
    if (gatherer) model.set_param_windows(gatherer.get());
    model.set_grads_ready_hook(
        [this](int64_t frontier, int layers_left) { reducer.ready(frontier, layers_left); });
    if (c.profile.on()) install_profiler();
    if (c.comm.outer.on()) {
      // Every data-parallel group spans as many nodes (uneven hosts could make them differ).
      double nodes[2] = {double(groups.inter->size()), -double(groups.inter->size())};
      w.comm().all_reduce(host_ptr(nodes), 2, ReduceOp::max);
      if (nodes[0] != -nodes[1])
        throw ConfigError(fmt::format(
            "{}: [comm.outer] every_steps: the data-parallel groups span between {} and {} nodes; "
            "outer steps need each to span the same nodes (set parallel.ranks_per_node, or place "
            "the ranks evenly)",
            origin, -nodes[1], nodes[0]));
      if (groups.inter->size() < 2)
        throw ConfigError(fmt::format(
            "{}: [comm.outer] every_steps = {}: the outer steps average the nodes' weights, but "
            "every data-parallel replica of this rank is on one node (set "
            "parallel.ranks_per_node, or place dp across nodes)",
            origin, c.comm.outer.every_steps));
      outer = std::make_unique<OuterOptimizer>(c.comm.outer, model, optimizer, *groups.inter,
                                               *groups.intra, c.parallel.zero >= 1);
    }
    if (c.optim.exchanges_momentum()) {
      // The momentum is exchanged among the ranks the reducer compresses across: alone, it
      // would only be quantized.
      const Communicator& across = groups.inter && !outer ? *groups.inter : *groups.dp;
      double alone = across.size() < 2 ? 1 : 0;
      w.comm().all_reduce(host_ptr(&alone), 1, ReduceOp::max);
      if (alone > 0)
        throw ConfigError(fmt::format(
            "{}: [optim] name = \"{}\" exchanges the momentum between data-parallel "
            "replicas{}, but this rank has none to exchange it with (dp = {})",
            origin, c.optim.name,
            groups.inter ? " on different nodes (allreduce = \"hierarchical\")" : "", dims.dp()));
    }
  }

  // After the weights changed (an update, a restore): ZeRO-1 and -2 all-gather every updated
  // piece; ZeRO-3 gathers its held units and lets the windows be gathered afresh.
  void gather_params() {
    if (gatherer)
      gatherer->refresh();
    else
      reducer.gather_params();
  }

  // The first of the ranks holding these parameters (data- and context-parallel).
  bool replica_leader() const { return dims.replica_index(me) == 0; }
  // Whether this rank writes its part of a checkpoint: a data-parallel replica only once, but
  // every ZeRO shard.
  // With outer steps, the first node's (the others' own weights are the outer state's).
  bool writes_checkpoint() const {
    if (outer && cfg.parallel.zero >= 1) return groups.inter->rank() == 0;
    return cfg.parallel.zero >= 1 || replica_leader();
  }
  // The ranks whose gradients a step averages: the replicas, or with outer steps the node's.
  int gradient_replicas() const { return outer ? groups.intra->size() : dims.replicas(); }
  Layout layout() const {
    return {world.size(),      dims.dp(), dims.tp(),         dims.pp(),
            cfg.parallel.zero, dims.cp(), cfg.parallel.order};
  }
  // The checkpoint of step `at` into the writer's host copy (the last checkpoint's buffers,
  // reused): this rank's weights and AdamW state, the run's state, and each rank's own state
  // (compression residuals, the outer steps'), with every rank's sizes. A protective checkpoint
  // (after a bad step, whose gradients the residuals already hold) leaves the residuals out.
  // Collective over the world.
  void fill_snapshot(int64_t at, bool protective);
  // Every communicator this rank uses, by group, the pipeline's last: the time blocked in the
  // others is exposed communication, in the pipeline's it is waiting for the neighbouring
  // stages. The hierarchical all-reduce's gather has its own communicator inside the node.
  struct NamedGroup {
    const char* name;
    Communicator* comm;
  };
  std::vector<NamedGroup> traffic_groups() const {
    std::vector<NamedGroup> v = {{"dp", groups.dp.get()},
                                 {"cp", groups.cp.get()},
                                 {"tp", groups.tp.get()},
                                 {"emb", groups.emb.get()}};
    if (groups.intra)
      v.insert(v.end(), {{"intra", groups.intra.get()}, {"inter", groups.inter.get()}});
    if (reducer.intra_gather()) v.push_back({"intra", reducer.intra_gather()});
    if (gatherer) {  // ZeRO-3's gathers: the data-parallel group's traffic, flat or by node
      const std::vector<Communicator*> g = gatherer->communicators();
      if (g.size() == 1)
        v.push_back({"dp", g[0]});
      else
        v.insert(v.end(), {{"intra", g[0]}, {"inter", g[1]}});
    }
    v.push_back({"pp", groups.pp.get()});
    return v;
  }
  const std::vector<NamedGroup> all_groups = traffic_groups();
  const ParamInfo* tied_embedding = model.table().tied();  // null: middle stage, untied

  Trace::Clock::time_point layer_start;  // layers run one at a time on the main thread
  void install_profiler() {
    // A GPU's operators run after the host issued them, on a track of their own.
    const std::string track = kernels->asynchronous() ? "GPU" : "";
    kernels->set_op_observer([this, track](const char* op, double flops,
                                           Trace::Clock::time_point t0,
                                           Trace::Clock::time_point t1) {
      if (trace.recording()) trace.add(op, "op", t0, t1, flops, track);
    });
    auto start = [this](int, int) {
      if (trace.recording()) layer_start = Trace::Clock::now();
    };
    auto end = [this](const char* what) {
      return [this, what](int, int layer) {
        if (trace.recording())
          trace.add(fmt::format("layer {} {}", layer, what), "layer", layer_start,
                    Trace::Clock::now());
      };
    };
    model.add_layer_hooks({start, end("forward"), start, end("backward")});
  }
};

// Runs the set-up on every rank. If it fails anywhere, every rank learns it, the first failing
// rank prints its error, and all return its exit code: no rank is left waiting in a collective.
template <class F>
std::optional<int> agree_on_setup(World& world, F&& setup) {
  std::exception_ptr error;
  try {
    setup();
  } catch (...) {
    error = std::current_exception();
  }
  if (world.size() == 1) {
    if (error) return report_error(error);
    return std::nullopt;
  }
  const int failed_rank = first_failing_rank(world.comm(), bool(error));
  if (failed_rank < 0) return std::nullopt;
  double code = 0;
  if (world.rank() == failed_rank) code = report_error(error);
  world.comm().broadcast(host_ptr(&code), 1, failed_rank);
  return int(code);
}

// Restores a checkpoint on every rank (each takes its slice, whatever layout wrote it): the
// tensors, the loss scaler, the compression state when the gradients were exchanged the same
// way (layout, buckets, method), and the data order at `samples` (-1: where the checkpoint
// left it). Returns the step it continues from.
int64_t restore(Run& run, const std::string& file, bool report, int64_t samples = -1);

// The mean loss over the validation windows (train.val_batches micro-batches, spread over the
// whole set).
double validation_loss(Run& run);
// Text sampled from the model for the log at `step`.
std::string sample_text(Run& run, int64_t step);

}  // namespace trainer
