#pragma once
// One TOML file drives a run. Each section maps to a typed struct with defaults; unknown keys,
// wrong types and out-of-range values are ConfigErrors that name file:line:column and the key.
#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "io/errors.h"
#include "model/model_config.h"

namespace trainer {

struct RunConfig {
  std::string name = "default";
  std::string out_dir = "runs/default";  // metrics.jsonl, config.toml, checkpoints/
  // A fresh run into an out_dir that holds another run's files is an error unless this removes
  // them first (trainer/run_dir.h).
  bool overwrite = false;
  uint64_t seed = 1337;                  // init and data order
  std::string device = "cpu";            // cpu | cuda (one GPU per rank, by node-local rank)
  double gpu_memory_fraction = 0.9;      // of a GPU's free memory, reserved at start-up
  std::string gpu_collectives = "auto";  // nccl | mpi (staged through host memory) | auto
  int threads = 0;                       // OpenMP/OpenBLAS threads; 0 = all cores
  double peak_tflops = 0;                // MFU peak per rank; 0 = the data sheet, or measured (CPU)
  bool phase_timing =
      false;  // a GPU: wait after each micro-batch's forward and backward to time them
};

// [[data.sources]]: one training source of a blend (io/blend.h).
struct DataSource {
  std::vector<std::string> path;  // token shards, globs
  double weight = 1;              // > 0; the weights are normalised to sum to 1
  bool operator==(const DataSource&) const = default;
};

struct DataConfig {
  std::vector<std::string> train = {"data/austen/train.bin"};  // token shards
  std::vector<std::string> val = {"data/austen/val.bin"};
  std::vector<DataSource> sources;  // a blend instead of `train` (which is then unset)
  int prefetch = 4;                 // micro-batches ready ahead of the step
  // Where zstd-compressed shards are kept decompressed between runs, verified by hash on every
  // use (a local disk; "" = decompress into a temporary file each run).
  std::string cache_dir;
  // "auto": each shard's magic says its layout (ours or llm.c); "nanogpt": headerless uint16
  // files, which have no magic to recognise (io/token_shard.h).
  std::string format = "auto";
};

// The training sources: [[data.sources]], or `train` as the one source.
std::vector<DataSource> training_sources(const DataConfig& d);

// [tokenizer]: how text becomes tokens (io/tokenizer.h): for `prepare`, for the in-training
// samples, and stored in every checkpoint for `generate`. Shards record the tokenizer they were
// prepared with, and a run refuses shards of another.
struct TokenizerConfig {
  std::string kind = "bytes";  // bytes | gpt2 | tiktoken | sentencepiece
  // gpt2: the directory of encoder.json and vocab.bpe (or the encoder.json); tiktoken: a .tiktoken
  // rank file; sentencepiece: a .model file
  std::string path;
  std::string pattern;  // tiktoken's pre-tokenisation: gpt2 | cl100k | llama3
};

// "bytes", "gpt2 (dir)", "tiktoken cl100k (file)": a tokenizer in messages.
std::string tokenizer_name(const TokenizerConfig& t);

struct TrainConfig {
  int micro_batch = 8;  // sequences per forward/backward
  int grad_accum = 1;   // micro-batches per optimizer step
  // A global batch that grows (Megatron's rampup-batch-size): rows {at, sequences per global
  // batch}, `at` in steps or tokens (batch_ramp_unit) and starting at 0; each step accumulates
  // sequences / (micro_batch x dp) micro-batches. Empty: grad_accum throughout.
  std::vector<std::array<int64_t, 2>> batch_ramp;
  std::string batch_ramp_unit = "steps";  // steps | tokens (seen, the data position x seq_len)
  int steps = 500;
  int log_every = 1;
  int val_every = 100;  // 0 = never
  int val_batches = 8;
  int sample_every = 100;  // 0 = never
  int sample_tokens = 200;
  std::string sample_prompt = "\n";
  double sample_temperature = 1.0;
  int sample_top_k = 0;  // 0 = full distribution
};

struct OptimConfig {
  // adamw | sgd (momentum SGD with decoupled weight decay: m = momentum m + g,
  // w -= lr (m + weight_decay w); the moments' second buffer is unused) | onebit_adam (1-bit
  // Adam, Tang et al. 2021: AdamW for freeze_step steps, then v frozen and the momentum, not
  // the gradient, exchanged across the data-parallel ranks in 1 bit with error feedback) |
  // dgc_adam (Deep Gradient Compression, Lin et al. 2018, on AdamW with v frozen as 1-bit
  // Adam's: each rank's own momentum accumulated and its dgc_ratio largest values exchanged)
  std::string name = "adamw";
  int freeze_step = 100;      // onebit_adam, dgc_adam: the updates of the warm-up, v then frozen
  double dgc_ratio = 0.01;    // dgc_adam: the fraction of the values sent
  int dgc_warmup_steps = 50;  // dgc_adam: 25% sent at freeze_step, down to dgc_ratio by then
  bool dgc_masking = true;    // dgc_adam: momentum factor masking
  // 1-bit Adam and DGC exchange momentum, not gradients, after freeze_step (v frozen then).
  bool exchanges_momentum() const { return name == "onebit_adam" || name == "dgc_adam"; }
  double lr = 3e-4;
  double min_lr = 0.0;
  std::array<double, 2> betas = {0.9, 0.95};
  double eps = 1e-8;
  double momentum = 0;  // sgd
  double weight_decay = 0.1;
  double max_grad_norm = 1.0;  // 0 = no clipping
  int warmup_steps = 0;
  std::string schedule = "cosine";  // decay after warm-up: cosine | linear | constant
  bool decay_embeddings = false;
  bool decay_norms_and_biases = false;
};

// How the job's processes split the work (see comm/parallel_dims.h). dp x cp x tp x pp must be
// the world size; dp = 0 derives it.
struct ParallelConfig {
  int dp = 0;
  int tp = 1;
  int pp = 1;
  std::string order = "tp-pp-dp";  // fastest- to slowest-varying rank
  int micro_batches = 0;           // per step and pipeline; 0 = train.grad_accum
  // 1: shard the optimizer state across the data-parallel ranks (ZeRO-1); 2: and the gradients,
  // reduce-scattered unit by unit in every backward, with no flat gradient buffer (ZeRO-2); 3:
  // and the parameters, each unit's gathered just before it runs (ZeRO-3, FSDP)
  int zero = 0;
  double bucket_mb = 25;           // gradient all-reduce bucket size
  bool overlap = true;             // reduce buckets while backward goes on
  std::string allreduce = "flat";  // flat | hierarchical (inside nodes first)
  int ranks_per_node = 0;          // hierarchical node grouping; 0 = detect
  // Megatron's sequence parallelism with tp > 1: norms, dropout and the residual stream hold
  // 1/tp of the rows; all-gather / reduce-scatter instead of the all-reduces
  bool sequence_parallel = false;
  // Context parallelism (ring attention, model/context_parallel.h): each sequence's tokens split
  // over cp ranks, for sequences too long for one rank's memory. CPU backend only for now.
  int cp = 1;
};

// Mixed precision: weights (the compute copy), activations and, optionally, gradients stored in
// bf16 or fp16; fp32 master weights and AdamW state. fp16 scales the loss dynamically.
struct PrecisionConfig {
  std::string compute = "fp32";  // fp32 | bf16 | fp16
  std::string grads = "fp32";    // fp32 | compute (the compute dtype)
  double loss_scale = 0;         // fp16: > 0 a static scale; 0 = dynamic
  double initial_scale = 65536;
  double growth_factor = 2;
  double backoff_factor = 0.5;
  int growth_interval = 1000;  // steps without overflow before the scale grows
  int hysteresis = 1;          // overflows in a row before the scale backs off
  double min_scale = 1;
  int max_min_scale_overflows = 10;  // overflows in a row at min_scale: training has diverged
  bool stochastic_rounding = false;  // bf16: master -> compute copy rounded stochastically
};

// [comm.compression]: lossy data-parallel gradient reduction (see comm/compression.h).
struct CompressionConfig {
  // none | fp16 | bf16 | int8 | onebit | topk | powersgd | auto ([comm] budget_ms)
  std::string method = "none";
  double topk_ratio = 0.01;
  int powersgd_rank = 4;
  double powersgd_budget = 0;  // > 0: each matrix's rank from it (comm/compression.h)
  // int8 and onebit among more than two ranks: in two phases (2 (p - 1) / p messages a rank),
  // or (false) all-gathered, exact sums of the messages at p - 1 messages a rank.
  bool two_phase = true;
  bool error_feedback = true;
  int warmup_steps = 0;      // uncompressed steps first
  double min_bucket_kb = 0;  // smaller buckets go uncompressed
  bool operator==(const CompressionConfig&) const = default;
};
// [comm.outer]: DiLoCo / local SGD across nodes (trainer/outer_optimizer.h). Inside each node
// the steps are the usual synchronous data-parallel ones; every `every_steps` steps the nodes
// average how far they moved (the pseudo-gradient) and take an outer SGD step on it.
struct OuterConfig {
  int every_steps = 0;  // H, inner steps between outer steps; 0 = off
  double lr = 0.7;      // DiLoCo's outer learning rate and Nesterov momentum
  double momentum = 0.9;
  bool nesterov = true;
  std::string quantize = "none";  // none | int8: the pseudo-gradient, with error feedback
  bool on() const { return every_steps > 0; }
  bool operator==(const OuterConfig&) const = default;
};
struct CommConfig {
  CompressionConfig compression;
  OuterConfig outer;
  // A budget of inter-node communication exposed per step (ms; 0 = none): the start-up report
  // says which way of crossing nodes keeps within it, and compression.method = "auto" takes it
  // (trainer/comm_budget.h). The inter-node bandwidth: measured at start-up when 0.
  double budget_ms = 0;
  double inter_node_gbps = 0;
};

// [checkpoint]: when checkpoints are written, where, how many are kept, and where a run starts.
struct CheckpointConfig {
  // every_steps = "auto": the Young/Daly interval, from the measured checkpoint stall, the
  // step time and mtbf_hours.
  static constexpr int kAutoSteps = -1;
  int every_steps = 0;       // 0 = only at the end (and on SIGTERM/SIGUSR1); kAutoSteps
  double every_minutes = 0;  // also after this much wall time since the last one; 0 = off
  int keep_last = 0;         // older complete checkpoints are deleted; 0 = keep all
  bool async = true;         // a writer thread does the I/O while training goes on
  std::string dir;           // "" = <run.out_dir>/checkpoints
  // The cluster's mean time between failures (of the job: any of its nodes), in hours: the
  // Young/Daly checkpoint interval is advised from it (0 = no advice).
  double mtbf_hours = 0;
  // A protective checkpoint: the first bad step after good ones (skipped, so the weights are
  // still the last good state) writes one, unless a checkpoint is newer than protect_min_steps,
  // so that a rollback after more bad steps loses little.
  bool protect = true;
  int protect_min_steps = 10;
  // "none": a fresh start (into an out_dir without another run, unless run.overwrite); "auto":
  // the checkpoint `latest` names in dir, or the newest older one when it does not verify, or a
  // fresh start when there is none; else a checkpoint path (step directory, run directory or
  // state.h5).
  std::string resume = "none";
};

// [faults]: what a bad step does, and how long a collective may block.
struct FaultsConfig {
  double spike_zscore = 0;  // a loss or grad norm this many deviations above the window: bad
  int spike_window = 50;    // recent good steps the z-score is measured against
  int max_bad_steps = 3;    // bad (non-finite or spiking) steps in a row before a rollback
  bool skip_data_on_rollback = false;  // after a rollback, skip the offending window's batches
  double collective_timeout_s = 0;     // a collective blocked longer ends the job; 0 = never
  double checkpoint_timeout_s = 0;     // the same for waiting on a checkpoint write
};

// [memory]: what is kept from forward to backward (model/stage_executor.h, Recompute).
struct MemoryConfig {
  std::string recompute = "none";  // none | selective | full
  int recompute_layers = 0;        // the first N blocks of each pipeline stage; 0 = all
  // AdamW's fp32 master weights and moments in host memory, updated on CPU threads segment by
  // segment while the next segment's gradients come over (trainer/adamw.h)
  bool offload_optimizer = false;
};

// [init]: where a fresh run's weights come from.
struct InitConfig {
  // "" = random (GPT-2's init from run.seed); else a checkpoint (step directory, run directory
  // or state.h5) whose weights a fresh run starts from, in any layout or precision: a warm start
  // or fine-tuning. The optimizer state, the step, the schedule and the data order start fresh.
  // A run that resumes from a checkpoint of its own ignores it.
  std::string from;
};

// [profile]: the steps whose every phase, layer and timed operator is traced (trainer/trace.h).
struct ProfileConfig {
  std::array<int64_t, 2> steps = {-1, -1};  // [first, last], inclusive; -1: no profile
  bool on() const { return steps[0] >= 0; }
};

struct Config {
  RunConfig run;
  InitConfig init;
  ModelConfig model;
  DataConfig data;
  TokenizerConfig tokenizer;
  TrainConfig train;
  OptimConfig optim;
  ParallelConfig parallel;
  MemoryConfig memory;
  PrecisionConfig precision;
  CommConfig comm;
  CheckpointConfig checkpoint;
  FaultsConfig faults;
  ProfileConfig profile;
};

// Reads `path` (empty: defaults only) and applies `overrides` ("section.key=value", TOML
// values; a value that is not valid TOML is taken as a string). Throws ConfigError.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});
// Parses TOML text; `origin` names it in error messages.
Config parse_config(const std::string& text, const std::string& origin,
                    const std::vector<std::string>& overrides = {});

// The fully resolved config as TOML: every key, defaults included.
std::string config_to_toml(const Config& cfg);

}  // namespace trainer
