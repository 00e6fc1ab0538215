#pragma once
// What one rank will hold, from the plan its buffers are allocated by: printed at start-up,
// checked against the memory available before anything is allocated, and compared with the
// measured peak at the end (the planner's accounting too).
#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/parallel_dims.h"
#include "io/config.h"
#include "kernels/kernels.h"
#include "model/stage_executor.h"

namespace trainer {

// What one rank will hold, in bytes, from the same plan the model allocates by: the model's
// buffers, AdamW's fp32 moments (and fp32 master weights for 16-bit models) over the elements
// this rank updates (all of its shard's, or its ZeRO piece plus that piece's gradients), and
// the host copy of them a checkpoint takes.
struct MemoryBudget {
  StageExecutor::Memory model;
  double optimizer = 0;  // AdamW's moments and (16-bit models) fp32 master weights
  // [memory] offload_optimizer: of the above, AdamW's state (its master weights for any model)
  // in host memory, with the host's two segments of gradients; and the device's staging of a
  // segment's master weights (16-bit models).
  double offloaded = 0, offload_staging = 0;
  double grad_shard = 0;    // ZeRO-1, -2 and -3: the reduced gradients of this rank's piece
  double grad_windows = 0;  // ZeRO-2 and -3: the windows backward writes gradients into
  // The hierarchical all-reduce's node parts of the gradients: each bucket's part summed inside
  // the node before it crosses nodes, 1/node_ranks of the flat buffer (ZeRO-2's windows hold
  // their own).
  double node_grads = 0;
  // ZeRO-3: this rank's pieces of the compute weights (model.params holds only the held
  // units'), and the windows each unit's are gathered into.
  double param_shard = 0, param_windows = 0;
  // The temporaries of the data-parallel reductions in flight, at most: Open MPI's
  // non-blocking reduce-scatter and all-reduce allocate one as large as the buffer they reduce,
  // and the buckets of a flat buffer may all be in flight at once (finish() starts every one
  // backward has not); under ZeRO-2 one per window and the held units'. NCCL's buffers are its
  // own, not counted.
  double collectives = 0;
  double snapshot = 0;
  // Of `snapshot`, the weights' and moments' copy: what start-up touches for background
  // checkpoints (the residuals, momentum and outer state join it at a checkpoint).
  double snapshot_weights = 0;
  // [comm.outer]: the outer weights and momentum of this rank's elements, the int8 residual, and
  // an outer step's pseudo-gradient. Host memory.
  double outer = 0;
  // Gradient compression's state, of this rank's part of the buffer (all of it, or under the
  // hierarchical all-reduce 1/node_ranks): each compressor's residual and its own message
  // decoded, 1-bit Adam's or DGC's momentum, and one bucket's all-gathered messages (int8, onebit,
  // topk). Host memory (a checkpoint's copy of the residuals and momentum is in `snapshot`).
  double compression = 0;
  // The process's own, beyond the buffers above: thread stacks, the allocator's slack, the
  // libraries' working sets (OpenBLAS's, MPI's, HDF5's while a checkpoint is written, its
  // metadata cache capped at 4 MB). A constant, from measurement: 11 to 30 MB a rank over the
  // layouts of tests/test_plan_against_runs.cpp. Host memory.
  static constexpr double kProcessBytes = 20 << 20;
  double process = kProcessBytes;
  double total() const {
    return double(model.total()) + optimizer + grad_shard + grad_windows + node_grads +
           param_shard + param_windows + collectives + snapshot + offload_staging + outer +
           compression + process;
  }
  // What a GPU holds: all but the host's (the offloaded state, the checkpoint's copy, the
  // process's own).
  double device() const { return total() - offloaded - snapshot - outer - compression - process; }
};

// node_ranks: the data-parallel ranks on this rank's node under the hierarchical all-reduce or
// the outer steps (0 otherwise), for the gradients summed inside the node (ZeRO-2: its windows'
// node parts), compression's part of the buffer and, with outer steps, ZeRO's shards.
MemoryBudget memory_budget(const Config& cfg, const ParallelDims& dims, const RankCoords& me,
                           int node_ranks);
// That node_ranks for world rank `rank`, each rank's node given by `node` (as make_groups finds
// them: the members of its data-parallel group on its node).
int node_ranks(const Config& cfg, const ParallelDims& dims, int rank,
               const std::function<int(int)>& node);

// This process's peak resident memory (VmHWM), in MB; 0 where /proc does not tell.
double peak_rss_mb();

// This process's resident memory now (VmRSS) and the file-backed part of it (RssFile: mapped
// libraries and token files, page cache rather than memory the run allocates), in MB.
struct ResidentMemory {
  double total_mb = 0, file_mb = 0;
};
ResidentMemory resident_memory();

// The plan against the measurement, on every rank: what the budget above says the rank holds,
// and what it held at its peak. On the CPU, the peak resident memory above `before_model`
// (taken just before the model is allocated), less the file pages mapped since (the token
// files the loaders read); on a GPU the allocator's peak. The checkpoint's copy counts as far as
// the run allocated it (SnapshotCopy). Rank 0 receives every rank's pair (the others: none).
struct PlannedAndMeasured {
  double planned_mb = 0, measured_mb = 0;
  double bound_mb = 0;  // of the plan, what is a bound rather than a count (MPI's temporaries)
};
struct Run;
// How much of the checkpoint's host copy a run allocated: none, its weights and moments (touched
// at start-up for background checkpoints), or all of it (a checkpoint was taken).
enum class SnapshotCopy { none, touched, taken };
std::vector<PlannedAndMeasured> planned_and_measured(Run& run, ResidentMemory before_model,
                                                     SnapshotCopy copy);
// At the end of training (collective): rank 0 (with the run's `log`; null elsewhere) prints and
// logs the peak memory of rank 0 and of the largest rank, and each rank's plan against its
// measurement.
class MetricsLog;
void report_memory(Run& run, ResidentMemory before_model, SnapshotCopy copy, MetricsLog* log);

// A run that cannot fit is refused before anything is allocated (allocating first grows for
// tens of seconds and then fails somewhere): a ConfigError naming `origin`.
void check_memory(const Config& cfg, World& world, Kernels& kernels, const std::string& origin);

}  // namespace trainer
