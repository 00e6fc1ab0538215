#include "trainer/run.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "trainer/sampler.h"

namespace trainer {

std::vector<Span> whole_spans(const ParamTable& table) {
  std::vector<Span> spans;
  for (const ParamInfo& p : table.params) spans.push_back({p.offset, p.numel, p.offset, &p});
  return spans;
}

std::vector<Range> owned_ranges(const std::vector<Span>& spans) {
  std::vector<Range> ranges;
  for (const Span& s : spans)
    if (s.param->owned()) ranges.push_back({s.shard_offset, s.count});
  return ranges;
}

std::vector<Span> shard_spans(const ParamTable& table,
                              const std::vector<GradReducer::Piece>& pieces) {
  std::vector<Span> spans;
  for (const GradReducer::Piece& piece : pieces)
    for (const ParamInfo& p : table.params) {
      const int64_t lo = std::max(piece.offset, p.offset);
      const int64_t hi = std::min(piece.offset + piece.count, p.offset + p.numel);
      if (lo < hi) spans.push_back({lo, hi - lo, piece.shard_offset + (lo - piece.offset), &p});
    }
  return spans;
}

std::vector<AdamW::Segment> optimizer_segments(const std::vector<Span>& spans,
                                               const OptimConfig& cfg) {
  std::vector<AdamW::Segment> segments;
  for (const Span& s : spans)
    segments.push_back({s.offset, s.count, s.shard_offset, AdamW::weight_decay(cfg, *s.param)});
  return segments;
}

DType compute_dtype(const PrecisionConfig& p) {
  return p.compute == "bf16" ? DType::bf16 : p.compute == "fp16" ? DType::f16 : DType::f32;
}
// A buffer's type as [precision] names it.
std::string_view precision_name(DType t) {
  return t == DType::bf16 ? "bf16" : t == DType::f16 ? "fp16" : "fp32";
}

// Test hook: TRAINER_TEST_INJECT_INF="step,rank" makes one gradient infinite on that rank at
// that step, to check that an overflow anywhere skips the step everywhere.
std::pair<int64_t, int> injected_overflow() {
  const char* spec = std::getenv("TRAINER_TEST_INJECT_INF");
  if (!spec) return {-1, -1};
  long long step = -1;
  int rank = -1;
  if (std::sscanf(spec, "%lld,%d", &step, &rank) != 2) return {-1, -1};
  return {step, rank};
}

// Test hook: TRAINER_TEST_DATA_DELAY_MS=50 makes the loader take that long more per step (slow
// storage), to check the data-wait warning.
std::chrono::milliseconds injected_data_delay() {
  const char* spec = std::getenv("TRAINER_TEST_DATA_DELAY_MS");
  return std::chrono::milliseconds(spec ? std::atoi(spec) : 0);
}

// Test hook: TRAINER_TEST_INJECT_NAN="3,4,5" makes the loss of those steps NaN, once per
// listing (a rolled-back run that repeats a step listed once trains it normally), to check the
// step guard.
std::multiset<int64_t> injected_nan_steps() {
  std::multiset<int64_t> steps;
  if (const char* spec = std::getenv("TRAINER_TEST_INJECT_NAN")) {
    std::stringstream in(spec);
    for (std::string item; std::getline(in, item, ',');)
      if (!item.empty()) steps.insert(std::stoll(item));
  }
  return steps;
}

// A checkpoint write that hangs (a dead peer inside a parallel HDF5 collective, a stuck file
// system) ends the job like a hung collective.
void end_hung_checkpoint(World& world, double limit, int64_t step) {
  fmt::print(stderr,
             "trainer: the checkpoint write of step {} did not finish within {} s "
             "(checkpoint_timeout_s): a peer is dead or hung, or the file system is stuck; "
             "ending the job\n",
             step, limit);
  std::fflush(stderr);
  world.abort(1);
}

void Run::fill_snapshot(int64_t at, bool protective) {
  Snapshot& snap = writer.snapshot();
  take_snapshot(model, &optimizer, writes_checkpoint(), snap);
  const int64_t samples = samples_at(at);
  snap.state = {at,
                tokens_at(at),
                samples,
                data_skipped,
                scaler.state(),
                layout(),
                guard.recent_losses(),
                guard.recent_norms(),
                blended() ? blend : BlendPlan{},
                blended() ? blend_positions.positions(samples) : std::vector<int64_t>{}};
  snap.config_text = config_to_toml(cfg);
  snap.tokenizer = tokenizer->serialize();
  snap.seed = cfg.run.seed;
  // A protective checkpoint's step was skipped, but its compression residuals have moved on
  // (not 1-bit Adam's or DGC's: a skipped step exchanges nothing).
  const bool moved_on = protective && !reducer.exchanges_momentum();
  // Each rank's own state, written into the last checkpoint's copy (no second copy is made).
  snap.rank_states.resize(outer ? 2 : 1);
  snap.rank_states[0].group = "comm/state";
  if (moved_on)
    snap.rank_states[0].mine.clear();
  else
    reducer.compression_state(snap.rank_states[0].mine);
  if (outer) {
    snap.rank_states[1].group = "outer/state";
    outer->state(snap.rank_states[1].mine);
  }
  // Every rank's sizes in one all-gather: rank r's i-th state at [r * states + i].
  const size_t states = snap.rank_states.size();
  std::vector<double> mine(states), all(states * size_t(world.size()));
  for (size_t i = 0; i < states; i++) mine[i] = double(snap.rank_states[i].mine.size());
  world.comm().all_gather(host_ptr(mine.data()), host_ptr(all.data()), int64_t(states));
  for (size_t i = 0; i < states; i++) {
    std::vector<int64_t>& sizes = snap.rank_states[i].sizes;
    sizes.resize(size_t(world.size()));
    for (size_t r = 0; r < sizes.size(); r++) sizes[r] = int64_t(all[r * states + i]);
  }
}

double validation_loss(Run& run) {
  const int B = run.cfg.train.micro_batch, T = run.cfg.model.seq_len;
  Batch batch;
  double total = 0;
  for (int i = 0; i < run.cfg.train.val_batches; i++) {
    validation_batch(run.val_data, i, run.cfg.train.val_batches, B, T, batch);
    total += run.pipe.evaluate(batch.inputs.data(), batch.targets.data(), B, T);
  }
  return total / run.cfg.train.val_batches;
}

std::string sample_text(Run& run, int64_t step) {
  SampleOptions opts{run.cfg.train.sample_tokens, run.cfg.train.sample_temperature,
                     run.cfg.train.sample_top_k, run.cfg.run.seed + uint64_t(step)};
  auto next_logits = [&](const int32_t* tokens, int n, int pos0, std::vector<float>& logits) {
    run.pipe.next_logits(tokens, n, pos0, logits);
  };
  return trainer::sample_text(next_logits, run.tokenizer.get(), run.cfg.model.vocab_size,
                              run.cfg.model.seq_len, run.cfg.train.sample_prompt, opts);
}

// Restores a checkpoint on every rank (each takes its slice, whatever layout wrote it): the
// tensors, the loss scaler, the compression state when the gradients were exchanged the same
// way (layout, buckets, method), and the data order at `samples` (-1: where the checkpoint
// left it). Returns the step it continues from.
int64_t restore(Run& run, const std::string& file, bool report, int64_t samples) {
  const TrainState ts = load_checkpoint(file, run.model, &run.optimizer);
  run.scaler.set_state(ts.scaler);
  run.guard.restore(ts.recent_losses, ts.recent_norms);
  const bool rounded = run.optimizer.master() && run.cfg.precision.stochastic_rounding;
  if (rounded) run.optimizer.round_master(ts.step);  // the last update's rounding, not nearest-even
  // ZeRO: the other ranks' pieces; ZeRO-3: the held units, and windows gathered afresh (after a
  // rollback they hold the abandoned weights).
  const Config& cfg = run.cfg;
  if (run.outer) {
    // Each node's own weights and moments and the outer state, when saved from this layout and
    // outer configuration; else the outer steps start afresh from the first node's weights.
    const Config saved = checkpoint_config(file);
    // (Its learning rate, momentum and period may change: the state means the same.)
    const bool same = ts.layout == run.layout() && saved.comm.outer.on() &&
                      saved.comm.outer.quantize == cfg.comm.outer.quantize &&
                      saved.parallel.ranks_per_node == cfg.parallel.ranks_per_node;
    std::vector<float> state = rank_state(file, "outer/state", run.world.rank());
    if (!same) state.clear();
    if (!run.outer->set_state(state, run.world.comm(), ts.step)) {
      run.outer->reset();
      if (report)
        fmt::print(
            "outer state: not in the checkpoint for this layout and [comm.outer]; the outer "
            "steps start from its weights\n");
    }
  }
  if (rounded || run.gatherer || run.outer) run.gather_params();
  // (1-bit Adam's momentum is kept there too; without it, it starts from the optimizer's.)
  if (cfg.comm.compression.method != "none" || cfg.optim.exchanges_momentum()) {
    const Config saved = checkpoint_config(file);
    const bool same_exchange =
        ts.layout == run.layout() && saved.parallel.bucket_mb == cfg.parallel.bucket_mb &&
        saved.parallel.allreduce == cfg.parallel.allreduce &&
        saved.comm.compression == cfg.comm.compression && saved.optim.name == cfg.optim.name &&
        saved.optim.freeze_step == cfg.optim.freeze_step;
    double restored = same_exchange && run.reducer.set_compression_state(
                                           rank_state(file, "comm/state", run.world.rank()))
                          ? 1
                          : 0;
    run.world.comm().all_reduce(host_ptr(&restored), 1, ReduceOp::sum);
    if (restored < run.world.size()) run.reducer.reset_compression_state();
    if (report && restored < run.world.size())
      fmt::print(
          "compression state: not restored on {} of {} ranks (not in the checkpoint, or saved "
          "with another layout, buckets or method); the residuals start from zero{}\n",
          run.world.size() - int(restored), run.world.size(),
          cfg.optim.exchanges_momentum() ? ", the exchanged momentum from the checkpoint's" : "");
  }
  run.resume_blend(ts, report);
  run.data_skipped = ts.data_skipped + (samples >= 0 ? samples - ts.data_samples : 0);
  run.start_data(ts.step, samples >= 0 ? samples : ts.data_samples);
  return ts.step;
}

}  // namespace trainer
