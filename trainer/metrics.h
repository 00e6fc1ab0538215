#pragma once
// One line per step on stdout and the same fields as one JSON object per line in
// <out_dir>/metrics.jsonl.
#include <cstdint>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

namespace trainer {

struct StepStats {
  int64_t step = 0, total_steps = 0;
  double time = 0;                  // wall clock when the step ended, seconds since the Unix epoch
  int64_t tokens = 0;               // tokens trained on so far, this step's included
  int64_t batch = 0;                // sequences in this step's global batch
  double elapsed_s = 0, eta_s = 0;  // since this process started training; the rest, estimated
  double loss = 0, lr = 0, grad_norm = 0;
  bool skipped = false;         // non-finite loss or gradient norm: no update applied
  double loss_scale = 1;        // the (fp16) loss scale the step used
  bool stop = false;            // a stop signal arrived on some rank: checkpoint and exit after it
  bool checkpoint_due = false;  // [checkpoint] every_minutes has passed (rank 0's clock)
  std::string bad;              // why the step guard skipped it ("" if it did not)
  bool rollback = false;        // too many bad steps in a row: back to the last checkpoint
  // The loader's queues when the step began: micro-batches assembled (at most prefetch) and
  // rows read ahead of them (at most prefetch x micro_batch).
  int data_queue = 0, data_rows = 0;
  // Seconds per phase: waiting for data, forward, backward, norm + optimizer, and the total.
  double data_s = 0, forward_s = 0, backward_s = 0, optimizer_s = 0, total_s = 0;
  bool phases_timed = true;  // forward_s and backward_s measured (else not reported)
  // Model FLOP/s over the world's peak (the sum of every rank's kernels' peak_flops).
  double tokens_per_s = 0, mfu = 0, peak_flops = 0;
  // Communication: time blocked on collectives that compute did not hide (data-parallel buckets
  // still in flight after backward, tensor-parallel all-reduces, the tied-embedding sync, ZeRO's
  // gather), bytes this rank sent, and the time its pipeline stage waited for its neighbours
  // (the measured bubble, with the transfers) as seconds and as a fraction of the step.
  double comm_s = 0, pipe_wait_s = 0, bubble = 0;
  // Page faults this rank took in the step: once warm, none or a few (a new data page); thousands
  // a step are memory handed back to the system and faulted in again.
  int64_t page_faults = 0;
  int64_t bytes_sent = 0;
  std::map<std::string, int64_t> bytes_by_group;  // of bytes_sent: dp, tp, pp, emb, intra, inter
  // Data-parallel buckets: how many, how many started while layers' backward was still to run
  // (overlap), and how many layers were still to run when the first one started (-1: after).
  int buckets = 0, buckets_overlapped = 0, first_bucket_layers_left = -1;
  // ZeRO-3 (else -1): the units' parameters gathered in the step, the units the executor found
  // gathered or on their way when it needed them (prefetched, or kept from the forward), and
  // those it had to wait for from the start.
  int64_t param_gathers = -1, param_ready = -1, param_waited = -1;
  // Optimizer offload (else -1): the segments updated on the host, the host's update time and
  // the time the step waited for it (what the gradient and weight copies did not hide).
  int64_t offload_segments = -1;
  double offload_update_s = 0, offload_wait_s = 0;
  // Gradient compression: what the compressed buckets would have sent as plain fp32, and the
  // time spent in them (encode, exchange, decode).
  int64_t bytes_uncompressed = 0;
  double compress_s = 0;
  bool outer_step = false;  // [comm.outer]: the nodes met after this step
};

// Data loading on the critical path: counts the consecutive steps whose data wait exceeds
// `share` of the step, and says when a run of `steps` of them is complete (then counts afresh,
// so a run starved throughout hears about it every `steps` steps, not every step).
class DataWaitWatch {
 public:
  explicit DataWaitWatch(double share = 0.05, int steps = 20) : share_(share), steps_(steps) {}
  bool starved(double data_s, double total_s) {
    run_ = data_s > share_ * total_s ? run_ + 1 : 0;
    if (run_ < steps_) return false;
    run_ = 0;
    return true;
  }
  double share() const { return share_; }
  int steps() const { return steps_; }

 private:
  double share_;
  int steps_, run_ = 0;
};

class MetricsLog {
 public:
  // append: a resumed run continues the file instead of starting it again.
  MetricsLog(const std::string& path, bool append);
  void step(const StepStats& s, bool print);
  void event(const nlohmann::json& record);  // validation, samples, checkpoints

 private:
  std::ofstream out_;
};

}  // namespace trainer
