#include "model/stage_executor.h"

#include <omp.h>

#include <algorithm>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "model/init.h"

namespace trainer {

namespace {

int64_t round16(int64_t elems) {  // 64-byte aligned f32
  return (elems + 15) / 16 * 16;
}

struct Loc {
  bool stats = false;
  int64_t offset = 0;
};

// How many of a stage's `layers` blocks are recomputed.
int recomputed_layers(const StageOptions& o, int layers) {
  if (o.recompute == Recompute::none) return 0;
  return o.recompute_layers <= 0 ? layers : std::min(o.recompute_layers, layers);
}

// The shard the options describe, its context-parallel degree that of their group.
ModelShard shard_of(const ModelConfig& cfg, const StageOptions& o) {
  ModelShard shard = o.shard ? *o.shard : ModelShard::whole(cfg);
  shard.cp_size = o.cp.size();
  return shard;
}

// A whole sequence's length in tokens, checked to split into context parallelism's chunks.
void check_splits(int T, const ContextParallel& cp) {
  if (cp.splits() && T % (2 * cp.size()))
    throw std::invalid_argument(
        "context parallelism cuts each sequence into 2 x cp = " + std::to_string(2 * cp.size()) +
        " chunks: T = " + std::to_string(T) + " is not a multiple");
}

}  // namespace

Recompute parse_recompute(const std::string& name) {
  if (name == "none") return Recompute::none;
  if (name == "selective") return Recompute::selective;
  if (name == "full") return Recompute::full;
  throw std::invalid_argument("recompute must be none, selective or full, not \"" + name + "\"");
}

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::selective:
      return "selective";
    case Recompute::full:
      return "full";
    default:
      return "none";
  }
}

struct StageExecutor::Plan {
  struct Slot {
    Loc input, logits, losses, rowmax, sumexp;
    std::vector<Loc> outputs;
    std::vector<std::vector<Loc>> layers;
    std::vector<Loc> head;
  };
  int64_t acts = 0, stats = 0;  // elements of each slab
  std::vector<Slot> slots;
  Loc d_res;
  std::vector<Loc> scratch;
  Loc recompute_out;  // full recomputation's discarded block output
  // Full recomputation: each recomputed block's key/value cache for infer() (one sequence of
  // max_T positions), by local block: its kv_cache activations, by declared index.
  std::vector<std::vector<std::optional<Loc>>> kv_caches;

  Loc take(int64_t elems, bool in_stats = false) {
    int64_t& cursor = in_stats ? stats : acts;
    const Loc at{in_stats, cursor};
    cursor += round16(elems);
    return at;
  }
  std::vector<Loc> take(const std::vector<ActSpec>& specs) {
    std::vector<Loc> locs;
    for (const ActSpec& s : specs) locs.push_back(take(s.elems, s.stats));
    return locs;
  }
};

StageExecutor::Plan StageExecutor::plan(const ModelDefinition& def, int max_B, int max_T,
                                        const StageOptions& o) {
  const ModelShard& shard = def.shard();
  const int64_t BT = int64_t(max_B) * max_T, C = def.config().d_model;
  const int64_t stream = def.stream_rows(max_B, max_T) * C;  // the residual stream's rows here
  const std::vector<ActSpec> layer = def.layer_activations(max_B, max_T);
  const int recomputed = recomputed_layers(o, shard.end_layer - shard.first_layer);
  Plan p;
  // What recomputed blocks do not keep: one set of buffers that they all share.
  std::vector<std::optional<Loc>> shared(layer.size());
  for (size_t i = 0; i < layer.size() && recomputed > 0; i++)
    if (o.recompute == Recompute::full || layer[i].selective)
      shared[i] = p.take(layer[i].elems, layer[i].stats);
  if (recomputed > 0 && o.recompute == Recompute::full) {
    p.recompute_out = p.take(stream);
    const std::vector<ActSpec> one = def.layer_activations(1, max_T);
    for (int l = 0; l < recomputed; l++) {
      std::vector<std::optional<Loc>> caches(one.size());
      for (size_t i = 0; i < one.size(); i++)
        if (one[i].kv_cache) caches[i] = p.take(one[i].elems, one[i].stats);
      p.kv_caches.push_back(std::move(caches));
    }
  }
  for (int s = 0; s < o.slots; s++) {
    Plan::Slot slot;
    slot.input = p.take(stream);
    for (int l = shard.first_layer; l < shard.end_layer; l++) {
      slot.outputs.push_back(p.take(stream));
      std::vector<Loc> acts;
      for (size_t i = 0; i < layer.size(); i++)
        acts.push_back(l - shard.first_layer < recomputed && shared[i]
                           ? *shared[i]
                           : p.take(layer[i].elems, layer[i].stats));
      slot.layers.push_back(std::move(acts));
    }
    if (shard.last_stage()) {
      slot.head = p.take(def.head_activations(max_B, max_T));
      slot.logits = p.take(BT * def.vocab().width);
      slot.losses = p.take(BT, true);
      // This rank's max, then (tensor-parallel) the group's.
      slot.rowmax = p.take(shard.tp_size > 1 ? 2 * BT : BT, true);
      slot.sumexp = p.take(2 * BT, true);
    }
    p.slots.push_back(std::move(slot));
  }
  // Backward scratch, shared by the slots.
  p.d_res = p.take(stream);
  p.scratch = p.take(def.backward_scratch(max_B, max_T));
  return p;
}

StageExecutor::Memory StageExecutor::memory_needed(const ModelConfig& cfg, DType dtype, int max_B,
                                                   int max_T, const StageOptions& o) {
  check_splits(max_T, o.cp);
  const auto def = make_model_definition(cfg, shard_of(cfg, o), o.total_multiple);
  const int64_t total = def->table().total;
  const Plan p = plan(*def, max_B, max_T / o.cp.size(), o);
  const int64_t stats_bytes = dtype_size(is_half(dtype) ? DType::f32 : dtype);
  const int64_t held = held_end(trainer::grad_units(def->table()));
  const int64_t grads = o.windowed_grads ? held : total;
  return {(o.windowed_params ? held : total) * int64_t(dtype_size(dtype)),
          grads * int64_t(dtype_size(o.grad_dtype ? *o.grad_dtype : dtype)),
          p.acts * int64_t(dtype_size(dtype)), p.stats * stats_bytes};
}

StageExecutor::StageExecutor(const ModelConfig& cfg, Kernels& kernels, DType dtype, int max_B,
                             int max_T, const StageOptions& o)
    : def_(make_model_definition(cfg, shard_of(cfg, o), o.total_multiple)),
      k_(kernels),
      dtype_(dtype),
      grad_dtype_(o.grad_dtype ? *o.grad_dtype : dtype),
      stats_dtype_(is_half(dtype) ? DType::f32 : dtype),
      recompute_(o.recompute),
      slots_(o.slots),
      layers_(def_->shard().end_layer - def_->shard().first_layer),
      max_B_(max_B),
      max_T_(max_T) {
  if (max_T > cfg.seq_len) throw std::invalid_argument("max_T exceeds seq_len");
  if (o.tp.size() != shard().tp_size)
    throw std::invalid_argument("the tensor-parallel group does not match the shard");
  tp_ = o.tp;
  cp_ = o.cp;
  check_splits(max_T, cp_);
  sp_ = shard().sequence_parallel;
  if (sp_ && !tp_.splits_rows())
    throw std::invalid_argument("sequence parallelism needs a tensor-parallel group that gathers");
  recompute_layers_ = recomputed_layers(o, layers_);
  units_ = trainer::grad_units(table());
  windowed_params_ = o.windowed_params;
  params_elems_ = windowed_params_ ? held_end(units_) : table().total;
  // Never null (a windowed shard without held units holds none): the backend's own pointer.
  params_ = k_.alloc(std::max<int64_t>(params_elems_, 16), dtype);
  windowed_ = o.windowed_grads;
  grads_elems_ = windowed_ ? held_end(units_) : table().total;
  grads_ = grads_elems_ > 0 ? k_.alloc(grads_elems_, grad_dtype_)
                            : DPtr{nullptr, grad_dtype_, params_.device};  // typed, holding none
  if (sp_) norm_grad_scratch_ = k_.alloc(2 * int64_t(cfg.d_model), grad_dtype_);
  if (windowed_params_)
    forward_progress_ = [this] {
      if (param_windows_) param_windows_->progress();
    };
  const Plan p = plan(*def_, max_B, local_T(max_T), o);
  acts_ = k_.alloc(p.acts, dtype);
  stats_ = k_.alloc(p.stats, stats_dtype_);
  auto at = [&](Loc l) { return (l.stats ? stats_ : acts_) + l.offset; };
  auto all = [&](const std::vector<Loc>& locs) {
    std::vector<DPtr> v;
    for (Loc l : locs) v.push_back(at(l));
    return v;
  };
  for (const Plan::Slot& s : p.slots) {
    std::vector<std::vector<DPtr>> layers;
    for (const auto& layer : s.layers) layers.push_back(all(layer));
    SlotViews v{at(s.input),  at(s.logits),   at(s.losses),      at(s.rowmax),
                at(s.sumexp), all(s.outputs), std::move(layers), all(s.head)};
    views_.push_back(std::move(v));
  }
  d_res_ = at(p.d_res);
  scratch_ = all(p.scratch);
  if (recompute_ == Recompute::full && recompute_layers_ > 0) recompute_out_ = at(p.recompute_out);
  // infer() gives every block slot 0's views, with a recomputed block's own key/value cache.
  for (int l = 0; l < layers_; l++) {
    std::vector<DPtr> acts = views_[0].layers[l];
    if (l < int(p.kv_caches.size()))
      for (size_t i = 0; i < acts.size(); i++)
        if (p.kv_caches[l][i]) acts[i] = at(*p.kv_caches[l][i]);
    inference_layers_.push_back(std::move(acts));
  }
  def_->prepare(k_, max_T);
  // What the gradient-ready hook reports: after a layer's backward, everything from its first
  // parameter on is final; after the head's, everything after the last block (the final norm
  // and an untied head; a tied embedding copy, ahead of the blocks, is final only at the end).
  for (int l = shard().first_layer; l < shard().end_layer; l++)
    layer_frontier_.push_back(table().layer_offset(l));
  head_frontier_ = table().total;
  const int64_t blocks_end = layers_ > 0 ? layer_frontier_.back() : -1;
  for (const ParamInfo& p : table().params)
    if (p.layer < 0 && p.offset > blocks_end) head_frontier_ = std::min(head_frontier_, p.offset);
  first_block_unit_ = layers_ > 0 && units_.front().begin < layer_frontier_.front() ? 1 : 0;
  loss_state_.assign(slots_, {});
  dropout_keys_.assign(slots_, 0);
  tokens_.assign(slots_, std::vector<int32_t>(size_t(max_B) * max_T));
  targets_.assign(slots_, std::vector<int32_t>(size_t(max_B) * max_T));
}

StageExecutor::~StageExecutor() {
  def_->release(k_);
  k_.free(params_);
  if (norm_grad_scratch_) k_.free(norm_grad_scratch_);
  if (grads_) k_.free(grads_);
  k_.free(acts_);
  k_.free(stats_);
}

std::vector<double> StageExecutor::initial_values(uint64_t seed, const ParamInfo& p, int64_t begin,
                                                  int64_t end) const {
  std::vector<double> values(end - begin);
  const uint64_t stream = hash_name(p.name);
  if (p.kind == ParamKind::norm) {
    std::fill(values.begin(), values.end(), 1.0);
  } else if (p.kind != ParamKind::bias) {
    // Each thread a contiguous share, walked as runs of consecutive logical indices: the index
    // arithmetic (which builds the local shape) once a run, not once an element (it had been
    // a third of a 16M-parameter model's start-up).
#pragma omp parallel
    {
      const int64_t n = end - begin, threads = omp_get_num_threads(), t = omp_get_thread_num();
      p.for_each_run(begin + n * t / threads, begin + n * (t + 1) / threads,
                     [&](int64_t local, int64_t logical, int64_t count) {
                       for (int64_t k = 0; k < count; k++)
                         values[local - begin + k] =
                             p.init_std * normal_at(seed, stream, logical + k);
                     });
    }
  }
  return values;
}

void StageExecutor::init_parameters(uint64_t seed, DPtr into) {
  // In chunks: the host holds 8 MB of doubles, never a whole parameter (a GPT-2 vocabulary's
  // embedding would be 154 MB of them, and as much again on its way into the buffer).
  for (const auto& p : table().params)
    for (int64_t at = 0; at < p.local_numel(); at += kInitChunk) {
      const int64_t end = std::min(p.local_numel(), at + kInitChunk);
      write_values(into + p.offset + at, initial_values(seed, p, at, end));
    }
}

// Host values in H to and from a buffer of any dtype: copied where the dtypes match, else through
// fp32, which every backend converts to and from (the CUDA backend has no f64 kernels, and
// neither backend converts between f64 and 16-bit). f64 values become floats on the host first,
// as AdamW::init_parameters makes its master copy: rounded once to fp32, then to a 16-bit dtype.
template <class H>
void StageExecutor::write_values(DPtr dst, const std::vector<H>& values) {
  const int64_t n = int64_t(values.size());
  if (dst.dtype == dtype_of<H>()) return k_.copy_from_host(dst, values.data(), n);
  if constexpr (std::is_same_v<H, float>) {
    k_.upload_f32(dst, values.data(), n);
  } else {
    const std::vector<float> floats(values.begin(), values.end());
    k_.upload_f32(dst, floats.data(), n);
  }
}

template <class H>
std::vector<H> StageExecutor::read(const ParamInfo& p, DPtr buffer) const {
  const int64_t n = p.local_numel();
  std::vector<H> out(n);
  if (buffer.dtype == dtype_of<H>()) {
    k_.copy_to_host(out.data(), buffer + p.offset, n);
  } else if constexpr (std::is_same_v<H, float>) {
    k_.download_f32(out.data(), buffer + p.offset, n);
  } else {
    const std::vector<float> floats = read<float>(p, buffer);
    std::copy(floats.begin(), floats.end(), out.begin());
  }
  return out;
}

template <class H>
void StageExecutor::write(const ParamInfo& p, DPtr buffer, const std::vector<H>& values) {
  if (int64_t(values.size()) != p.local_numel())
    throw std::invalid_argument("size mismatch for " + p.name);
  write_values(buffer + p.offset, values);
}

template std::vector<float> StageExecutor::read<float>(const ParamInfo&, DPtr) const;
template std::vector<double> StageExecutor::read<double>(const ParamInfo&, DPtr) const;
template void StageExecutor::write<float>(const ParamInfo&, DPtr, const std::vector<float>&);
template void StageExecutor::write<double>(const ParamInfo&, DPtr, const std::vector<double>&);

DPtr StageExecutor::input(int slot) const {
  return views_.at(slot).input;
}
DPtr StageExecutor::output(int slot) const {
  const SlotViews& v = views_.at(slot);
  return layers_ > 0 ? v.outputs.back() : v.input;
}
DPtr StageExecutor::grad_io() const {
  return d_res_;
}
DPtr StageExecutor::logits(int slot) const {
  return views_.at(slot).logits;
}
DPtr StageExecutor::losses(int slot) const {
  return views_.at(slot).losses;
}

void StageExecutor::zero_grad() {
  if (grads_) k_.zero(grads_, grads_elems_);
}

void StageExecutor::train_mode(uint64_t step_key, int first, int stride) {
  training_ = true;
  step_key_ = step_key;
  next_micro_ = first;
  micro_stride_ = stride;
}

LayerCall StageExecutor::call(int slot, int B, int T, const DPtr* acts) const {
  const FlatSpan params{params_, 0, params_elems_}, grads{grads_, 0, grads_elems_};
  LayerCall c{k_,
              tp_,
              windowed_params_ ? FlatSpan{} : params,
              windowed_params_ ? params : FlatSpan{},
              windowed_ ? FlatSpan{} : grads,
              windowed_ ? grads : FlatSpan{},
              B,
              T};
  if (windowed_params_) c.progress = &forward_progress_;  // backward sets its own
  c.sp = sp_ && !inference_;
  if (cp_.splits() && !inference_) c.cp = &cp_;
  c.norm_grad_scratch = norm_grad_scratch_;
  c.inference = inference_;
  c.pos0 = pos0_;
  c.dropout_key = dropout_keys_[slot];
  c.dropout = c.dropout_key ? float(config().dropout) : 0.0f;
  c.acts = acts;
  c.scratch = scratch_.data();
  return c;
}

// Vocab-parallel softmax + cross-entropy: only the per-row max, exp-sum and target logit cross
// the tensor-parallel group, never the logits.
double StageExecutor::cross_entropy(int slot, int64_t BT,
                                    std::optional<float> backward_loss_scale) {
  const SlotViews& s = views_[slot];
  const VocabSlice vocab = def_->vocab();
  // The target logits right after the BT sums, so that one all-reduce carries both.
  const DPtr target_logit = s.sumexp + BT;
  const int32_t* targets = targets_[slot].data();
  if (backward_loss_scale && tp_.size() == 1) {
    // The mean over B*T tokens, as backward() weighs it.
    k_.crossentropy_stats_and_backward(s.rowmax, s.sumexp, target_logit, s.logits, targets,
                                       *backward_loss_scale / float(BT), BT, vocab);
    loss_state_[slot] = {LossState::gradients, *backward_loss_scale};
  } else {
    k_.crossentropy_stats(s.rowmax, s.sumexp, target_logit, s.logits, targets, BT, vocab);
    loss_state_[slot] = {LossState::stats};
  }
  if (tp_.size() > 1) {
    // Each rank's sums are over its own slice's max: rebased on the group's before adding.
    const DPtr group_max = s.rowmax + BT;
    k_.convert(group_max, s.rowmax, BT, 0);
    tp_.row_max(group_max, BT);
    k_.crossentropy_rebase(s.rowmax, s.sumexp, group_max, BT);
    tp_.row_sum(s.sumexp, 2 * BT);
  }
  return k_.crossentropy_loss(s.losses, s.rowmax, s.sumexp, target_logit, BT);
}

void StageExecutor::run_layers_forward(int slot, int B, int T, bool inference, int pos0) {
  inference_ = inference;
  pos0_ = pos0;
  const SlotViews& v = views_[slot];
  const ModelShard& sh = shard();
  DPtr x = v.input;
  const int tail = int(units_.size()) - 1;  // the final norm and head (last stage)
  if (sh.first_stage()) {
    def_->embed_forward(open_params(call(slot, B, T, nullptr), 0, 1), x, tokens_[slot].data());
    close_params(0);
  }
  for (int l = sh.first_layer; l < sh.end_layer; l++) {
    const int local = l - sh.first_layer;
    for (auto& h : layer_hooks_)
      if (h.before_forward) h.before_forward(slot, l);
    const DPtr* acts = inference ? inference_layers_[local].data() : v.layers[local].data();
    def_->layer_forward(open_params(call(slot, B, T, acts), block_unit(local), 1), l, x,
                        v.outputs[local]);
    close_params(block_unit(local));
    for (auto& h : layer_hooks_)
      if (h.after_forward) h.after_forward(slot, l);
    x = v.outputs[local];
  }
  if (sh.last_stage()) {
    // A backward follows, from the head back: the next unit needed is the last block's.
    def_->head_forward(open_params(call(slot, B, T, v.head.data()), tail, -1), x, v.logits);
    close_params(tail);
  }
  inference_ = false;
  pos0_ = 0;
}

double StageExecutor::run_forward(int slot, const int32_t* tokens, const int32_t* targets, int B,
                                  int T, std::optional<float> backward_loss_scale) {
  if (slot < 0 || slot >= slots_) throw std::out_of_range("activation slot out of range");
  if (B > max_B_ || T > max_T_) throw std::invalid_argument("batch larger than planned");
  check_splits(T, cp_);
  if (shard().first_stage()) take_chunks(tokens, tokens_[slot].data(), B, T);
  T = local_T(T);  // from here on, this rank's tokens of each sequence
  if (sp_ && int64_t(B) * T % tp_.size())
    throw std::invalid_argument(
        "sequence parallelism splits the B x T rows over tp: " + std::to_string(B) + " x " +
        std::to_string(T) + " is not a multiple of tp = " + std::to_string(tp_.size()));
  B_ = B;
  T_ = T;
  const int64_t BT = int64_t(B) * T;
  loss_state_[slot] = {};
  dropout_keys_[slot] = 0;
  if (training_ && targets && config().dropout > 0) {
    dropout_keys_[slot] = mix64(step_key_ ^ mix64(uint64_t(next_micro_))) | 1;  // never 0
    next_micro_ += micro_stride_;
  }
  run_layers_forward(slot, B, T, false, 0);
  if (!shard().last_stage() || !targets) return 0.0;
  take_chunks(targets, targets_[slot].data(), B, T * cp_.size());
  return cross_entropy(slot, BT, backward_loss_scale);
}

void StageExecutor::infer(const int32_t* tokens, int T, int pos0) {
  if (pos0 < 0 || pos0 + T > max_T_)
    throw std::invalid_argument("inference past the planned context");
  if (T > inference_rows()) throw std::invalid_argument("more tokens than infer() takes at once");
  if (shard().first_stage()) std::copy(tokens, tokens + T, tokens_[0].begin());
  loss_state_[0] = {};
  dropout_keys_[0] = 0;
  run_layers_forward(0, 1, T, true, pos0);
}

void StageExecutor::take_chunks(const int32_t* whole, int32_t* mine, int B, int T) const {
  if (!cp_.splits()) return void(std::copy(whole, whole + int64_t(B) * T, mine));
  const int local = local_T(T);
  const TokenChunks ch = cp_.chunks(local);
  for (int b = 0; b < B; b++)
    for (int t = 0; t < local; t++)
      mine[int64_t(b) * local + t] = whole[int64_t(b) * T + ch.position(t)];
}

LayerCall StageExecutor::open_params(LayerCall c, int u, int direction) const {
  if (!windowed_params_) return c;
  if (!param_windows_) throw std::logic_error("windowed parameters without windows");
  if (!units_[u].held) c.params = {param_windows_->open(u), units_[u].begin, units_[u].end};
  for (int next = u + direction; next >= 0 && next < int(units_.size()); next += direction)
    if (!units_[next].held) {
      param_windows_->prefetch(next);
      break;
    }
  return c;
}

void StageExecutor::close_params(int u) const {
  if (windowed_params_ && !units_[u].held) param_windows_->close(u);
}

LayerCall StageExecutor::open_unit(LayerCall c, int u) const {
  if (!windowed_ || units_[u].held) return c;
  if (!windows_) throw std::logic_error("windowed gradients without windows");
  c.grads = {windows_->open(u), units_[u].begin, units_[u].end};
  return c;
}

void StageExecutor::close_unit(int u, int layers_left) const {
  if (windowed_ && !units_[u].held) windows_->close(u, layers_left);
}

void StageExecutor::backward(int slot, float loss_scale) {
  const int B = B_, T = T_;
  const int64_t BT = int64_t(B) * T;
  const SlotViews& v = views_.at(slot);
  const ModelShard& sh = shard();
  // Reports the gradients finished so far; called between kernels as well (with the same
  // frontier) so that collectives already in flight are driven on while backward runs.
  const int first = sh.first_layer, end = sh.end_layer;
  int64_t frontier = table().total;
  int layers_left = end - first;
  const std::function<void()> progress = [&] {
    if (grads_ready_) grads_ready_(frontier, layers_left);
    if (param_windows_) param_windows_->progress();
  };
  auto with_progress = [&](LayerCall c) {
    c.progress = &progress;
    return c;
  };

  const DPtr x_last = output(slot);
  if (sh.last_stage()) {
    const LossState state = std::exchange(loss_state_[slot], {});
    if (state.left == LossState::nothing)
      throw std::logic_error("backward() needs a forward() with targets");
    if (state.left == LossState::gradients && state.scale != loss_scale)
      throw std::logic_error("backward()'s loss scale is not its training_forward()'s");
    // The mean over B*T tokens: each token's loss has weight loss_scale / (B*T).
    if (state.left == LossState::stats)  // the logits become gradients
      k_.crossentropy_backward(v.logits, v.rowmax, v.sumexp, targets_[slot].data(),
                               loss_scale / float(BT), BT, def_->vocab());
    const int tail = int(units_.size()) - 1;  // the final norm and head
    const LayerCall c = open_params(with_progress(call(slot, B, T, v.head.data())), tail, -1);
    def_->head_backward(open_unit(c, tail), x_last, v.logits, d_res_);
    close_params(tail);
    close_unit(tail, end - first);
    frontier = head_frontier_;
    progress();
  }  // else d_res holds the output's gradient, received from the next stage
  for (int l = end - 1; l >= first; l--) {
    const int local = l - first;
    layers_left = local;  // this one has started
    for (auto& h : layer_hooks_)
      if (h.before_backward) h.before_backward(slot, l);
    const DPtr x = l == first ? v.input : v.outputs[local - 1];
    const int unit = block_unit(local);
    const LayerCall c =
        open_params(with_progress(call(slot, B, T, v.layers[local].data())), unit, -1);
    if (recomputed(local)) recompute(c, local, x);  // driving collectives in flight, as backward
    def_->layer_backward(open_unit(c, unit), l, x, d_res_);
    close_params(unit);
    close_unit(unit, local);
    frontier = layer_frontier_[local];
    progress();
    for (auto& h : layer_hooks_)
      if (h.after_backward) h.after_backward(slot, l);
  }
  if (sh.first_stage()) {
    def_->embed_backward(open_unit(open_params(call(slot, B, T, nullptr), 0, -1), 0), d_res_,
                         tokens_[slot].data());
    close_params(0);
    close_unit(0, 0);
  }
}

void StageExecutor::recompute(const LayerCall& c, int local, DPtr x) {
  const int l = shard().first_layer + local;
  if (recompute_ == Recompute::full)
    def_->layer_forward(c, l, x, recompute_out_);
  else
    def_->layer_recompute(c, l);
}

}  // namespace trainer
