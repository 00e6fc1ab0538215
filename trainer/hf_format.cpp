#include "trainer/hf_format.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "io/atomic_file.h"
#include "io/bpe_files.h"
#include "io/errors.h"
#include "io/safetensors.h"
#include "io/tokenizer_spec.h"

namespace trainer {

namespace {
using Op = HfTensor::Op;

// transformers' row of q or k for our `row`: within each head of hd rows, row 2i (the first of a
// rotated pair) goes to i and row 2i + 1 to hd/2 + i (w.view(heads, hd/2, 2, C).transpose(1, 2)).
int64_t rope_row(int64_t row, int64_t hd) {
  const int64_t head = row / hd, r = row % hd;
  return head * hd + (r % 2) * (hd / 2) + r / 2;
}
}  // namespace

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
      const int64_t cols = t.shape[1], hd = t.shape[0] / t.heads;
      for (int64_t row = 0; row < t.shape[0]; row++)
        std::copy_n(in.begin() + row * cols, cols, out.begin() + rope_row(row, hd) * cols);
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

std::vector<std::pair<std::string, std::string>> hf_tokenizer_files(const Tokenizer& tokenizer,
                                                                    int max_length) {
  const TokenizerSpec spec = parse_spec(tokenizer.serialize(), "the tokenizer");
  auto file = [&](const std::string& role) -> const std::string& {
    for (const SpecFile& f : spec.files)
      if (f.role == role) return f.bytes;
    throw std::logic_error("hf_tokenizer_files: a " + spec.kind + " tokenizer without " + role);
  };
  auto special = [&](std::initializer_list<const char*> names) {
    for (const char* n : names)
      if (spec.specials.count(n)) return nlohmann::json(n);
    return nlohmann::json(nullptr);
  };
  std::vector<std::pair<std::string, std::string>> out;
  nlohmann::ordered_json config, map;
  if (spec.kind == "gpt2") {
    out = {{"vocab.json", file("encoder.json")}, {"merges.txt", file("vocab.bpe")}};
    const nlohmann::json eot = special({"<|endoftext|>"});
    map = {{"bos_token", eot}, {"eos_token", eot}, {"unk_token", eot}};
    config = {{"tokenizer_class", "GPT2Tokenizer"}, {"add_prefix_space", false}};
  } else if (spec.kind == "sentencepiece") {
    out = {{"tokenizer.model", file("model")}};
    map = {{"bos_token", special({"<s>"})},
           {"eos_token", special({"</s>"})},
           {"unk_token", special({"<unk>"})}};
    // The trainer's encode adds no BOS: neither does this configuration.
    config = {
        {"tokenizer_class", "LlamaTokenizer"}, {"add_bos_token", false}, {"add_eos_token", false}};
  } else if (spec.kind == "tiktoken") {
    // transformers' fast tokenizer: the ranks as a byte-level BPE vocabulary and its merges,
    // tiktoken's pattern as the pre-tokenizer, a piece that is a whole token taken as it is
    // (ignore_merges, as tiktoken does), the special tokens added.
    const std::vector<RankedToken> ranks = parse_tiktoken_ranks(file("ranks"), "the tokenizer");
    nlohmann::ordered_json vocab = nlohmann::ordered_json::object(),
                           merges = nlohmann::ordered_json::array(),
                           added = nlohmann::ordered_json::array();
    std::vector<const RankedToken*> by_rank;
    for (const RankedToken& t : ranks) by_rank.push_back(&t);
    std::sort(by_rank.begin(), by_rank.end(),
              [](const RankedToken* a, const RankedToken* b) { return a->rank < b->rank; });
    for (const RankedToken* t : by_rank) vocab[byte_level_spelling(t->bytes)] = t->rank;
    for (const auto& [a, b] : bpe_merges(ranks))
      merges.push_back(byte_level_spelling(a) + " " + byte_level_spelling(b));
    std::vector<std::pair<int32_t, std::string>> specials;
    for (const auto& [name, id] : spec.specials) specials.emplace_back(id, name);
    std::sort(specials.begin(), specials.end());
    for (const auto& [id, name] : specials)
      added.push_back({{"id", id},
                       {"content", name},
                       {"single_word", false},
                       {"lstrip", false},
                       {"rstrip", false},
                       {"normalized", false},
                       {"special", true}});
    const nlohmann::ordered_json byte_level = {{"type", "ByteLevel"},
                                               {"add_prefix_space", false},
                                               {"trim_offsets", true},
                                               {"use_regex", false}};
    const nlohmann::ordered_json tokenizer = {{"version", "1.0"},
                                              {"truncation", nullptr},
                                              {"padding", nullptr},
                                              {"added_tokens", added},
                                              {"normalizer", nullptr},
                                              {"pre_tokenizer",
                                               {{"type", "Sequence"},
                                                {"pretokenizers",
                                                 {{{"type", "Split"},
                                                   {"pattern", {{"Regex", spec.pattern}}},
                                                   {"behavior", "Isolated"},
                                                   {"invert", false}},
                                                  byte_level}}}},
                                              {"post_processor", byte_level},
                                              {"decoder", byte_level},
                                              {"model",
                                               {{"type", "BPE"},
                                                {"dropout", nullptr},
                                                {"unk_token", nullptr},
                                                {"continuing_subword_prefix", nullptr},
                                                {"end_of_word_suffix", nullptr},
                                                {"fuse_unk", false},
                                                {"byte_fallback", false},
                                                {"ignore_merges", true},
                                                {"vocab", vocab},
                                                {"merges", merges}}}};
    out = {{"tokenizer.json", tokenizer.dump() + "\n"}};
    map = {{"bos_token", special({"<|begin_of_text|>", "<|endoftext|>"})},
           {"eos_token", special({"<|end_of_text|>", "<|endoftext|>"})}};
    config = {{"tokenizer_class", "PreTrainedTokenizerFast"},
              {"clean_up_tokenization_spaces", false}};
  } else {
    return {};
  }
  config["model_max_length"] = max_length;
  for (const auto& [k, v] : map.items()) config[k] = v;
  out.push_back({"tokenizer_config.json", config.dump(2) + "\n"});
  out.push_back({"special_tokens_map.json", map.dump(2) + "\n"});
  return out;
}

namespace {

std::vector<std::string> write_hf_files(
    const ModelConfig& m, const std::function<std::vector<float>(const std::string&)>& read,
    const std::string& dir, const std::string& dtype,
    const std::map<std::string, std::string>& metadata, int64_t max_shard_bytes,
    const Tokenizer* tokenizer) {
  namespace fs = std::filesystem;
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
  if (tokenizer)
    for (const auto& [name, bytes] : hf_tokenizer_files(*tokenizer, m.seq_len)) {
      write_file_atomic((fs::path(dir) / name).string(), bytes);
      files.push_back(name);
    }
  return files;
}

}  // namespace

std::vector<std::string> write_hf(const ModelConfig& m,
                                  const std::function<std::vector<float>(const std::string&)>& read,
                                  const std::string& dir, const std::string& dtype,
                                  const std::map<std::string, std::string>& metadata,
                                  int64_t max_shard_bytes, const Tokenizer* tokenizer) {
  namespace fs = std::filesystem;
  // Into a directory of its own, renamed into place when whole: an interrupted export leaves
  // nothing that looks like a model, and none mixes with an earlier export's shards.
  std::error_code ec;
  if (fs::exists(dir) && !(fs::is_directory(dir) && fs::is_empty(dir, ec)))
    throw ConfigError(fmt::format(
        "{}: exists and is not an empty directory: an export goes into a new one (remove it, or "
        "choose another --out)",
        dir));
  const std::string partial = fmt::format("{}.partial-{}", dir, ::getpid());
  fs::remove_all(partial, ec);
  fs::create_directories(partial);
  try {
    std::vector<std::string> files =
        write_hf_files(m, read, partial, dtype, metadata, max_shard_bytes, tokenizer);
    fs::remove(dir, ec);  // empty, if it is there
    fs::rename(partial, dir);
    fsync_path(fs::path(dir).parent_path().empty() ? "." : fs::path(dir).parent_path().string());
    return files;
  } catch (...) {
    fs::remove_all(partial, ec);
    throw;
  }
}

// --- reading a directory back ------------------------------------------------------------------

struct HfDirectory::Files {
  nlohmann::json config;
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, size_t> where;  // tensor name as stored -> its file
};

bool HfDirectory::is_one(const std::string& dir) {
  namespace fs = std::filesystem;
  return fs::is_directory(dir) && fs::exists(fs::path(dir) / "config.json") &&
         (fs::exists(fs::path(dir) / "model.safetensors") ||
          fs::exists(fs::path(dir) / "model.safetensors.index.json"));
}

HfDirectory::HfDirectory(const std::string& dir) : dir_(dir), files_(std::make_unique<Files>()) {
  namespace fs = std::filesystem;
  const std::string config = (fs::path(dir) / "config.json").string();
  std::ifstream in(config);
  if (!in) throw CheckpointError(fmt::format("{}: cannot read", config));
  try {
    files_->config = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(fmt::format("{}: not JSON ({})", config, e.what()));
  }
  if (!files_->config.is_object())
    throw CheckpointError(fmt::format("{}: not a JSON object", config));
  std::set<std::string> names;
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(index)) {
    std::ifstream i(index);
    try {
      for (const auto& [tensor, file] : nlohmann::json::parse(i).at("weight_map").items())
        names.insert(file.get<std::string>());
    } catch (const nlohmann::json::exception& e) {
      throw CheckpointError(
          fmt::format("{}: not an index of shards ({})", index.string(), e.what()));
    }
  } else {
    names.insert("model.safetensors");
  }
  for (const std::string& name : names) {
    if (name.find('/') != std::string::npos)
      throw CheckpointError(
          fmt::format("{}: names {}, not a file beside it", index.string(), name));
    files_->files.push_back(std::make_unique<SafetensorsFile>((fs::path(dir) / name).string()));
    for (const auto& [tensor, t] : files_->files.back()->tensors())
      if (!files_->where.emplace(tensor, files_->files.size() - 1).second)
        throw CheckpointError(fmt::format("{}: tensor {} is in two shards", dir, tensor));
  }
}

HfDirectory::~HfDirectory() = default;

const SafetensorsFile* HfDirectory::file_of(const std::string& hf_name, std::string& stored) const {
  // transformers saves GPT-2 without the "transformer." prefix of GPT2LMHeadModel's names.
  for (const std::string& name :
       {hf_name, hf_name.starts_with("transformer.") ? hf_name.substr(std::strlen("transformer."))
                                                     : hf_name}) {
    const auto it = files_->where.find(name);
    if (it != files_->where.end()) {
      stored = name;
      return files_->files[it->second].get();
    }
  }
  return nullptr;
}

std::vector<float> HfDirectory::read_full(const HfTensor& t) const {
  std::string stored;
  const SafetensorsFile* f = file_of(t.name, stored);
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  std::vector<float> values(static_cast<size_t>(n));
  const Box all =
      t.shape.size() == 1 ? Box{0, 0, 1, t.shape[0]} : Box{0, 0, t.shape[0], t.shape[1]};
  f->read_part(stored, t.shape, {all}, values.data());
  return values;
}

namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

}  // namespace

void HfDirectory::check(const ModelConfig& m) const {
  try {
    const nlohmann::json& c = files_->config;
    std::vector<std::string> wrong;
    // A field of config.json against the model's value (absent: transformers' default).
    auto field = [&](const char* key, const nlohmann::json& fallback, const nlohmann::json& ours,
                     const std::string& our_key) {
      const nlohmann::json& theirs = c.contains(key) && !c[key].is_null() ? c[key] : fallback;
      const bool same = theirs.is_number() && ours.is_number()
                            ? std::abs(theirs.get<double>() - ours.get<double>()) <=
                                  1e-9 * std::abs(ours.get<double>())
                            : theirs == ours;
      if (!same)
        wrong.push_back(
            fmt::format("{} = {}, [model] {} = {}", key, theirs.dump(), our_key, ours.dump()));
    };
    const std::string arch =
        c.contains("architectures") && c["architectures"].is_array() && !c["architectures"].empty()
            ? c["architectures"][0].dump()
            : "none";
    const char* want = m.arch == Arch::gpt2 ? "GPT2LMHeadModel" : "LlamaForCausalLM";
    if (arch != nlohmann::json(want).dump())
      wrong.push_back(fmt::format("architectures = [{}], [model] arch = \"{}\" ({})", arch,
                                  arch_name(m.arch), want));
    field("vocab_size", nullptr, m.vocab_size, "vocab_size");
    if (m.arch == Arch::gpt2) {
      field("n_positions", 1024, m.seq_len, "seq_len");
      field("n_embd", 768, m.d_model, "d_model");
      field("n_layer", 12, m.n_layer, "n_layer");
      field("n_head", 12, m.n_head, "n_head");
      field("n_inner", 4 * m.d_model, 4 * m.d_model, "d_model x 4");
      field("layer_norm_epsilon", 1e-5, 1e-5, "(LayerNorm's eps, fixed)");
      const nlohmann::json act = c.value("activation_function", "gelu_new");
      if (act != "gelu_new" && act != "gelu_pytorch_tanh")
        wrong.push_back(fmt::format("activation_function = {}, this GPT-2 has tanh GELU (gelu_new)",
                                    act.dump()));
      field("tie_word_embeddings", true, m.tie_embeddings, "tie_embeddings");
    } else {
      field("hidden_size", nullptr, m.d_model, "d_model");
      field("intermediate_size", nullptr, m.ffn(), "ffn_hidden (as derived)");
      field("num_hidden_layers", nullptr, m.n_layer, "n_layer");
      field("num_attention_heads", nullptr, m.n_head, "n_head");
      field("num_key_value_heads", c.value("num_attention_heads", 0), m.kv_heads(), "n_kv_head");
      field("head_dim", m.head_size(), m.head_size(), "d_model / n_head");
      field("rms_norm_eps", 1e-6, m.norm_eps, "norm_eps");
      field("rope_theta", 10000.0, m.rope_theta, "rope_theta");
      field("hidden_act", "silu", "silu", "(SwiGLU's SiLU)");
      field("tie_word_embeddings", false, m.tie_embeddings, "tie_embeddings");
      field("attention_bias", false, false, "(no biases)");
      field("mlp_bias", false, false, "(no biases)");
      const nlohmann::json s = c.value("rope_scaling", nlohmann::json());
      nlohmann::json ours = nullptr;
      if (m.rope_scaling.factor > 0)
        ours = {{"factor", m.rope_scaling.factor},
                {"low_freq_factor", m.rope_scaling.low_freq_factor},
                {"high_freq_factor", m.rope_scaling.high_freq_factor},
                {"original_max_position_embeddings", m.rope_scaling.original_max_pos}};
      nlohmann::json theirs = nullptr;
      if (s.is_object()) {
        theirs = nlohmann::json::object();
        for (const char* k :
             {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
          if (s.contains(k)) theirs[k] = s[k];
        const std::string type = s.value("rope_type", s.value("type", ""));
        if (type != "llama3")
          wrong.push_back(
              fmt::format("rope_scaling.rope_type = \"{}\", this Llama has llama3's", type));
      }
      bool same = theirs.is_null() == ours.is_null();
      if (same && !ours.is_null())
        for (const auto& [k, v] : ours.items())
          same = same && theirs.contains(k) &&
                 std::abs(theirs[k].get<double>() - v.get<double>()) <=
                     1e-9 * std::abs(v.get<double>());
      if (!same)
        wrong.push_back(
            fmt::format("rope_scaling = {}, [model] rope_scaling = {}", s.dump(), ours.dump()));
    }
    if (!wrong.empty())
      throw CheckpointError(fmt::format("{}/config.json: {}", dir_, fmt::join(wrong, "; ")));

    // The tensors: each the model needs, of its shape; zero biases where the model has none.
    std::set<std::string> used;
    for (const HfTensor& t : hf_tensors(m)) {
      std::string stored;
      const SafetensorsFile* f = file_of(t.name, stored);
      if (!f) {
        if (t.op == Op::zeros) continue;  // a model without biases: none is fine too
        throw CheckpointError(fmt::format("{}: no tensor {} ({}), which this model needs for {}",
                                          dir_, t.name, shape_text(t.shape), t.ours));
      }
      used.insert(stored);
      if (f->at(stored).shape != t.shape)
        throw CheckpointError(fmt::format("{}: {} has shape {}, this model's is {}", dir_, stored,
                                          shape_text(f->at(stored).shape), shape_text(t.shape)));
      if (t.op == Op::zeros)
        for (float v : read_full(t))
          if (v != 0)
            throw CheckpointError(
                fmt::format("{}: {} is not zero, and this model has no biases (model.bias = false)",
                            dir_, stored));
    }
    for (const auto& [name, file] : files_->where) {
      // GPT-2's causal-mask buffers, which older transformers saved with the weights.
      if (name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")) continue;
      if (!used.count(name))
        throw CheckpointError(fmt::format("{}: tensor {} has no place in this model ({})", dir_,
                                          name, arch_name(m.arch)));
    }
  } catch (const nlohmann::json::exception& e) {  // a field of config.json of another type
    throw CheckpointError(
        fmt::format("{}/config.json: a field of an unexpected type ({})", dir_, e.what()));
  }
}

void HfDirectory::read_part(const HfTensor& t, const std::vector<int64_t>& shape,
                            const std::vector<Box>& boxes, float* values) const {
  // Only this rank's boxes are read, each from where transformers' layout keeps it.
  const std::vector<int64_t> ours =
      t.op == Op::transpose ? std::vector<int64_t>{t.shape[1], t.shape[0]} : t.shape;
  if (ours != shape) throw std::logic_error("HfDirectory::read_part: another shape of " + t.ours);
  std::string stored;
  const SafetensorsFile* f = file_of(t.name, stored);
  if (t.op == Op::copy) return f->read_part(stored, t.shape, boxes, values);
  for (const Box& b : boxes) {
    if (b.rows <= 0 || b.cols <= 0) continue;
    if (t.op == Op::transpose) {  // our rows are its columns
      std::vector<float> theirs(size_t(b.rows * b.cols));
      f->read_part(stored, t.shape, {{b.col, b.row, b.cols, b.rows}}, theirs.data());
      for (int64_t r = 0; r < b.rows; r++)
        for (int64_t c = 0; c < b.cols; c++) *values++ = theirs[size_t(c * b.rows + r)];
    } else {  // rope_rows: row by row, each from its permuted place
      const int64_t hd = t.shape[0] / t.heads;
      for (int64_t r = 0; r < b.rows; r++, values += b.cols)
        f->read_part(stored, t.shape, {{rope_row(b.row + r, hd), b.col, 1, b.cols}}, values);
    }
  }
}

}  // namespace trainer
