#pragma once
// A pipeline schedule is data: the list of actions one stage performs for one optimizer step.
// 1F1B (PipeDream-Flush, as in Megatron): stage s of S first runs min(S - s - 1, M) warm-up
// forwards, then alternates one forward and one backward until every micro-batch has gone
// forward, then drains the remaining backwards. At most S - s activations are alive on stage s,
// instead of M with GPipe. With pp = 1 it is forward, backward, forward, backward, ...
#include <string>
#include <vector>

namespace trainer {

struct PipeAction {
  enum Kind { forward, backward } kind;
  int micro;      // micro-batch index
  int recv = -1;  // stage to receive the input (activation or its gradient) from, -1 = none
  int send = -1;  // stage to send the output to, -1 = none

  bool operator==(const PipeAction&) const = default;
};

std::vector<PipeAction> one_f_one_b(int stage, int stages, int micro_batches);

// The idle fraction of the slowest stage's schedule when stage s's forward of a micro-batch
// takes stage_costs[s] and its backward twice that (the usual cost model): simulated over all
// stages, respecting every send/receive dependency. For 1F1B over equal stages this is
// (S - 1) / (M + S - 1); with unequal ones the fill and drain are the other stages' time.
double pipeline_bubble(const std::vector<double>& stage_costs, int micro_batches);
// Over `stages` equal stages.
double pipeline_bubble(int stages, int micro_batches);

std::string to_string(const PipeAction& a);

}  // namespace trainer
