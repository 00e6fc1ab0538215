#include "trainer/pipeline.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

namespace trainer {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
// Activations and gradients of micro-batch m travel under their own tags.
int forward_tag(int m) {
  return 2 * m;
}
int backward_tag(int m) {
  return 2 * m + 1;
}

}  // namespace

int Pipeline::slots(int stage, int stages, int micro_batches) {
  return std::max(1, std::min(stages - stage, micro_batches));
}

Pipeline::Pipeline(StageExecutor& model, Communicator& pp, Communicator* tp, Communicator* cp,
                   int micro_batches, int B, int T, bool time_phases)
    : model_(model),
      pp_(pp),
      tp_(tp),
      cp_(cp && cp->size() > 1 ? cp : nullptr),
      micro_batches_(micro_batches),
      max_micro_batches_(micro_batches),
      B_(B),
      T_(T),
      slots_(slots(pp.rank(), pp.size(), micro_batches)),
      time_phases_(time_phases || !model.kernels().asynchronous()),
      actions_(one_f_one_b(pp.rank(), pp.size(), micro_batches)),
      output_sends_(slots_) {}

double Pipeline::step(int micro_batches, const std::function<const Batch&()>& next_batch,
                      float loss_scale, const std::function<void()>& before_last_backward,
                      PipeTimes& times) {
  if (micro_batches != micro_batches_) {
    if (micro_batches > max_micro_batches_)
      throw std::logic_error("more micro-batches than the pipeline has activation slots for");
    micro_batches_ = micro_batches;
    actions_ = one_f_one_b(pp_.rank(), pp_.size(), micro_batches);
  }
  const int64_t activation = model_.io_elems(B_, T_);
  double loss = 0;
  times.timed = time_phases_;
  auto phase_done = [&] {  // a GPU's kernels run after the call returns
    if (time_phases_) model_.kernels().synchronize();
  };
  for (const PipeAction& a : actions_) {
    const int slot = a.micro % slots_;
    if (a.kind == PipeAction::forward) {
      const Batch& batch = next_batch();
      output_sends_[slot].wait();  // its buffer is about to be rewritten
      if (a.recv >= 0) pp_.recv(model_.input(slot), activation, a.recv, forward_tag(a.micro));
      const auto t0 = Clock::now();
      loss += model_.training_forward(slot, batch.inputs.data(), batch.targets.data(), B_, T_,
                                      loss_scale);
      phase_done();
      times.forward_s += seconds_since(t0);
      if (a.send >= 0)
        output_sends_[slot] =
            pp_.isend(model_.output(slot), activation, a.send, forward_tag(a.micro));
    } else {
      grad_send_.wait();
      if (a.recv >= 0) pp_.recv(model_.grad_io(), activation, a.recv, backward_tag(a.micro));
      if (a.micro == micro_batches_ - 1) before_last_backward();
      const auto t0 = Clock::now();
      model_.backward(slot, loss_scale);
      phase_done();
      times.backward_s += seconds_since(t0);
      if (a.send >= 0)
        grad_send_ = pp_.isend(model_.grad_io(), activation, a.send, backward_tag(a.micro));
    }
  }
  for (Request& r : output_sends_) r.wait();
  grad_send_.wait();
  return loss;
}

double Pipeline::evaluate(const int32_t* tokens, const int32_t* targets, int B, int T) {
  const int64_t activation = model_.io_elems(B, T);
  const int stage = pp_.rank(), last = pp_.size() - 1;
  if (stage > 0) pp_.recv(model_.input(0), activation, stage - 1, 0);
  double loss = model_.forward(0, tokens, targets, B, T);
  if (stage < last) pp_.send(model_.output(0), activation, stage + 1, 0);
  pp_.broadcast(host_ptr(&loss), 1, last);
  if (cp_) {  // each rank's mean over as many tokens
    cp_->all_reduce(host_ptr(&loss), 1, ReduceOp::sum);
    loss /= cp_->size();
  }
  return loss;
}

std::vector<float> Pipeline::token_losses(const int32_t* tokens, const int32_t* targets, int B,
                                          int T) {
  evaluate(tokens, targets, B, T);
  const int Tl = model_.local_T(T);  // this rank's tokens of each sequence
  std::vector<float> mine(size_t(B) * Tl);
  if (pp_.rank() == pp_.size() - 1)
    model_.kernels().download_f32(mine.data(), model_.losses(0), int64_t(mine.size()));
  pp_.broadcast(host_ptr(mine.data()), int64_t(mine.size()), pp_.size() - 1);
  if (!cp_) return mine;
  // Every context-parallel rank's chunks, put back in their places.
  std::vector<float> all(mine.size() * cp_->size()), losses(size_t(B) * T);
  cp_->all_gather(host_ptr(mine.data()), host_ptr(all.data()), int64_t(mine.size()));
  const ContextParallel& cp = model_.context_parallel();
  for (int r = 0; r < cp_->size(); r++) {
    const TokenChunks ch = cp.chunks_of(r, Tl);
    for (int b = 0; b < B; b++)
      for (int t = 0; t < Tl; t++)
        losses[size_t(b) * T + ch.position(t)] = all[(size_t(r) * B + b) * Tl + t];
  }
  return losses;
}

void Pipeline::next_logits(const int32_t* tokens, int T, int pos0, std::vector<float>& out) {
  const int stage = pp_.rank(), last = pp_.size() - 1;
  const VocabSlice vocab = model_.vocab();
  out.resize(size_t(vocab.width) * (tp_ ? tp_->size() : 1));
  // In chunks of the rows the stream holds (a sequence-parallel stage holds 1/tp of a batch's).
  const int chunk = model_.inference_rows();
  int n = 0;
  for (int at = 0; at < T; at += n) {
    n = std::min(chunk, T - at);
    const int64_t activation = int64_t(n) * model_.config().d_model;
    if (stage > 0) pp_.recv(model_.input(0), activation, stage - 1, 0);
    model_.infer(tokens + at, n, pos0 + at);
    if (stage < last) pp_.send(model_.output(0), activation, stage + 1, 0);
  }
  if (stage == last) {
    std::vector<float> mine(vocab.width);
    model_.kernels().download_f32(  // the logits may be 16-bit
        mine.data(), model_.logits(0) + int64_t(n - 1) * vocab.width, vocab.width);
    if (tp_)
      tp_->all_gather(host_ptr(mine.data()), host_ptr(out.data()), vocab.width);
    else
      out = mine;
  }
  pp_.broadcast(host_ptr(out.data()), int64_t(out.size()), last);
}

}  // namespace trainer
