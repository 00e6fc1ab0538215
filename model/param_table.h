#pragma once
// Every parameter is a named view into one flat buffer: a logical name (`h.3.attn.qkv.weight`),
// its full logical shape, and where this rank's part of it lives. Gradients and optimizer states
// use the same offsets in their own flat buffers (ZeRO-2's gradients: in windows of one gradient
// unit at a time, model/grad_units.h), so clipping, the optimizer, checkpoint I/O, bucketed
// reduction and ZeRO sharding are loops over spans of this table.
//
// A table describes one model shard: the layers of one pipeline stage and, for tensor
// parallelism, one rank's slice of each matrix (Megatron: QKV and MLP up-projection split by
// output rows, the two projections back into the residual stream split by input columns, the
// embedding split by vocabulary rows; norms and the biases added after a reduction replicated).
// The model definitions (model/gpt2.cpp, model/llama.cpp) build the tables.
#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/model_config.h"

namespace trainer {

enum class ParamKind { matrix, embedding, bias, norm };

// Which part of the model one rank holds.
struct ModelShard {
  int tp_rank = 0, tp_size = 1;
  int stage = 0, stages = 1;
  int first_layer = 0, end_layer = 0;  // this stage's blocks: [first_layer, end_layer)
  // Sequence parallelism (model/tensor_parallel.h): between the tensor-parallel regions, each
  // of the tp_size ranks holds 1/tp_size of the residual stream's rows.
  bool sequence_parallel = false;
  // Context parallelism (model/context_parallel.h): each sequence's tokens split over cp_size
  // ranks; a layer sees this rank's T / cp_size of them.
  int cp_size = 1;

  // The whole model on one rank.
  static ModelShard whole(const ModelConfig& cfg) { return make(cfg, 0, 1, 0, 1); }
  // Stage s of S holds the contiguous blocks [bounds[s], bounds[s + 1]) of pipeline_partition.
  static ModelShard make(const ModelConfig& cfg, int tp_rank, int tp_size, int stage, int stages);
  bool first_stage() const { return stage == 0; }          // holds the embeddings
  bool last_stage() const { return stage == stages - 1; }  // holds ln_f, the head and the loss
};

// Where the pipeline stages' contiguous ranges of blocks start (and the layer count, last):
// every stage gets at least one block, and the largest stage cost (blocks, plus the LM head on
// the last stage) is as small as it can be, so that a big vocabulary's head does not leave the
// last stage the bottleneck of the pipeline.
std::vector<int> pipeline_partition(const ModelConfig& cfg, int stages);
// Each stage's share of the model's cost per token under that partition (at block_scale 1 they
// sum to 1; the blocks' cost is scaled by block_scale where recomputation runs their forward
// again).
std::vector<double> pipeline_stage_shares(const ModelConfig& cfg, int stages, double block_scale);
// The slowest stage's cost over the mean's (1: balanced): a pipeline runs at its slowest
// stage's pace.
double pipeline_imbalance(const ModelConfig& cfg, int stages);

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
  // The token embedding that the LM head shares (tie_embeddings), on the first and the last
  // stage; the last stage's is the copy (the first stage's is the owner).
  bool tied = false;
  bool tied_copy = false;

  int64_t logical_numel() const;  // of the full tensor
  // Whether other ranks hold copies of these elements that must stay equal: tensor-parallel
  // replicas (norms, biases), a tied embedding's two ends in a pipeline.
  bool has_copies(int stages) const {
    return (split_dim < 0 && tp_size > 1) || (tied && stages > 1);
  }
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
  const ParamInfo* tied() const;  // the tied embedding, if this shard holds it
  // The first parameter of block `layer` (-1 for none in this shard).
  int64_t layer_offset(int layer) const;
};

// Builds a table in forward order. Every view starts 64-byte aligned, except one added with
// pack = true to its predecessor: it starts right where that one ends, so that the two (Llama's
// q, k and v projections; its gate and up projections) form one matrix for one GEMM.
struct TpSplit {  // the tensor-parallel split (ParamInfo::split_dim ...)
  int dim = -1, parts = 1;
  int64_t extent = 0;  // 0: the dimension's length
};
inline constexpr TpSplit kSplitRows{0}, kSplitCols{1};

class ParamTableBuilder {
 public:
  using Split = TpSplit;
  // Each block's first view, and the first after the blocks, start on a multiple of
  // unit_multiple elements (16 x dp in training): ZeRO shards gradient units (model/grad_units.h)
  // with no piece straddling two of them.
  explicit ParamTableBuilder(const ModelShard& shard, int64_t unit_multiple = 16)
      : shard_(shard), unit_multiple_(unit_multiple) {}
  ParamInfo& add(std::string name, std::vector<int64_t> shape, ParamKind kind, int layer,
                 float init_std, Split split = {}, bool pack = false);
  ParamTable finish(int64_t total_multiple);

 private:
  ModelShard shard_;
  int64_t unit_multiple_;
  ParamTable table_;
  int64_t end_ = 0;  // where the last view ends (before alignment)
};

}  // namespace trainer
