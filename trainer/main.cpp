// trainer: one binary that trains transformer language models from one TOML file.
//   trainer train CONFIG [--set section.key=value ...] [--dry-run]
//   trainer generate --checkpoint DIR [--prompt TEXT] [--tokens N]
//   trainer prepare --input FILE|DIR|GLOB... --out-dir DIR [--tokenizer KIND --tokenizer-path PATH]
//                   [--format auto|text|jsonl --field NAME --threads N --shard-tokens N
//                    --compress]
// Bad input of any kind ends with one line on stderr and exit code 2.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "comm/bus_bandwidth.h"
#include "comm/communicator.h"
#include "io/config.h"
#include "io/token_shard.h"
#include "io/tokenizer.h"
#include "kernels/cpu/host_memory.h"
#include "trainer/blas_setup.h"
#include "trainer/checkpoint.h"
#include "trainer/export.h"
#include "trainer/node_peers.h"
#include "trainer/planner.h"
#include "trainer/prepare.h"
#include "trainer/report_error.h"
#include "trainer/sampler.h"
#include "trainer/train.h"

namespace {

// prompt_given: --prompt was on the command line (text needs a model that takes text).
int generate(const std::string& checkpoint, const std::string& prompt, bool prompt_given,
             int tokens, trainer::SampleOptions opts) {
  using namespace trainer;
  const std::string state = resolve_checkpoint(checkpoint);
  const Config cfg = checkpoint_config(state);
  // The tokenizer the checkpoint stores; one from before tokenizers were stored was trained on
  // bytes.
  std::unique_ptr<Tokenizer> tokenizer = checkpoint_tokenizer(state);
  if (!tokenizer && cfg.tokenizer.kind == "bytes") tokenizer = load_tokenizer("bytes", "");
  const bool text = takes_text(tokenizer.get(), cfg.model.vocab_size);
  if (!text && prompt_given)
    throw ConfigError(fmt::format(
        "--prompt: the model in {} has a vocabulary of {} tokens, not the 256 bytes, and no "
        "tokenizer: it takes no text (without --prompt it samples from token 0 and prints token "
        "ids)",
        state, cfg.model.vocab_size));
  auto kernels = make_cpu_kernels();
  StageExecutor model(cfg.model, *kernels, DType::f32, 1, cfg.model.seq_len);
  load_checkpoint(state, model, nullptr);
  opts.tokens = tokens;
  const std::string out = sample_text(next_logits_of(model), tokenizer.get(), cfg.model.vocab_size,
                                      cfg.model.seq_len, prompt, opts);
  if (text) {
    fmt::print("{}{}\n", prompt, out);
  } else {
    fmt::print(stderr, "token ids (a vocabulary of {} tokens, no tokenizer), after token 0:\n",
               cfg.model.vocab_size);
    fmt::print("{}\n", out);
  }
  return 0;
}

// A range check that also refuses NaN and the infinities: CLI::Range lets NaN through (every
// comparison with it is false), and a NaN temperature or fraction then misbehaves far away.
CLI::Validator finite_in(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (text.empty() || *end != '\0') return "expected a number, found \"" + text + "\"";
        if (!std::isfinite(v) || v < lo || v > hi)
          return fmt::format("expected a finite number in [{}, {}], found {}", lo, hi, text);
        return "";
      },
      fmt::format("FINITE in [{}, {}]", lo, hi));
}

std::string version_string() {
#if defined(TRAINER_WITH_CUDA) && defined(TRAINER_WITH_NCCL)
  const char* backends = "cpu, cuda (cuBLASLt, NCCL)";
#elif defined(TRAINER_WITH_CUDA)
  const char* backends = "cpu, cuda (cuBLASLt; no NCCL: GPU collectives through MPI)";
#else
  const char* backends = "cpu";
#endif
  return fmt::format("trainer {} ({}, backends: {})", TRAINER_VERSION, __DATE__, backends);
}

}  // namespace

int main(int argc, char** argv) {
  trainer::ensure_fast_blas(argv);
  // Before MPI: its collectives' temporaries reuse the heap.
  if (!trainer::keep_freed_memory())
    fmt::print(stderr,
               "trainer: note: the allocator kept its own policy for freed memory (not glibc's, "
               "or refused mallopt): collectives may fault their temporaries in afresh\n");
  // Line by line also into a file or a pipe (sbatch --output, | tee): a log that shows each
  // step as it happens and loses nothing to a SIGKILL.
  std::setvbuf(stdout, nullptr, _IOLBF, 1 << 16);
  CLI::App app{"trainer: trains transformer language models from one TOML config", "trainer"};
  app.set_version_flag("--version", version_string());
  app.require_subcommand(1);

  std::string config_path;
  std::vector<std::string> overrides;
  auto* train = app.add_subcommand("train", "train a model from a TOML config");
  train->add_option("config", config_path, "the run's TOML config")->required();
  train->add_option("--set", overrides, "override a config value: section.key=value (repeatable)")
      ->take_all();
  bool dry_run = false;
  train->add_flag("--dry-run", dry_run,
                  "set everything up on every rank (data, layout, memory, allocation), print the "
                  "plan of this layout (memory per rank, expected step time) and exit: nothing is "
                  "trained or written");

  std::string checkpoint, prompt = "\n";
  int tokens = 200;
  trainer::SampleOptions sample;
  auto* gen = app.add_subcommand("generate", "sample text from a saved checkpoint");
  gen->add_option("--checkpoint", checkpoint, "checkpoint or run directory")->required();
  auto* prompt_option =
      gen->add_option("--prompt", prompt, "text to continue")->capture_default_str();
  gen->add_option("--tokens", tokens, "tokens to generate")->check(CLI::Range(1, 1 << 20));
  gen->add_option("--temperature", sample.temperature, "softmax temperature")
      ->check(finite_in(1e-3, 100.0));
  gen->add_option("--top-k", sample.top_k, "sample from the k most likely tokens (0 = all)")
      ->check(CLI::Range(0, 1 << 24));  // not NonNegativeNumber: it prints DBL_MAX in full
  gen->add_option("--seed", sample.seed, "random seed");

  trainer::PrepareOptions prep;
  auto* pre = app.add_subcommand("prepare", "tokenize text files into train/val shards");
  pre->add_option("--input", prep.inputs,
                  "text or JSON Lines files (.gz, .zst too), directories, glob patterns")
      ->required()
      ->take_all();
  pre->add_option("--out-dir", prep.out_dir, "directory for train.bin and val.bin")->required();
  pre->add_option("--val-fraction", prep.val_fraction,
                  "documents kept for validation (of each document, under 100 documents)")
      ->check(finite_in(0.0, 0.5));
  std::string prep_format = "auto";
  pre->add_option("--format", prep_format, "auto (*.jsonl, *.ndjson: JSON Lines) | text | jsonl")
      ->check(CLI::IsMember({"auto", "text", "jsonl"}))
      ->capture_default_str();
  pre->add_option("--field", prep.field, "JSON Lines: the field that holds each document's text")
      ->capture_default_str();
  pre->add_option("--threads", prep.threads, "tokenizer threads (0: every core)")
      ->check(CLI::Range(0, 1024));
  pre->add_option("--shard-tokens", prep.shard_tokens,
                  "at most this many tokens a shard, named train_000000.bin, ... (0: one shard)")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 40));
  pre->add_flag("--compress", prep.compress,
                "write zstd-compressed shards, train.bin.zst, ... (decompressed once by a run, "
                "into data.cache_dir if set)");
  std::string prep_config;
  pre->add_option("--config", prep_config, "take the tokenizer from this run config's [tokenizer]");
  std::string prep_kind, prep_path, prep_pattern;
  pre->add_option("--tokenizer", prep_kind,
                  "bytes | gpt2 | tiktoken | sentencepiece (default bytes)");
  pre->add_option("--tokenizer-path", prep_path, "the tokenizer's files");
  pre->add_option("--pattern", prep_pattern, "tiktoken's pre-tokenisation: gpt2 | cl100k | llama3");

  trainer::ExportOptions exp;
  auto* ex = app.add_subcommand("export", "write a checkpoint's weights for other tools");
  ex->add_option("--checkpoint", exp.checkpoint, "checkpoint or run directory")->required();
  ex->add_option("--format", exp.format,
                 "safetensors: one file, the model's own tensor names (what [init] from reads); "
                 "hf: a directory that transformers' from_pretrained loads; llmc: llm.c's "
                 "gpt2_124M.bin format")
      ->check(CLI::IsMember({"safetensors", "hf", "llmc"}))
      ->capture_default_str();
  ex->add_option("--out", exp.out, "the file (safetensors) or directory (hf) to write")->required();
  ex->add_option("--max-shard-mb", exp.max_shard_mb, "hf: shards of at most this many MB")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 30))
      ->capture_default_str();
  ex->add_option("--dtype", exp.dtype, "fp32 | bf16 | fp16")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();

  trainer::PlanArgs plan;
  double plan_memory_gb = 0, plan_intra_gbps = 0, plan_inter_gbps = 0;
  int plan_per_node = 0;
  std::string plan_device;
  auto* pl = app.add_subcommand(
      "plan", "a parallel layout, memory policy and micro-batch that fit a cluster, ranked");
  pl->add_option("config", plan.config, "the run's config (its model and global batch)")
      ->required();
  pl->add_option("--gpus", plan.options.cluster.devices, "devices (ranks) in all")
      ->required()
      ->check(CLI::Range(1, 1 << 20));
  pl->add_option("--gpus-per-node", plan_per_node,
                 "devices a node (default 8; CPU: as many ranks as this machine has cores, "
                 "under mpirun the ranks on this node)")
      ->check(CLI::Range(1, 1 << 10));
  pl->add_option("--gpu-memory", plan_memory_gb,
                 "GB a device (default: the GPU's; CPU: this machine's available memory over "
                 "the ranks a node)")
      ->check(CLI::Range(0.001, 1e6));
  pl->add_option("--gpu", plan_device,
                 "h100, h200, a100, b200, l40s, or a device's TFLOP/s (default h100; CPU: this "
                 "machine's measured sgemm on a rank's run.threads cores)");
  pl->add_option("--intra-node-gbps", plan_intra_gbps,
                 "collective bus bandwidth inside a node, Gbit/s a device (default 3600: "
                 "NVLink; CPU: measured among the ranks under mpirun, else 40)")
      ->check(CLI::Range(0.001, 1e9));
  pl->add_option("--inter-node-gbps", plan_inter_gbps,
                 "between nodes, Gbit/s a device (default 400: one NIC a GPU; CPU: 10)")
      ->check(CLI::Range(0.001, 1e9));
  pl->add_option("--efficiency", plan.options.efficiency, "of the peak the kernels reach (MFU)")
      ->check(CLI::Range(0.01, 1.0))
      ->capture_default_str();
  pl->add_flag("--explain", plan.explain, "say why the other layouts were dropped");
  pl->add_option("--set", plan.overrides, "override the config: section.key=value")->take_all();

  trainer::EvalOptions eval;
  auto* ev = app.add_subcommand("eval", "loss and perplexity of a checkpoint on a data set");
  ev->add_option("--checkpoint", eval.checkpoint, "checkpoint or run directory")->required();
  ev->add_option("--data", eval.data, "token shards (default: the run's validation set)");
  ev->add_option("--batches", eval.batches,
                 "micro-batches of windows spread over the data (default: the run's "
                 "val_batches)")
      ->check(CLI::Range(1, 1 << 24));
  ev->add_option("--choices", eval.choices,
                 "multiple-choice accuracy on HellaSwag-style JSON Lines (ctx, endings, label) "
                 "instead of the loss");
  ev->add_option("--set", eval.overrides,
                 "override the run's config: section.key=value (the layout, micro_batch, ...)")
      ->take_all();

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    fmt::print(stderr, "trainer: error: {} (see trainer --help)\n", e.what());
    return trainer::kExitBadInput;
  }

  if (*train || *ev) {
    if (*train) trainer::catch_stop_signals();
    // Under mpirun every process is a rank of one world; a plain process is a world of one.
    std::unique_ptr<trainer::World> world = trainer::make_mpi_world(&argc, &argv);
    try {
      return *train ? trainer::train(config_path, overrides, *world, dry_run)
                    : trainer::evaluate(eval, *world);
    } catch (...) {
      // An error that not every rank shares (they agree on set-up errors inside train()):
      // the other ranks may be waiting for this one, so end them all.
      const int code = trainer::report_error(std::current_exception());
      if (world->size() > 1) world->abort(code);
      return code;
    }
  }
  try {
    if (*gen) return generate(checkpoint, prompt, prompt_option->count() > 0, tokens, sample);
    if (*ex) return trainer::export_weights(exp);
    if (*pl) {
      const trainer::Config cfg = trainer::load_config(plan.config, plan.overrides);
      // A CPU plan under mpirun times an all-reduce among the node's ranks for the bandwidth
      // inside a node (a plain process has none to time); then rank 0 plans, the rest wait in
      // MPI's finalisation.
      std::unique_ptr<trainer::World> world;
      double measured_gbps = 0;
      if (cfg.run.device == "cpu" && plan_device.empty() && plan_intra_gbps <= 0) {
        world = trainer::make_mpi_world(&argc, &argv);
        if (world->size() > 1) {
          measured_gbps = trainer::all_reduce_gbps(*trainer::node_group(*world), world->comm());
          if (plan_per_node <= 0) plan_per_node = world->local_size();
          if (plan_per_node != world->local_size()) measured_gbps = 0;  // not these nodes
        }
        if (world->rank() > 0) return 0;
      }
      trainer::Cluster& k = plan.options.cluster;
      trainer::set_cluster_defaults(k, cfg, plan_device, plan_per_node, plan_memory_gb,
                                    plan_intra_gbps, plan_inter_gbps, measured_gbps);
      return trainer::plan_command(plan);
    }
    if (*pre) {
      // The [tokenizer] of --config, the flags on top, checked by the config's own rules.
      std::vector<std::string> set;
      auto quoted = [](const std::string& v) {  // a TOML basic string
        std::string q = "\"";
        for (char c : v) q += c == '"' || c == '\\' ? std::string("\\") + c : std::string(1, c);
        return q + "\"";
      };
      if (!prep_kind.empty()) set.push_back("tokenizer.kind=" + quoted(prep_kind));
      if (!prep_path.empty()) set.push_back("tokenizer.path=" + quoted(prep_path));
      if (!prep_pattern.empty()) set.push_back("tokenizer.pattern=" + quoted(prep_pattern));
      prep.tokenizer = trainer::load_config(prep_config, set).tokenizer;
      prep.format = prep_format == "text"    ? trainer::InputFormat::kText
                    : prep_format == "jsonl" ? trainer::InputFormat::kJsonl
                                             : trainer::InputFormat::kAuto;
      return trainer::prepare(prep);
    }
  } catch (...) {
    return trainer::report_error(std::current_exception());
  }
  return 0;
}
