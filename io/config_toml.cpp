// A Config written back as TOML (config_to_toml): what a run directory's config.toml and a
// checkpoint's stored config hold, read again by parse_config.
#include <toml++/toml.h>

#include <sstream>

#include "io/config.h"

namespace trainer {

static toml::table model_table(const ModelConfig& m) {
  toml::table t{{"arch", arch_name(m.arch)},
                {"vocab_size", m.vocab_size},
                {"vocab_multiple", m.vocab_multiple},
                {"seq_len", m.seq_len},
                {"n_layer", m.n_layer},
                {"n_head", m.n_head},
                {"d_model", m.d_model},
                {"tie_embeddings", m.tie_embeddings},
                {"init_std", m.init_std}};
  if (m.arch != Arch::llama) {
    t.insert("bias", m.bias);
    t.insert("dropout", m.dropout);
    return t;
  }
  t.insert("n_kv_head", m.n_kv_head);
  t.insert("ffn_hidden", m.ffn_hidden);
  t.insert("ffn_dim_multiplier", m.ffn_dim_multiplier);
  t.insert("multiple_of", m.multiple_of);
  t.insert("norm_eps", m.norm_eps);
  t.insert("rope_theta", m.rope_theta);
  t.insert("rope_scaling_factor", m.rope_scaling.factor);
  t.insert("rope_low_freq_factor", m.rope_scaling.low_freq_factor);
  t.insert("rope_high_freq_factor", m.rope_scaling.high_freq_factor);
  t.insert("rope_original_max_pos", m.rope_scaling.original_max_pos);
  return t;
}

static toml::array strings(const std::vector<std::string>& v) {
  toml::array a;
  for (const auto& s : v) a.push_back(s);
  return a;
}

static toml::table train_table(const TrainConfig& t) {
  toml::table out{{"micro_batch", t.micro_batch},
                  {"grad_accum", t.grad_accum},
                  {"steps", t.steps},
                  {"log_every", t.log_every},
                  {"val_every", t.val_every},
                  {"val_batches", t.val_batches},
                  {"sample_every", t.sample_every},
                  {"sample_tokens", t.sample_tokens},
                  {"sample_prompt", t.sample_prompt},
                  {"sample_temperature", t.sample_temperature},
                  {"sample_top_k", t.sample_top_k},
                  {"batch_ramp_unit", t.batch_ramp_unit}};
  if (!t.batch_ramp.empty()) {
    toml::array rows;
    for (const auto& [at, sequences] : t.batch_ramp) rows.push_back(toml::array{at, sequences});
    out.insert("batch_ramp", std::move(rows));
  }
  return out;
}

// [data], with either `train` or the [[data.sources]] of a blend.
static toml::table data_table(const DataConfig& d) {
  toml::table t{{"val", strings(d.val)},
                {"prefetch", d.prefetch},
                {"format", d.format},
                {"cache_dir", d.cache_dir}};
  if (d.sources.empty()) {
    t.insert("train", strings(d.train));
    return t;
  }
  toml::array sources;
  for (const DataSource& s : d.sources)
    sources.push_back(toml::table{{"path", strings(s.path)}, {"weight", s.weight}});
  t.insert("sources", std::move(sources));
  return t;
}

std::string config_to_toml(const Config& c) {
  toml::table root{
      {"run", toml::table{{"name", c.run.name},
                          {"out_dir", c.run.out_dir},
                          {"overwrite", c.run.overwrite},
                          {"seed", int64_t(c.run.seed)},
                          {"device", c.run.device},
                          {"gpu_memory_fraction", c.run.gpu_memory_fraction},
                          {"gpu_collectives", c.run.gpu_collectives},
                          {"threads", c.run.threads},
                          {"peak_tflops", c.run.peak_tflops},
                          {"phase_timing", c.run.phase_timing}}},
      {"init", toml::table{{"from", c.init.from}}},
      {"model", model_table(c.model)},
      {"data", data_table(c.data)},
      {"tokenizer", toml::table{{"kind", c.tokenizer.kind},
                                {"path", c.tokenizer.path},
                                {"pattern", c.tokenizer.pattern}}},
      {"train", train_table(c.train)},
      {"optim", toml::table{{"name", c.optim.name},
                            {"lr", c.optim.lr},
                            {"min_lr", c.optim.min_lr},
                            {"betas", toml::array{c.optim.betas[0], c.optim.betas[1]}},
                            {"eps", c.optim.eps},
                            {"momentum", c.optim.momentum},
                            {"freeze_step", c.optim.freeze_step},
                            {"dgc_ratio", c.optim.dgc_ratio},
                            {"dgc_warmup_steps", c.optim.dgc_warmup_steps},
                            {"dgc_masking", c.optim.dgc_masking},
                            {"weight_decay", c.optim.weight_decay},
                            {"max_grad_norm", c.optim.max_grad_norm},
                            {"warmup_steps", c.optim.warmup_steps},
                            {"schedule", c.optim.schedule},
                            {"decay_embeddings", c.optim.decay_embeddings},
                            {"decay_norms_and_biases", c.optim.decay_norms_and_biases}}},
      {"parallel", toml::table{{"dp", c.parallel.dp},
                               {"tp", c.parallel.tp},
                               {"pp", c.parallel.pp},
                               {"order", c.parallel.order},
                               {"micro_batches", c.parallel.micro_batches},
                               {"zero", c.parallel.zero},
                               {"bucket_mb", c.parallel.bucket_mb},
                               {"overlap", c.parallel.overlap},
                               {"allreduce", c.parallel.allreduce},
                               {"ranks_per_node", c.parallel.ranks_per_node},
                               {"sequence_parallel", c.parallel.sequence_parallel},
                               {"cp", c.parallel.cp}}},
      {"memory", toml::table{{"recompute", c.memory.recompute},
                             {"recompute_layers", c.memory.recompute_layers},
                             {"offload_optimizer", c.memory.offload_optimizer}}},
      {"precision", toml::table{{"compute", c.precision.compute},
                                {"grads", c.precision.grads},
                                {"loss_scale", c.precision.loss_scale},
                                {"initial_scale", c.precision.initial_scale},
                                {"growth_factor", c.precision.growth_factor},
                                {"backoff_factor", c.precision.backoff_factor},
                                {"growth_interval", c.precision.growth_interval},
                                {"hysteresis", c.precision.hysteresis},
                                {"min_scale", c.precision.min_scale},
                                {"max_min_scale_overflows", c.precision.max_min_scale_overflows},
                                {"stochastic_rounding", c.precision.stochastic_rounding}}},
      {"comm", toml::table{{"budget_ms", c.comm.budget_ms},
                           {"inter_node_gbps", c.comm.inter_node_gbps},
                           {"compression",
                            toml::table{{"method", c.comm.compression.method},
                                        {"topk_ratio", c.comm.compression.topk_ratio},
                                        {"powersgd_rank", c.comm.compression.powersgd_rank},
                                        {"powersgd_budget", c.comm.compression.powersgd_budget},
                                        {"two_phase", c.comm.compression.two_phase},
                                        {"error_feedback", c.comm.compression.error_feedback},
                                        {"warmup_steps", c.comm.compression.warmup_steps},
                                        {"min_bucket_kb", c.comm.compression.min_bucket_kb}}},
                           {"outer", toml::table{{"every_steps", c.comm.outer.every_steps},
                                                 {"lr", c.comm.outer.lr},
                                                 {"momentum", c.comm.outer.momentum},
                                                 {"nesterov", c.comm.outer.nesterov},
                                                 {"quantize", c.comm.outer.quantize}}}}},
      {"checkpoint", toml::table{{"every_steps", c.checkpoint.every_steps},
                                 {"every_minutes", c.checkpoint.every_minutes},
                                 {"mtbf_hours", c.checkpoint.mtbf_hours},
                                 {"protect", c.checkpoint.protect},
                                 {"protect_min_steps", c.checkpoint.protect_min_steps},
                                 {"keep_last", c.checkpoint.keep_last},
                                 {"async", c.checkpoint.async},
                                 {"dir", c.checkpoint.dir},
                                 {"resume", c.checkpoint.resume}}},
      {"profile", toml::table{{"steps", toml::array{c.profile.steps[0], c.profile.steps[1]}}}},
      {"faults", toml::table{{"spike_zscore", c.faults.spike_zscore},
                             {"spike_window", c.faults.spike_window},
                             {"max_bad_steps", c.faults.max_bad_steps},
                             {"skip_data_on_rollback", c.faults.skip_data_on_rollback},
                             {"collective_timeout_s", c.faults.collective_timeout_s},
                             {"checkpoint_timeout_s", c.faults.checkpoint_timeout_s}}},
  };
  if (c.checkpoint.every_steps == CheckpointConfig::kAutoSteps)
    root.at_path("checkpoint").as_table()->insert_or_assign("every_steps", "auto");
  std::stringstream ss;
  // Basic strings only: toml++ writes "\n" as a multi-line literal that does not read back.
  const auto flags =
      toml::toml_formatter::default_flags &
      ~(toml::format_flags::allow_literal_strings | toml::format_flags::allow_multi_line_strings);
  ss << "# resolved trainer config: every key, defaults included\n"
     << toml::toml_formatter(root, flags) << "\n";
  return ss.str();
}

}  // namespace trainer
