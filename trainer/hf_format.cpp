#include "trainer/hf_format.h"

#include <fmt/format.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "io/atomic_file.h"
#include "io/safetensors.h"

namespace trainer {

namespace {
using Op = HfTensor::Op;
}

std::vector<HfTensor> hf_tensors(const ModelConfig& m) {
  const int64_t C = m.d_model, V = m.vocab_size, T = m.seq_len, F = m.ffn();
  const int64_t kv = int64_t(m.kv_heads()) * m.head_size();
  std::vector<HfTensor> t;
  if (m.arch == Arch::gpt2) {
    // Biases a bias-free model lacks are zeros: transformers' GPT-2 always has them.
    auto bias = [&](const std::string& name, int64_t n, const std::string& ours) {
      if (m.bias)
        t.push_back({name, {n}, ours});
      else
        t.push_back({name, {n}, "", Op::zeros});
    };
    t.push_back({"transformer.wte.weight", {V, C}, "wte.weight"});
    t.push_back({"transformer.wpe.weight", {T, C}, "wpe.weight"});
    for (int l = 0; l < m.n_layer; l++) {
      const std::string h = fmt::format("transformer.h.{}.", l), o = fmt::format("h.{}.", l);
      t.push_back({h + "ln_1.weight", {C}, o + "ln1.weight"});
      bias(h + "ln_1.bias", C, o + "ln1.bias");
      t.push_back({h + "attn.c_attn.weight", {C, 3 * C}, o + "attn.qkv.weight", Op::transpose});
      bias(h + "attn.c_attn.bias", 3 * C, o + "attn.qkv.bias");
      t.push_back({h + "attn.c_proj.weight", {C, C}, o + "attn.proj.weight", Op::transpose});
      bias(h + "attn.c_proj.bias", C, o + "attn.proj.bias");
      t.push_back({h + "ln_2.weight", {C}, o + "ln2.weight"});
      bias(h + "ln_2.bias", C, o + "ln2.bias");
      t.push_back({h + "mlp.c_fc.weight", {C, 4 * C}, o + "mlp.fc.weight", Op::transpose});
      bias(h + "mlp.c_fc.bias", 4 * C, o + "mlp.fc.bias");
      t.push_back({h + "mlp.c_proj.weight", {4 * C, C}, o + "mlp.proj.weight", Op::transpose});
      bias(h + "mlp.c_proj.bias", C, o + "mlp.proj.bias");
    }
    t.push_back({"transformer.ln_f.weight", {C}, "ln_f.weight"});
    bias("transformer.ln_f.bias", C, "ln_f.bias");
    if (!m.tie_embeddings) t.push_back({"lm_head.weight", {V, C}, "lm_head.weight"});
    return t;
  }
  t.push_back({"model.embed_tokens.weight", {V, C}, "tok_embeddings.weight"});
  for (int l = 0; l < m.n_layer; l++) {
    const std::string h = fmt::format("model.layers.{}.", l), o = fmt::format("layers.{}.", l);
    t.push_back({h + "input_layernorm.weight", {C}, o + "attention_norm.weight"});
    t.push_back({h + "self_attn.q_proj.weight",
                 {C, C},
                 o + "attention.wq.weight",
                 Op::rope_rows,
                 m.n_head});
    t.push_back({h + "self_attn.k_proj.weight",
                 {kv, C},
                 o + "attention.wk.weight",
                 Op::rope_rows,
                 m.kv_heads()});
    t.push_back({h + "self_attn.v_proj.weight", {kv, C}, o + "attention.wv.weight"});
    t.push_back({h + "self_attn.o_proj.weight", {C, C}, o + "attention.wo.weight"});
    t.push_back({h + "post_attention_layernorm.weight", {C}, o + "ffn_norm.weight"});
    t.push_back({h + "mlp.gate_proj.weight", {F, C}, o + "feed_forward.w1.weight"});
    t.push_back({h + "mlp.up_proj.weight", {F, C}, o + "feed_forward.w3.weight"});
    t.push_back({h + "mlp.down_proj.weight", {C, F}, o + "feed_forward.w2.weight"});
  }
  t.push_back({"model.norm.weight", {C}, "norm.weight"});
  if (!m.tie_embeddings) t.push_back({"lm_head.weight", {V, C}, "output.weight"});
  return t;
}

std::vector<float> hf_tensor_values(const HfTensor& t, const std::vector<float>& in) {
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  std::vector<float> out(size_t(n), 0.0f);
  switch (t.op) {
    case Op::zeros:
      break;
    case Op::copy:
      out = in;
      break;
    case Op::transpose: {  // ours (rows, cols) -> (cols, rows)
      const int64_t rows = t.shape[1], cols = t.shape[0];
      for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) out[size_t(c * rows + r)] = in[size_t(r * cols + c)];
      break;
    }
    case Op::rope_rows: {
      // Within each head of hd rows, row 2i (the pair's real part) goes to i and row 2i + 1 to
      // hd/2 + i: w.view(heads, hd/2, 2, C).transpose(1, 2).
      const int64_t cols = t.shape[1], hd = t.shape[0] / t.heads;
      for (int64_t h = 0; h < t.heads; h++)
        for (int64_t i = 0; i < hd / 2; i++)
          for (int64_t part = 0; part < 2; part++) {
            const int64_t from = h * hd + 2 * i + part, to = h * hd + part * (hd / 2) + i;
            std::copy_n(in.begin() + from * cols, cols, out.begin() + to * cols);
          }
      break;
    }
  }
  return out;
}

std::string hf_config_json(const ModelConfig& m, const std::string& dtype) {
  const char* torch_dtype = dtype == "BF16" ? "bfloat16" : dtype == "F16" ? "float16" : "float32";
  nlohmann::ordered_json j;
  if (m.arch == Arch::gpt2) {
    j = {{"architectures", {"GPT2LMHeadModel"}},
         {"model_type", "gpt2"},
         {"vocab_size", m.vocab_size},
         {"n_positions", m.seq_len},
         {"n_ctx", m.seq_len},
         {"n_embd", m.d_model},
         {"n_layer", m.n_layer},
         {"n_head", m.n_head},
         {"n_inner", 4 * m.d_model},
         {"activation_function", "gelu_new"},
         {"layer_norm_epsilon", 1e-5},
         {"resid_pdrop", m.dropout},
         {"embd_pdrop", m.dropout},
         {"attn_pdrop", 0.0},
         {"initializer_range", m.init_std},
         {"scale_attn_weights", true},
         {"tie_word_embeddings", m.tie_embeddings},
         {"use_cache", true},
         {"torch_dtype", torch_dtype}};
  } else {
    j = {{"architectures", {"LlamaForCausalLM"}},
         {"model_type", "llama"},
         {"vocab_size", m.vocab_size},
         {"max_position_embeddings", m.seq_len},
         {"hidden_size", m.d_model},
         {"intermediate_size", m.ffn()},
         {"num_hidden_layers", m.n_layer},
         {"num_attention_heads", m.n_head},
         {"num_key_value_heads", m.kv_heads()},
         {"head_dim", m.head_size()},
         {"hidden_act", "silu"},
         {"rms_norm_eps", m.norm_eps},
         {"rope_theta", m.rope_theta},
         {"attention_bias", false},
         {"mlp_bias", false},
         {"attention_dropout", 0.0},
         {"initializer_range", m.init_std},
         {"tie_word_embeddings", m.tie_embeddings},
         {"use_cache", true},
         {"torch_dtype", torch_dtype}};
    if (m.rope_scaling.factor > 0)
      j["rope_scaling"] = {{"rope_type", "llama3"},
                           {"factor", m.rope_scaling.factor},
                           {"low_freq_factor", m.rope_scaling.low_freq_factor},
                           {"high_freq_factor", m.rope_scaling.high_freq_factor},
                           {"original_max_position_embeddings", m.rope_scaling.original_max_pos}};
    else
      j["rope_scaling"] = nullptr;
  }
  return j.dump(2) + "\n";
}

std::string hf_generation_config_json(const ModelConfig&) {
  return nlohmann::ordered_json({{"do_sample", true}, {"temperature", 1.0}}).dump(2) + "\n";
}

std::vector<std::string> write_hf(const ModelConfig& m,
                                  const std::function<std::vector<float>(const std::string&)>& read,
                                  const std::string& dir, const std::string& dtype,
                                  const std::map<std::string, std::string>& metadata,
                                  int64_t max_shard_bytes) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  const std::vector<HfTensor> tensors = hf_tensors(m);
  // Shards: tensors in order, a new shard when the next would pass the limit.
  const int size = safetensors_dtype_size(dtype);
  std::vector<std::vector<const HfTensor*>> shards(1);
  int64_t in_shard = 0, total = 0;
  for (const HfTensor& t : tensors) {
    int64_t bytes = size;
    for (int64_t d : t.shape) bytes *= d;
    if (in_shard > 0 && in_shard + bytes > max_shard_bytes) shards.emplace_back(), in_shard = 0;
    shards.back().push_back(&t);
    in_shard += bytes;
    total += bytes;
  }
  const size_t n = shards.size();
  std::vector<std::string> files;
  nlohmann::ordered_json weight_map;
  for (size_t s = 0; s < n; s++) {
    const std::string name =
        n == 1 ? "model.safetensors" : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, n);
    SafetensorsWriter out((fs::path(dir) / name).string(), metadata);
    for (const HfTensor* t : shards[s]) out.add(t->name, dtype, t->shape);
    for (const HfTensor* t : shards[s]) {
      const std::vector<float> ours = t->op == Op::zeros ? std::vector<float>() : read(t->ours);
      out.write(t->name, hf_tensor_values(*t, ours).data());
      weight_map[t->name] = name;
    }
    out.close();
    files.push_back(name);
  }
  if (n > 1) {
    const nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}},
                                          {"weight_map", weight_map}};
    write_file_atomic((fs::path(dir) / "model.safetensors.index.json").string(),
                      index.dump(2) + "\n");
    files.push_back("model.safetensors.index.json");
  }
  write_file_atomic((fs::path(dir) / "config.json").string(), hf_config_json(m, dtype));
  write_file_atomic((fs::path(dir) / "generation_config.json").string(),
                    hf_generation_config_json(m));
  files.push_back("config.json");
  files.push_back("generation_config.json");
  return files;
}

}  // namespace trainer
