#pragma once
// llm.c's GPT-2 checkpoint (gpt2_124M.bin, written by its train_gpt2.py): 256 int32 of header
// {20240326, version 3 (fp32) or 5 (bf16), max_seq_len, vocab_size, n_layer, n_head, d_model,
// padded_vocab_size}, then the parameters in its order, each kind stacked over the layers: wte
// (padded vocab rows, zeros past vocab_size), wpe, ln1 weights, ln1 biases, qkv weights, qkv
// biases, attention projections and biases, ln2, fc, fc projections, ln_f. Its matrices are
// (out, in), as ours: GPT-2 with tied embeddings and biases only.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "io/hdf5_file.h"  // Box
#include "io/mapped_file.h"
#include "model/model_config.h"

namespace trainer {

// Writes `path` atomically. dtype: "F32" (version 3) or "BF16" (version 5).
void write_llmc(const ModelConfig& m,
                const std::function<std::vector<float>(const std::string&)>& read,
                const std::string& path, const std::string& dtype);

// A checkpoint in llm.c's format, mapped, read under our parameter names.
class LlmcFile {
 public:
  explicit LlmcFile(const std::string& path);  // DataError for a damaged file
  ~LlmcFile();
  LlmcFile(const LlmcFile&) = delete;
  LlmcFile& operator=(const LlmcFile&) = delete;

  static bool is_one(const std::string& path);  // starts with the magic 20240326
  // The header against [model]: every disagreeing field in one CheckpointError line.
  void check(const ModelConfig& m) const;
  void read_part(const std::string& name, const std::vector<int64_t>& shape,
                 const std::vector<Box>& boxes, float* values) const;

 private:
  std::string path_;
  int32_t header_[256];
  MappedFile file_;
  ModelConfig model_;                       // what the header describes
  std::map<std::string, int64_t> offsets_;  // each parameter's first element, after the header
};

}  // namespace trainer
