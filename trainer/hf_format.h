#pragma once
// Hugging Face transformers' layouts of the two architectures, for `trainer export --format hf`:
// GPT2LMHeadModel (Conv1D weights stored (in, out), the transpose of ours; biases always) and
// LlamaForCausalLM (q/k/v/o, gate/up/down, and the rows of q and k permuted per head, because
// transformers rotates the halves of each head where Meta's reference, and this trainer, rotate
// interleaved pairs: convert_llama_weights_to_hf.py's permute()).
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "io/hdf5_file.h"  // Box
#include "io/safetensors.h"
#include "io/tokenizer.h"
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

// transformers' files for a tokenizer, by name: GPT-2's BPE as GPT2Tokenizer's vocab.json and
// merges.txt (our encoder.json and vocab.bpe, byte for byte), a SentencePiece model as
// LlamaTokenizer's tokenizer.model, tiktoken rank files (Llama 3's, cl100k) as a fast tokenizer's
// tokenizer.json (the ranks as a byte-level BPE vocabulary with the merges that build them), each
// with tokenizer_config.json and special_tokens_map.json. Empty for bytes.
std::vector<std::pair<std::string, std::string>> hf_tokenizer_files(const Tokenizer& tokenizer,
                                                                    int max_length);

// Writes `dir`: model.safetensors (or, above max_shard_bytes, model-0000i-of-0000n.safetensors
// and model.safetensors.index.json), config.json, generation_config.json and, given a tokenizer,
// its files (hf_tokenizer_files). `read(name)` gives our parameter's full values. dtype: "F32",
// "BF16" or "F16". Returns the files written.
std::vector<std::string> write_hf(const ModelConfig& m,
                                  const std::function<std::vector<float>(const std::string&)>& read,
                                  const std::string& dir, const std::string& dtype,
                                  const std::map<std::string, std::string>& metadata,
                                  int64_t max_shard_bytes, const Tokenizer* tokenizer = nullptr);

// A transformers model directory (our export, or a model saved by transformers: GPT-2's names
// with or without the "transformer." prefix, its attention-mask buffers ignored), read under our
// parameter names for a warm start. Throws CheckpointError (DataError for a damaged file).
class HfDirectory {
 public:
  explicit HfDirectory(const std::string& dir);
  ~HfDirectory();
  HfDirectory(const HfDirectory&) = delete;
  HfDirectory& operator=(const HfDirectory&) = delete;

  // config.json against [model], and every tensor of the directory against the model's: one
  // line naming every disagreeing field, or the first tensor missing, left over or mis-shaped.
  void check(const ModelConfig& m) const;
  // The boxes of our parameter that transformers' tensor `t` (one of hf_tensors(m)) holds, as
  // H5File::read_part reads them.
  void read_part(const HfTensor& t, const std::vector<int64_t>& shape,
                 const std::vector<Box>& boxes, float* values) const;
  static bool is_one(const std::string& dir);  // holds config.json and safetensors weights

 private:
  struct Files;
  const SafetensorsFile* file_of(const std::string& hf_name, std::string& stored) const;
  std::vector<float> read_full(const HfTensor& t) const;

  std::string dir_;
  std::unique_ptr<Files> files_;
};

}  // namespace trainer
