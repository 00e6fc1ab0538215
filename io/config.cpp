#include "io/config.h"

#include <fmt/format.h>
#include <toml++/toml.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "io/toml_reader.h"

namespace trainer {
namespace {

using config_reader::apply_override;
using config_reader::at_least;
using config_reader::in_range;
using config_reader::one_of;
using config_reader::Origins;
using config_reader::SectionReader;
using config_reader::where;

void check_model(const Config& c, SectionReader& r) {
  const ModelConfig& m = c.model;
  if (m.d_model % m.n_head != 0)
    throw ConfigError(fmt::format("{}: [model] n_head: n_head = {} must divide d_model = {}",
                                  r.origin("n_head"), m.n_head, m.d_model));
  if (m.arch != Arch::llama) return;
  if (m.n_head % m.kv_heads() != 0)
    throw ConfigError(
        fmt::format("{}: [model] n_kv_head: n_kv_head = {} must divide n_head = {} (each key/value "
                    "head serves a group of query heads)",
                    r.origin("n_kv_head"), m.n_kv_head, m.n_head));
  if (m.head_size() % 2 != 0)
    throw ConfigError(fmt::format(
        "{}: [model] n_head: the head size d_model / n_head = {} must be even (rotary embeddings "
        "rotate pairs)",
        r.origin("n_head"), m.head_size()));
  const RopeScaling& rs = m.rope_scaling;
  if (rs.factor > 0 && rs.high_freq_factor <= rs.low_freq_factor)
    throw ConfigError(fmt::format(
        "{}: [model] rope_high_freq_factor: must exceed rope_low_freq_factor = {}, found {}",
        r.origin("rope_high_freq_factor"), rs.low_freq_factor, rs.high_freq_factor));
}

// [model]: the keys every architecture has, then its own; another architecture's key is an
// error (it would be silently ignored).
void read_model(Config& c, SectionReader& r) {
  ModelConfig& m = c.model;
  std::string arch = arch_name(m.arch);
  r.field("arch", arch, one_of({"gpt2", "llama"}));
  m.arch = arch == "llama" ? Arch::llama : Arch::gpt2;
  const bool llama = m.arch == Arch::llama;
  if (llama) m.tie_embeddings = false;  // Llama's default
  r.field("vocab_size", m.vocab_size, in_range(2, 1 << 24));
  r.field("vocab_multiple", m.vocab_multiple, in_range(1, 4096));
  r.field("seq_len", m.seq_len, in_range(1, 1 << 20));
  r.field("n_layer", m.n_layer, in_range(1, 1024));
  r.field("n_head", m.n_head, in_range(1, 1024));
  r.field("d_model", m.d_model, in_range(1, 1 << 16));
  r.field("tie_embeddings", m.tie_embeddings);
  r.field("init_std", m.init_std, in_range(1e-6, 10));
  const char* llama_keys[] = {"n_kv_head",
                              "ffn_hidden",
                              "ffn_dim_multiplier",
                              "multiple_of",
                              "norm_eps",
                              "rope_theta",
                              "rope_scaling_factor",
                              "rope_low_freq_factor",
                              "rope_high_freq_factor",
                              "rope_original_max_pos"};
  if (!llama) {
    r.field("bias", m.bias);
    r.field("dropout", m.dropout, in_range(0, 0.95));
    for (const char* key : llama_keys)
      if (r.has(key))
        throw ConfigError(
            fmt::format("{}: [model] {}: applies to arch = \"llama\" only (this "
                        "model is arch = \"gpt2\")",
                        r.origin(key), key));
    return;
  }
  for (const char* key : {"bias", "dropout"})
    if (r.has(key))
      throw ConfigError(
          fmt::format("{}: [model] {}: applies to arch = \"gpt2\" only (this model "
                      "is arch = \"llama\")",
                      r.origin(key), key));
  m.bias = false;
  r.field("n_kv_head", m.n_kv_head, in_range(0, 1024));
  r.field("ffn_hidden", m.ffn_hidden, in_range(0, 1 << 20));
  r.field("ffn_dim_multiplier", m.ffn_dim_multiplier, in_range(0.01, 100));
  r.field("multiple_of", m.multiple_of, in_range(1, 1 << 16));
  r.field("norm_eps", m.norm_eps, in_range(1e-12, 1));
  r.field("rope_theta", m.rope_theta, in_range(1, 1e12));
  r.field("rope_scaling_factor", m.rope_scaling.factor, in_range(0, 1024));
  r.field("rope_low_freq_factor", m.rope_scaling.low_freq_factor, in_range(0.01, 1024));
  r.field("rope_high_freq_factor", m.rope_scaling.high_freq_factor, in_range(0.01, 1024));
  r.field("rope_original_max_pos", m.rope_scaling.original_max_pos, in_range(1, 1 << 24));
}

}  // namespace

Config parse_config(const std::string& text, const std::string& origin,
                    const std::vector<std::string>& overrides) {
  toml::table root;
  try {
    root = toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    const auto& s = e.source();
    throw ConfigError(fmt::format("{}:{}:{}: invalid TOML: {}", origin, s.begin.line,
                                  s.begin.column, e.description()));
  }
  Origins origins;
  for (const auto& item : overrides) apply_override(root, item, origins);

  static const std::set<std::string> sections = {
      "run",      "init",   "model",     "data", "tokenizer",  "train",  "optim",
      "parallel", "memory", "precision", "comm", "checkpoint", "faults", "profile"};
  for (auto& [k, v] : root)
    if (!sections.count(std::string(k.str()))) {
      std::string at = where(k.source(), origin);
      for (const auto& [key, o] : origins)
        if (key.starts_with(std::string(k.str()) + ".")) at = o;
      throw ConfigError(
          fmt::format("{}: unknown section [{}] (expected run, init, model, data, tokenizer, "
                      "train, optim, parallel, "
                      "memory, precision, comm.compression, comm.outer, checkpoint or faults)",
                      at, k.str()));
    }

  // [comm] holds its two sections and two values (read below).
  if (toml::table* comm = root["comm"].as_table())
    for (auto& [k, v] : *comm)
      if (k.str() != "compression" && k.str() != "outer" &&
          !((k.str() == "budget_ms" || k.str() == "inter_node_gbps") && !v.is_table())) {
        std::string at = where(k.source(), origin);
        for (const auto& [key, o] : origins)
          if (key.starts_with("comm." + std::string(k.str()))) at = o;
        throw ConfigError(
            fmt::format("{}: unknown section [comm.{}] (expected comm.compression or comm.outer; "
                        "[comm] itself holds budget_ms and inter_node_gbps)",
                        at, k.str()));
      }

  Config c;
  bool grad_accum_set = false;
  std::string overwrite_at;
  {
    SectionReader r(root, "run", origin, origins);
    r.field("name", c.run.name);
    r.field("out_dir", c.run.out_dir);
    r.field("overwrite", c.run.overwrite);
    overwrite_at = r.origin("overwrite");
    r.field("seed", c.run.seed);
    r.field("device", c.run.device, one_of({"cpu", "cuda"}));
    r.field("gpu_memory_fraction", c.run.gpu_memory_fraction, in_range(0.01, 1.0));
    r.field("gpu_collectives", c.run.gpu_collectives, one_of({"auto", "nccl", "mpi"}));
    r.field("threads", c.run.threads, in_range(0, 1024));
    r.field("peak_tflops", c.run.peak_tflops, at_least(0));
    r.field("phase_timing", c.run.phase_timing);
    r.finish();
  }
  {
    SectionReader r(root, "init", origin, origins);
    r.field("from", c.init.from);
    r.finish();
  }
  {
    SectionReader r(root, "model", origin, origins);
    read_model(c, r);
    r.finish();
    check_model(c, r);
  }
  {
    SectionReader r(root, "data", origin, origins);
    r.field("train", c.data.train);
    r.field("val", c.data.val);
    r.field("prefetch", c.data.prefetch, in_range(1, 1024));
    r.field("cache_dir", c.data.cache_dir);
    r.field("format", c.data.format, one_of({"auto", "nanogpt"}));
    r.field("sources", c.data.sources);
    r.finish();
    if (r.has("sources") && r.has("train"))
      throw ConfigError(
          fmt::format("{}: [data] train: set either train or [[data.sources]] (a blend), not both",
                      r.origin("train")));
  }
  {
    SectionReader r(root, "tokenizer", origin, origins);
    TokenizerConfig& t = c.tokenizer;
    r.field("kind", t.kind, one_of({"bytes", "gpt2", "tiktoken", "sentencepiece"}));
    r.field("path", t.path);
    r.field("pattern", t.pattern, one_of({"", "gpt2", "cl100k", "llama3"}));
    r.finish();
    if (t.kind != "bytes" && t.path.empty())
      throw ConfigError(
          fmt::format("{}: [tokenizer] path: kind = \"{}\" needs its files, found none",
                      r.origin("kind"), t.kind));
    if ((t.kind == "tiktoken") != !t.pattern.empty())
      throw ConfigError(fmt::format(
          "{}: [tokenizer] pattern: {}", r.origin(t.pattern.empty() ? "kind" : "pattern"),
          t.kind == "tiktoken"
              ? std::string("a tiktoken rank file needs its pre-tokenisation pattern (gpt2, "
                            "cl100k or llama3), found none")
              : fmt::format("applies to kind = \"tiktoken\" only, found kind = \"{}\"", t.kind)));
  }
  {
    SectionReader r(root, "train", origin, origins);
    TrainConfig& t = c.train;
    r.field("micro_batch", t.micro_batch, in_range(1, 1 << 16));
    r.field("grad_accum", t.grad_accum, in_range(1, 1 << 16));
    grad_accum_set = r.has("grad_accum");
    r.field("steps", t.steps, at_least(0));
    r.field("log_every", t.log_every, at_least(1));
    r.field("val_every", t.val_every, at_least(0));
    r.field("val_batches", t.val_batches, at_least(1));
    r.field("sample_every", t.sample_every, at_least(0));
    r.field("sample_tokens", t.sample_tokens, at_least(1));
    r.field("sample_prompt", t.sample_prompt);
    r.field("sample_temperature", t.sample_temperature, in_range(1e-3, 100));
    r.field("sample_top_k", t.sample_top_k, at_least(0));
    r.field("batch_ramp", t.batch_ramp,
            [&](const std::vector<std::array<int64_t, 2>>& rows) -> std::optional<std::string> {
              for (size_t i = 0; i < rows.size(); i++) {
                const auto [at, sequences] = rows[i];
                if (i == 0 && at != 0)
                  return fmt::format("the first row starts at 0, found [{}, {}]", at, sequences);
                if (i > 0 && at <= rows[i - 1][0])
                  return fmt::format("row {} starts at {}, expected after {}", i, at,
                                     rows[i - 1][0]);
                if (sequences < 1 || sequences % t.micro_batch != 0 || sequences > (1 << 30))
                  return fmt::format(
                      "row {}: {} sequences, expected a positive multiple of micro_batch = {}", i,
                      sequences, t.micro_batch);
              }
              return std::nullopt;
            });
    r.field("batch_ramp_unit", t.batch_ramp_unit, one_of({"steps", "tokens"}));
    r.finish();
    if (!t.batch_ramp.empty() && grad_accum_set && t.grad_accum != 1)
      throw ConfigError(fmt::format(
          "{}: [train] grad_accum: the batch ramp sets the micro-batches of each step (found "
          "grad_accum = {} and batch_ramp)",
          r.origin("grad_accum"), t.grad_accum));
    for (unsigned char byte : t.sample_prompt)  // the byte-level tokenizer's ids
      if (c.tokenizer.kind == "bytes" && byte >= c.model.vocab_size)
        throw ConfigError(fmt::format(
            "{}: [train] sample_prompt: byte {} is outside the vocabulary (vocab_size = {})",
            r.origin("sample_prompt"), byte, c.model.vocab_size));
  }
  {
    SectionReader r(root, "optim", origin, origins);
    OptimConfig& o = c.optim;
    r.field("name", o.name, one_of({"adamw", "sgd", "onebit_adam", "dgc_adam"}));
    r.field("freeze_step", o.freeze_step, at_least(1));
    r.field("dgc_ratio", o.dgc_ratio, [](double x) -> std::optional<std::string> {
      if (x > 0 && x <= 1) return std::nullopt;
      return fmt::format("must be in (0, 1], found {}", x);
    });
    r.field("dgc_warmup_steps", o.dgc_warmup_steps, at_least(0));
    r.field("dgc_masking", o.dgc_masking);
    r.field("lr", o.lr, in_range(0, 10));
    r.field("min_lr", o.min_lr, in_range(0, 10));
    r.field("betas", o.betas, [](const std::array<double, 2>& b) -> std::optional<std::string> {
      if (b[0] >= 0 && b[0] < 1 && b[1] >= 0 && b[1] < 1) return std::nullopt;
      return fmt::format("each beta must be in [0, 1), found [{}, {}]", b[0], b[1]);
    });
    r.field("eps", o.eps, in_range(0, 1));
    r.field("momentum", o.momentum, in_range(0, 0.999999));
    r.field("weight_decay", o.weight_decay, in_range(0, 10));
    r.field("max_grad_norm", o.max_grad_norm, at_least(0));
    r.field("warmup_steps", o.warmup_steps, at_least(0));
    r.field("schedule", o.schedule, one_of({"cosine", "linear", "constant"}));
    r.field("decay_embeddings", o.decay_embeddings);
    r.field("decay_norms_and_biases", o.decay_norms_and_biases);
    r.finish();
    if (o.min_lr > o.lr)
      throw ConfigError(fmt::format("{}: [optim] min_lr: min_lr = {} must not exceed lr = {}",
                                    r.origin("min_lr"), o.min_lr, o.lr));
  }
  {
    SectionReader r(root, "parallel", origin, origins);
    ParallelConfig& p = c.parallel;
    r.field("dp", p.dp, in_range(0, 1 << 20));
    r.field("tp", p.tp, in_range(1, 1 << 16));
    r.field("pp", p.pp, in_range(1, 1 << 16));
    r.field("order", p.order,
            one_of({"tp-pp-dp", "tp-dp-pp", "pp-tp-dp", "pp-dp-tp", "dp-tp-pp", "dp-pp-tp"}));
    r.field("micro_batches", p.micro_batches, in_range(0, 1 << 16));
    r.field("zero", p.zero, in_range(0, 3));
    r.field("bucket_mb", p.bucket_mb, in_range(1e-3, 1 << 16));
    r.field("overlap", p.overlap);
    r.field("allreduce", p.allreduce, one_of({"flat", "hierarchical"}));
    r.field("ranks_per_node", p.ranks_per_node, in_range(0, 1 << 20));
    r.field("sequence_parallel", p.sequence_parallel);
    r.field("cp", p.cp, in_range(1, 1 << 16));
    r.finish();
    // Context parallelism cuts each sequence into 2 cp chunks, two to a rank.
    if (p.cp > 1 && c.model.seq_len % (2 * p.cp))
      throw ConfigError(fmt::format(
          "{}: [parallel] cp = {} cuts each sequence into 2 x cp = {} chunks: model.seq_len = {} "
          "is not a multiple of it",
          r.origin("cp"), p.cp, 2 * p.cp, c.model.seq_len));
    if (p.cp > 1 && c.run.device != "cpu")
      throw ConfigError(fmt::format(
          "{}: [parallel] cp = {}: context parallelism (ring attention) runs on the CPU backend "
          "only; the CUDA backend has no ring-attention kernels yet",
          r.origin("cp"), p.cp));
    // Sequence parallelism splits each micro-batch's B x T rows (T / cp of each sequence with
    // context parallelism) over the tensor-parallel ranks.
    if (p.sequence_parallel && p.tp > 1 &&
        int64_t(c.train.micro_batch) * (c.model.seq_len / p.cp) % p.tp)
      throw ConfigError(fmt::format(
          "{}: [parallel] sequence_parallel splits the micro-batch's rows over tp = {}: "
          "train.micro_batch x model.seq_len{} = {} x {} is not a multiple of it",
          r.origin("sequence_parallel"), p.tp, p.cp > 1 ? " / cp" : "", c.train.micro_batch,
          c.model.seq_len / p.cp));
    // One knob for the micro-batches of a step: the pipeline's micro_batches and gradient
    // accumulation are the same thing, so setting both differently is a contradiction.
    if (p.micro_batches > 0 && !c.train.batch_ramp.empty())
      throw ConfigError(fmt::format(
          "{}: [parallel] micro_batches: the batch ramp (train.batch_ramp) sets the micro-batches "
          "of each step",
          r.origin("micro_batches")));
    if (p.micro_batches > 0) {
      if (grad_accum_set && c.train.grad_accum != p.micro_batches)
        throw ConfigError(fmt::format(
            "{}: [parallel] micro_batches: micro_batches = {} contradicts train.grad_accum = {} "
            "(they are the same: set one)",
            r.origin("micro_batches"), p.micro_batches, c.train.grad_accum));
      c.train.grad_accum = p.micro_batches;
    }
  }
  {
    SectionReader r(root, "memory", origin, origins);
    MemoryConfig& m = c.memory;
    r.field("recompute", m.recompute, one_of({"none", "selective", "full"}));
    r.field("recompute_layers", m.recompute_layers, in_range(0, 1 << 20));
    r.field("offload_optimizer", m.offload_optimizer);
    r.finish();
  }
  {
    SectionReader r(root, "precision", origin, origins);
    PrecisionConfig& p = c.precision;
    r.field("compute", p.compute, one_of({"fp32", "bf16", "fp16"}));
    r.field("grads", p.grads, one_of({"fp32", "compute"}));
    r.field("loss_scale", p.loss_scale, in_range(0, 1e30));
    r.field("initial_scale", p.initial_scale, in_range(1e-30, 1e30));
    r.field("growth_factor", p.growth_factor, in_range(1, 1e6));
    r.field("backoff_factor", p.backoff_factor, in_range(1e-6, 1));
    r.field("growth_interval", p.growth_interval, at_least(1));
    r.field("hysteresis", p.hysteresis, at_least(1));
    r.field("min_scale", p.min_scale, in_range(1e-30, 1e30));
    r.field("max_min_scale_overflows", p.max_min_scale_overflows, at_least(1));
    r.field("stochastic_rounding", p.stochastic_rounding);
    r.finish();
    if (p.min_scale > p.initial_scale)
      throw ConfigError(fmt::format(
          "{}: [precision] min_scale: min_scale = {} must not exceed initial_scale = {}",
          r.origin("min_scale"), p.min_scale, p.initial_scale));
    if (p.stochastic_rounding && p.compute != "bf16")
      throw ConfigError(fmt::format(
          "{}: [precision] stochastic_rounding: applies to compute = \"bf16\" only, found \"{}\"",
          r.origin("stochastic_rounding"), p.compute));
  }
  {
    SectionReader comm(root, "comm", origin, origins);  // its sections are checked above
    comm.field("budget_ms", c.comm.budget_ms, at_least(0));
    comm.field("inter_node_gbps", c.comm.inter_node_gbps, at_least(0));
    SectionReader r(root, "comm.compression", origin, origins);
    CompressionConfig& z = c.comm.compression;
    r.field("method", z.method,
            one_of({"none", "fp16", "bf16", "int8", "onebit", "topk", "powersgd", "auto"}));
    r.field("topk_ratio", z.topk_ratio, in_range(1e-6, 1));
    r.field("powersgd_rank", z.powersgd_rank, in_range(1, 1024));
    r.field("powersgd_budget", z.powersgd_budget, in_range(0, 1));
    r.field("two_phase", z.two_phase);
    r.field("error_feedback", z.error_feedback);
    r.field("warmup_steps", z.warmup_steps, at_least(0));
    r.field("min_bucket_kb", z.min_bucket_kb, at_least(0));
    r.finish();
    if (z.method == "auto" && c.comm.budget_ms <= 0)
      throw ConfigError(fmt::format(
          "{}: [comm.compression] method: \"auto\" chooses by [comm] budget_ms, which is not set",
          r.origin("method")));
    // ("auto" chooses among what the run allows.)
    if (z.method != "none" && z.method != "auto" && c.precision.grads != "fp32")
      throw ConfigError(
          fmt::format("{}: [comm.compression] method: \"{}\" compresses fp32 gradients, but "
                      "precision.grads = \"{}\" (set it to \"fp32\")",
                      r.origin("method"), z.method, c.precision.grads));
    // The compressors exchange whole buckets of the step's summed gradients; ZeRO-2 and -3
    // reduce each micro-batch's as its units finish and keep no bucket whole.
    if (z.method != "none" && z.method != "auto" && c.parallel.zero >= 2)
      throw ConfigError(fmt::format(
          "{}: [comm.compression] method: \"{}\" compresses the flat gradient buffer that "
          "parallel.zero = {} does not keep (use zero = 1 with compression)",
          r.origin("method"), z.method, c.parallel.zero));
  }
  {
    SectionReader r(root, "comm.outer", origin, origins);
    OuterConfig& o = c.comm.outer;
    r.field("every_steps", o.every_steps, at_least(0));
    r.field("lr", o.lr, in_range(0, 10));
    r.field("momentum", o.momentum, in_range(0, 0.999999));
    r.field("nesterov", o.nesterov);
    r.field("quantize", o.quantize, one_of({"none", "int8"}));
    r.finish();
    // ZeRO-3's parameter gatherer reaches over every data-parallel rank; the outer step keeps
    // the nodes apart between its exchanges.
    // Context-parallel peers hold chunks of the same sequences: they must train as one.
    if (o.on() && c.parallel.cp > 1)
      throw ConfigError(fmt::format(
          "{}: [comm.outer] every_steps: outer steps across nodes do not combine with context "
          "parallelism (parallel.cp = {})",
          r.origin("every_steps"), c.parallel.cp));
    if (o.on() && c.parallel.zero >= 3)
      throw ConfigError(fmt::format(
          "{}: [comm.outer] every_steps: the outer steps work with parallel.zero = 0, 1 or 2, "
          "found zero = {}",
          r.origin("every_steps"), c.parallel.zero));
  }
  if (c.optim.exchanges_momentum()) {
    // 1-bit Adam and DGC exchange the momentum themselves, in whole buckets of the flat
    // gradient buffer (comm/grad_reducer.h), and every node keeps one optimizer state.
    const std::string at = SectionReader(root, "optim", origin, origins).origin("name");
    auto refuse = [&](const std::string& why) {
      throw ConfigError(fmt::format("{}: [optim] name: \"{}\" {}", at, c.optim.name, why));
    };
    const std::string& warm_up = c.comm.compression.method;
    if (warm_up != "none" && warm_up != "fp16" && warm_up != "bf16" && warm_up != "int8")
      refuse(fmt::format(
          "exchanges its momentum {} after freeze_step itself; [comm.compression] method is the "
          "warm-up's, one of none, fp16, bf16 or int8, found \"{}\"",
          c.optim.name == "onebit_adam" ? "in 1 bit" : "as top-k", warm_up));
    if (c.precision.grads != "fp32")
      refuse(fmt::format("exchanges fp32 momentum: precision.grads must be \"fp32\", found \"{}\"",
                         c.precision.grads));
    if (c.parallel.zero >= 2)
      refuse(fmt::format(
          "needs the flat gradient buffer that parallel.zero = {} does not keep (use 0 or 1)",
          c.parallel.zero));
    if (c.comm.outer.on())
      refuse("and [comm.outer] every_steps are two ways across nodes: choose one");
  }
  {
    SectionReader r(root, "checkpoint", origin, origins);
    CheckpointConfig& k = c.checkpoint;
    if (r.is_word("every_steps", "auto"))
      k.every_steps = CheckpointConfig::kAutoSteps;
    else
      r.field("every_steps", k.every_steps, [](int v) -> std::optional<std::string> {
        if (v >= 0) return std::nullopt;
        return fmt::format("expected a number of steps >= 0 or \"auto\", found {}", v);
      });
    r.field("every_minutes", k.every_minutes, at_least(0));
    r.field("mtbf_hours", k.mtbf_hours, at_least(0));
    r.field("protect", k.protect);
    r.field("protect_min_steps", k.protect_min_steps, at_least(0));
    if (k.every_steps == CheckpointConfig::kAutoSteps && k.mtbf_hours <= 0)
      throw ConfigError(fmt::format(
          "{}: [checkpoint] every_steps = \"auto\" sets the interval from the cluster's failure "
          "rate: set [checkpoint] mtbf_hours (the job's mean time between failures)",
          r.origin("every_steps")));
    r.field("keep_last", k.keep_last, at_least(0));
    r.field("async", k.async);
    r.field("dir", k.dir);
    r.field("resume", k.resume, [](const std::string& v) -> std::optional<std::string> {
      if (!v.empty()) return std::nullopt;
      return "expected \"none\", \"auto\" or a checkpoint path, found \"\"";
    });
    if (c.run.overwrite && k.resume != "none")
      throw ConfigError(fmt::format(
          "{}: run.overwrite = true removes the run in out_dir, but checkpoint.resume = \"{}\" "
          "continues from a checkpoint: overwrite is for fresh runs (resume = \"none\")",
          overwrite_at, k.resume));
    r.finish();
  }
  {
    SectionReader r(root, "profile", origin, origins);
    r.field("steps", c.profile.steps,
            [](const std::array<int64_t, 2>& s) -> std::optional<std::string> {
              if ((s[0] == -1 && s[1] == -1) || (s[0] >= 0 && s[1] >= s[0])) return std::nullopt;
              return fmt::format("[first, last] with 0 <= first <= last, found [{}, {}]", s[0],
                                 s[1]);
            });
    r.finish();
  }
  {
    SectionReader r(root, "faults", origin, origins);
    FaultsConfig& f = c.faults;
    r.field("spike_zscore", f.spike_zscore, at_least(0));
    r.field("spike_window", f.spike_window, in_range(2, 1 << 20));
    r.field("max_bad_steps", f.max_bad_steps, at_least(0));
    r.field("skip_data_on_rollback", f.skip_data_on_rollback);
    r.field("collective_timeout_s", f.collective_timeout_s, at_least(0));
    r.field("checkpoint_timeout_s", f.checkpoint_timeout_s, at_least(0));
    r.finish();
  }
  return c;
}

std::vector<DataSource> training_sources(const DataConfig& d) {
  if (!d.sources.empty()) return d.sources;
  return {{d.train, 1.0}};
}

std::string tokenizer_name(const TokenizerConfig& t) {
  if (t.kind == "bytes") return "bytes";
  return t.kind + (t.pattern.empty() ? "" : " " + t.pattern) + " (" + t.path + ")";
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  if (path.empty()) return parse_config("", "<defaults>", overrides);
  std::ifstream in(path);
  if (!in) throw ConfigError(fmt::format("{}: cannot open config file", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_config(ss.str(), path, overrides);
}

}  // namespace trainer
