#pragma once
// Every parameter is a named view into one flat buffer: a logical name (`h.3.attn.qkv.weight`),
// its full logical shape, and where it lives. Gradients and optimizer states use the same
// offsets in their own flat buffers, so clipping, the optimizer, checkpoint I/O and (later)
// bucketed reduction and ZeRO sharding are loops over spans of this table.
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/gpt_config.h"

namespace trainer {

enum class ParamKind { matrix, embedding, bias, norm };

struct ParamInfo {
  std::string name;
  std::vector<int64_t> shape;  // full logical shape, as stored in checkpoints
  int64_t offset = 0;          // in elements, into the flat buffers
  int64_t numel = 0;           // elements allocated; >= product of shape (padded vocab rows)
  ParamKind kind = ParamKind::matrix;
  int layer = -1;      // block index, -1 for embeddings and the final norm
  float init_std = 0;  // normal(0, init_std) for matrices and embeddings

  int64_t logical_numel() const;
};

struct ParamTable {
  std::vector<ParamInfo> params;
  int64_t total = 0;                              // elements in each flat buffer
  std::unordered_map<std::string, size_t> index;  // name -> position in params

  const ParamInfo& at(const std::string& name) const;
};

// The GPT-2 parameter layout in forward order. Weights are (out_features, in_features).
ParamTable gpt2_param_table(const GPTConfig& cfg);

// Parameters in the model proper, as PaLM/nanoGPT count them for FLOPs: without the position
// embedding, the tied head counted once, the vocab unpadded.
int64_t gpt2_flop_params(const GPTConfig& cfg);

}  // namespace trainer
