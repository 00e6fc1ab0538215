#pragma once
// Blending training sources ([[data.sources]], each with a weight): which source each global
// sample comes from. As Megatron's blended dataset does, sample i goes to the source that is
// furthest behind its share, argmax_s (w_s * (i + 1) - n_s(i)) with n_s(i) the samples source
// s gave before i (ties to the lower index; in 32-bit fixed point, exact on every machine). The mix
// is a pure function of the sample index, so every layout and every resume reads the same samples,
// and after n samples each source has given w_s * n of them to within one. Each source then reads
// its own sample index through its own permutation (SampleOrder), so the sources' epochs are
// independent.
//
// When a resumed run brings new weights, the new mix starts at the resume sample with each
// source where it stood (`start`, `base`): no source repeats or skips a sample.
#include <cstdint>
#include <string>
#include <vector>

namespace trainer {

struct BlendPlan {
  std::vector<double> weights;  // > 0, summing to 1
  int64_t start = 0;            // the global sample from which these weights apply
  std::vector<int64_t> base;    // each source's samples before `start`

  // One source, or the weights (any positive scale) from the first sample on.
  static BlendPlan fresh(const std::vector<double>& weights);
  bool operator==(const BlendPlan&) const = default;
};

class BlendOrder {
 public:
  // The order from the plan's start (implicit: a plan is the order that starts at its start).
  BlendOrder(BlendPlan plan);  // NOLINT(google-explicit-constructor)
  // The order with a known point: each source's position at global sample `sample` (a
  // checkpoint's data_source_samples), so that samples from there on need no replay from the
  // plan's start. The positions must be the plan's own (their excess over the base sums to
  // sample - start; else std::logic_error).
  BlendOrder(BlendPlan plan, int64_t sample, const std::vector<int64_t>& positions);

  struct Pick {
    int source;
    int64_t index;  // the source's own sample index
  };
  // Global sample `sample` (>= the plan's start). Cheap when samples are asked for in increasing
  // order, as the loader and the checkpoints do; an earlier one replays from the plan's start
  // (O(samples x sources)).
  Pick at(int64_t sample);
  // The samples each source gave before global sample `sample`.
  std::vector<int64_t> positions(int64_t sample);

  const BlendPlan& plan() const { return plan_; }

 private:
  void seek(int64_t sample);  // counts_ := each source's samples in [start, sample)
  int next_source() const;    // the source of sample cursor_

  BlendPlan plan_;
  std::vector<int64_t> fixed_;  // the weights x 2^32, rounded: integer arithmetic, so the same
                                // choices on every machine and compiler (no FMA contraction)
  int64_t cursor_;
  std::vector<int64_t> counts_;
};

// "0.5, 0.3, 0.2": weights in messages.
std::string format_weights(const std::vector<double>& weights);

}  // namespace trainer
