#pragma once
// The architectures behind make_model_definition (model/model_definition.h).
#include <memory>
#include <vector>

#include "model/model_definition.h"

namespace trainer {

ParamTable gpt2_param_table(const ModelConfig& cfg, const ModelShard& shard,
                            int64_t total_multiple);
std::unique_ptr<ModelDefinition> make_gpt2(const ModelConfig& cfg, const ModelShard& shard,
                                           int64_t total_multiple);

ParamTable llama_param_table(const ModelConfig& cfg, const ModelShard& shard,
                             int64_t total_multiple);
std::unique_ptr<ModelDefinition> make_llama(const ModelConfig& cfg, const ModelShard& shard,
                                            int64_t total_multiple);
// Llama's rotary frequencies (head_size / 2 of them, Llama 3.1 scaling applied) and the table
// of (cos, sin) of position x frequency for positions [0, positions) that the RoPE kernels read.
std::vector<double> rope_frequencies(const ModelConfig& cfg);
std::vector<float> rope_table(const ModelConfig& cfg, int positions);

}  // namespace trainer
