#pragma once
// Every parameter is a named view into one flat buffer: a logical name (`h.3.attn.qkv.weight`),
// its full logical shape, and where this rank's part of it lives. Gradients and optimizer states
// use the same offsets in their own flat buffers, so clipping, the optimizer, checkpoint I/O,
// bucketed reduction and ZeRO sharding are loops over spans of this table.
//
// A table describes one model shard: the layers of one pipeline stage and, for tensor
// parallelism, one rank's slice of each matrix (Megatron: QKV and MLP up-projection split by
// output rows, the two projections back into the residual stream split by input columns, the
// embedding split by vocabulary rows; norms and the biases added after a reduction replicated).
#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/gpt_config.h"

namespace trainer {

enum class ParamKind { matrix, embedding, bias, norm };

// Which part of the model one rank holds.
struct ModelShard {
  int tp_rank = 0, tp_size = 1;
  int stage = 0, stages = 1;
  int first_layer = 0, end_layer = 0;  // this stage's blocks: [first_layer, end_layer)

  // The whole model on one rank.
  static ModelShard whole(const GPTConfig& cfg) { return make(cfg, 0, 1, 0, 1); }
  // Stage s of S holds the contiguous blocks [bounds[s], bounds[s + 1]) of pipeline_partition.
  static ModelShard make(const GPTConfig& cfg, int tp_rank, int tp_size, int stage, int stages);
  bool first_stage() const { return stage == 0; }          // holds the embeddings
  bool last_stage() const { return stage == stages - 1; }  // holds ln_f, the head and the loss
};

// Where the pipeline stages' contiguous ranges of blocks start (and the layer count, last):
// every stage gets at least one block, and the largest stage cost (blocks, plus the LM head on
// the last stage) is as small as it can be, so that a big vocabulary's head does not leave the
// last stage the bottleneck of the pipeline.
std::vector<int> pipeline_partition(const GPTConfig& cfg, int stages);

struct ParamInfo {
  std::string name;
  std::vector<int64_t> shape;  // full logical shape, as stored in checkpoints
  int64_t offset = 0;          // in elements, into the flat buffers
  int64_t numel = 0;           // elements allocated; >= local_numel() (padded vocab rows)
  ParamKind kind = ParamKind::matrix;
  int layer = -1;      // block index, -1 for embeddings and the final norm
  float init_std = 0;  // normal(0, init_std) for matrices and embeddings
  // Tensor-parallel slicing: split_dim is sliced across the tp ranks (-1: replicated). The
  // dimension, padded to split_extent, is made of split_parts equal parts (q, k and v for the
  // QKV projection) and each part is cut into tp_size pieces; a rank holds its piece of each.
  int split_dim = -1, split_parts = 1;
  int64_t split_extent = 0;
  int tp_rank = 0, tp_size = 1;
  // The copy of the tied embedding on the last pipeline stage (the first stage's is the owner).
  bool tied_copy = false;

  int64_t logical_numel() const;             // of the full tensor
  std::vector<int64_t> local_shape() const;  // this rank's real elements (no padding)
  int64_t local_numel() const;
  // The index into the full logical tensor (row-major) of this rank's local element i.
  int64_t logical_index(int64_t i) const;
  // Calls f(local, logical, n) for the runs of local elements [begin, end) whose logical indices
  // are consecutive, in order (logical order is local order): one run for a replicated
  // parameter, one per piece and row for a split one.
  template <class F>
  void for_each_run(int64_t begin, int64_t end, F&& f) const {
    for (int64_t i = begin; i < end;) {
      const int64_t n = std::min(contiguous_from(i), end - i);
      f(i, logical_index(i), n);
      i += n;
    }
  }
  // How many local elements from i on have consecutive logical indices.
  int64_t contiguous_from(int64_t i) const;
  bool replicated() const { return split_dim < 0; }
  // Whether this rank's copy counts for sums over the model (gradient norm, checkpoint
  // gathering): a replicated parameter is counted on tp rank 0, a tied copy not at all.
  bool owned() const { return !tied_copy && (split_dim >= 0 || tp_rank == 0); }
};

struct ParamTable {
  std::vector<ParamInfo> params;
  int64_t total = 0;                              // elements in each flat buffer
  std::unordered_map<std::string, size_t> index;  // name -> position in params

  const ParamInfo& at(const std::string& name) const;
  const ParamInfo* find(const std::string& name) const;  // null if not in this shard
};

// The GPT-2 parameter layout of one shard, in forward order. Weights are (out_features,
// in_features). `total_multiple` pads the flat buffers' length (a multiple of 16 elements, for
// 64-byte aligned views, or of 16 x dp for even ZeRO shards).
ParamTable gpt2_param_table(const GPTConfig& cfg, const ModelShard& shard,
                            int64_t total_multiple = 16);
inline ParamTable gpt2_param_table(const GPTConfig& cfg) {
  return gpt2_param_table(cfg, ModelShard::whole(cfg));
}

// The weights that take part in matrix multiplies (the blocks' four matrices and the tied
// head, its vocab unpadded): 2 FLOPs each per token forward, 4 backward.
int64_t gpt2_matmul_params(const GPTConfig& cfg);

// Model FLOPs per token trained (forward and backward), the MFU numerator: 6 per matmul weight
// and 6 L C T for causal attention (QK^T and AV over the lower triangle; PaLM and nanoGPT count
// the full square, 12 L C T, which no causal kernel executes). Every FLOP counted here is
// executed by a matmul or attention call, which is what bounds MFU by 100% on the CPU
// (kernels/flop_meter.h).
double gpt2_flops_per_token(const GPTConfig& cfg);

}  // namespace trainer
