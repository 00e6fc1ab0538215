#pragma once
// Hugging Face transformers' layouts of the two architectures, for `trainer export --format hf`:
// GPT2LMHeadModel (Conv1D weights stored (in, out), the transpose of ours; biases always) and
// LlamaForCausalLM (q/k/v/o, gate/up/down, and the rows of q and k permuted per head, because
// transformers rotates the halves of each head where Meta's reference, and this trainer, rotate
// interleaved pairs: convert_llama_weights_to_hf.py's permute()).
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "model/model_config.h"

namespace trainer {

struct HfTensor {
  enum class Op { copy, transpose, rope_rows, zeros };
  std::string name;            // transformers' name
  std::vector<int64_t> shape;  // transformers' shape
  std::string ours;            // our parameter it is made from ("" for zeros)
  Op op = Op::copy;
  int heads = 0;  // rope_rows: the heads whose rows are permuted
};

// Every tensor of the transformers model, in its order.
std::vector<HfTensor> hf_tensors(const ModelConfig& m);
// transformers' tensor from ours (`in`: our parameter's values, row-major in our shape).
std::vector<float> hf_tensor_values(const HfTensor& t, const std::vector<float>& in);
// config.json (torch_dtype from dtype: "F32", "BF16", "F16") and generation_config.json.
std::string hf_config_json(const ModelConfig& m, const std::string& dtype = "F32");
std::string hf_generation_config_json(const ModelConfig& m);

// Writes `dir`: model.safetensors (or, above max_shard_bytes, model-0000i-of-0000n.safetensors
// and model.safetensors.index.json), config.json and generation_config.json. `read(name)` gives
// our parameter's full values. dtype: "F32", "BF16" or "F16". Returns the files written.
std::vector<std::string> write_hf(const ModelConfig& m,
                                  const std::function<std::vector<float>(const std::string&)>& read,
                                  const std::string& dir, const std::string& dtype,
                                  const std::map<std::string, std::string>& metadata,
                                  int64_t max_shard_bytes);

}  // namespace trainer
