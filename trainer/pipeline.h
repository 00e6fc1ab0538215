#pragma once
// Runs one model stage through a step: the 1F1B action list of pipeline_schedule.h, executed
// with activations and their gradients passed to the neighbouring stages by send/recv. With
// one stage it is plain gradient accumulation: forward, backward, forward, backward, ...
#include <functional>
#include <vector>

#include "comm/communicator.h"
#include "io/dataset.h"
#include "model/stage_executor.h"
#include "trainer/pipeline_schedule.h"

namespace trainer {

struct PipeTimes {
  double forward_s = 0, backward_s = 0;
  bool timed = true;  // false: an asynchronous device, not waited for (the times are launches)
};

class Pipeline {
 public:
  // Activation slots the stage needs: at most stages - stage micro-batches are in flight.
  static int slots(int stage, int stages, int micro_batches);

  // pp: the pipeline group (stage = rank); tp: the tensor-parallel group, cp the
  // context-parallel one, or null.
  // micro_batches: the most of any step (its activation slots).
  // time_phases: on an asynchronous device, wait after every forward and backward so that
  // their times are the device's (a host wait per micro-batch; otherwise none in the step).
  Pipeline(StageExecutor& model, Communicator& pp, Communicator* tp, Communicator* cp,
           int micro_batches, int B, int T, bool time_phases = false);

  // One step's forwards and backwards over `micro_batches` micro-batches (at most the
  // constructor's; a batch ramp changes them). next_batch() is called once per micro-batch, in
  // order; before_last_backward() just before this stage's last backward
  // (whose gradients are final for the step; ZeRO-2 reduces every backward's anyway). Returns the
  // sum of the micro-batches' mean losses on the last stage, 0 elsewhere.
  double step(int micro_batches, const std::function<const Batch&()>& next_batch, float loss_scale,
              const std::function<void()>& before_last_backward, PipeTimes& times);

  // Forward only: the mean loss of (tokens, targets), on every stage (and context-parallel rank).
  double evaluate(const int32_t* tokens, const int32_t* targets, int B, int T);
  // Forward only: each of the B x T tokens' loss, on every stage (and context-parallel rank).
  std::vector<float> token_losses(const int32_t* tokens, const int32_t* targets, int B, int T);
  // The padded-vocab logits of the token after the T tokens at positions [pos0, pos0 + T), with
  // the key/value cache of the earlier ones (StageExecutor::infer), on every rank of the
  // pipeline and tensor-parallel groups (a sampler's input).
  void next_logits(const int32_t* tokens, int T, int pos0, std::vector<float>& out);

  const std::vector<PipeAction>& actions() const { return actions_; }

 private:
  StageExecutor& model_;
  Communicator& pp_;
  Communicator *tp_, *cp_;
  int micro_batches_, max_micro_batches_, B_, T_, slots_;
  bool time_phases_;
  std::vector<PipeAction> actions_;
  std::vector<Request> output_sends_;  // per slot
  Request grad_send_;
};

}  // namespace trainer
