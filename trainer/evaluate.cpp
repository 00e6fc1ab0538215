#include <fmt/format.h>
#include <omp.h>

#include <cmath>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>

#include "trainer/checkpoint.h"
#include "trainer/device.h"
#include "trainer/run.h"
#include "trainer/train.h"

namespace trainer {
namespace {

// One multiple-choice example: the context's tokens, each ending's, and the right ending.
struct Choice {
  std::vector<int32_t> context;
  std::vector<std::vector<int32_t>> endings;
  int label = -1;
};

// HellaSwag's JSON Lines, tokenized (each ending after a space, as llm.c's evaluation does);
// a context too long for an ending to fit in seq_len + 1 tokens loses its first tokens.
std::vector<Choice> read_choices(const std::string& file, const std::string& text,
                                 const Tokenizer& tokenizer, int T) {
  std::istringstream in(text);
  std::vector<Choice> out;
  int line_no = 0;
  for (std::string line; std::getline(in, line);) {
    line_no++;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto bad = [&](const std::string& what) {
      return DataError(fmt::format("{}:{}: {}", file, line_no, what));
    };
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception&) {
      throw bad("not a JSON object");
    }
    if (!j.is_object() || !j.contains("ctx") || !j["ctx"].is_string() || !j.contains("endings") ||
        !j["endings"].is_array() || j["endings"].size() < 2 || !j.contains("label") ||
        !j["label"].is_number_integer())
      throw bad("expected {\"ctx\": string, \"endings\": [2 or more strings], \"label\": index}");
    Choice c;
    c.context = tokenizer.encode(j["ctx"].get<std::string>());
    for (const auto& e : j["endings"]) {
      if (!e.is_string()) throw bad("an ending that is not a string");
      std::string ending = e.get<std::string>();
      ending.insert(ending.begin(), ' ');  // (not " " + ...: GCC 12's -Wrestrict misfires)
      c.endings.push_back(tokenizer.encode(ending));
      if (c.endings.back().empty() || int(c.endings.back().size()) > T)
        throw bad(
            fmt::format("an ending of {} tokens (1 to seq_len = {})", c.endings.back().size(), T));
    }
    const int64_t label = j["label"].get<int64_t>();
    if (label < 0 || label >= int64_t(c.endings.size()))
      throw bad(fmt::format("label {} of {} endings", label, c.endings.size()));
    c.label = int(label);
    if (c.context.empty()) throw bad("an empty context");
    out.push_back(std::move(c));
  }
  if (out.empty()) throw DataError(fmt::format("{}: no examples", file));
  return out;
}

// Each data-parallel replica scores its share of the examples (every rank of it takes part in
// the forwards); the counts are summed over the world from one rank of each replica.
int score_choices(Run& run, const std::string& file, const std::string& state) {
  const int T = run.cfg.model.seq_len;
  // Rank 0's copy for every rank: ranks that disagreed on the examples would not join the same
  // forwards.
  std::string text;
  if (run.world.rank() == 0) {
    std::ifstream in(file, std::ios::binary);
    text = in ? std::string((std::istreambuf_iterator<char>(in)), {}) : std::string("\x01");
  }
  broadcast_string(run.world.comm(), text, 0);
  if (text == "\x01") throw DataError(fmt::format("{}: cannot read", file));
  const std::vector<Choice> choices = read_choices(file, text, *run.tokenizer, T);
  // Sequence parallelism splits a batch's rows over tp, context parallelism each sequence into
  // 2 cp chunks: each sequence is padded at its end to a multiple of both (attention is causal:
  // padding changes no earlier position's loss), its context cut from the front where that
  // would pass the longest multiple in T.
  const int cp = run.dims.cp();
  const int multiple =
      (cp > 1 ? 2 * cp : 1) * (run.model.shard().sequence_parallel ? run.dims.tp() : 1);
  const int limit = T / multiple * multiple;
  const auto t0 = Clock::now();
  double counts[3] = {0, 0, 0};  // right by mean loss, right by total loss, examples
  for (size_t i = size_t(run.me.dp); i < choices.size(); i += size_t(run.dims.dp())) {
    const Choice& c = choices[i];
    double best_mean = INFINITY, best_sum = INFINITY;
    int by_mean = -1, by_sum = -1;
    for (size_t e = 0; e < c.endings.size(); e++) {
      std::vector<int32_t> seq = c.context;
      seq.insert(seq.end(), c.endings[e].begin(), c.endings[e].end());
      if (int(seq.size()) > limit + 1) seq.erase(seq.begin(), seq.end() - (limit + 1));
      const int n = int(seq.size()) - 1, first = n - int(c.endings[e].size());
      const int padded = (n + multiple - 1) / multiple * multiple;
      std::vector<int32_t> inputs(seq.begin(), seq.end() - 1), targets(seq.begin() + 1, seq.end());
      inputs.resize(size_t(padded), 0);
      targets.resize(size_t(padded), 0);
      const std::vector<float> losses =
          run.pipe.token_losses(inputs.data(), targets.data(), 1, padded);
      double sum = 0;
      for (int t = first; t < n; t++) sum += losses[t];
      const double mean = sum / (n - first);
      if (mean < best_mean) best_mean = mean, by_mean = int(e);
      if (sum < best_sum) best_sum = sum, by_sum = int(e);
    }
    if (run.me.tp == 0 && run.me.pp == 0 && run.me.cp == 0) {
      counts[0] += by_mean == c.label;
      counts[1] += by_sum == c.label;
      counts[2] += 1;
    }
  }
  run.world.comm().all_reduce(host_ptr(counts), 3, ReduceOp::sum);
  if (run.world.rank() == 0)
    fmt::print(
        "eval: acc_norm {:.4f} (lowest mean loss), acc {:.4f} (lowest total) on {} examples of "
        "{} (weights of step {} from {}; {:.1f} s)\n",
        counts[0] / counts[2], counts[1] / counts[2], int64_t(counts[2]), file,
        checkpoint_step(state), state, std::chrono::duration<double>(Clock::now() - t0).count());
  return 0;
}

}  // namespace

int evaluate(const EvalOptions& opts, World& world) {
  Config cfg;
  std::string state;
  NodePeers node = node_peers(world);
  if (auto failed = agree_on_setup(world, [&] {
        state = resolve_checkpoint(opts.checkpoint);
        // The checkpoint's run in the default layout (data parallel over the world), with the
        // command line's settings on top.
        Config run_cfg = checkpoint_config(state);
        run_cfg.parallel = ParallelConfig{};
        cfg = parse_config(config_to_toml(run_cfg), state, opts.overrides);
        if (!opts.data.empty()) cfg.data.val = {opts.data};
        cfg.data.train = cfg.data.val;  // nothing is trained: no training data is needed
        cfg.data.sources.clear();
        cfg.train.batch_ramp.clear();
        if (opts.batches > 0) cfg.train.val_batches = opts.batches;
        check_weights(state, cfg.model);
        omp_set_num_threads(threads_per_rank(cfg.run.threads, node.core_share));
      }))
    return *failed;
  GpuPlacement placement;
  std::unique_ptr<Kernels> kernels;
  std::unique_ptr<Run> run_ptr;
  const std::string origin = "trainer eval --checkpoint " + opts.checkpoint;
  if (auto failed = agree_on_setup(world, [&] {
        placement = place_on_gpus(cfg, world, origin);
        kernels = make_kernels(cfg, placement);
      }))
    return *failed;
  if (auto failed = agree_on_setup(world, [&] {
        run_ptr = std::make_unique<Run>(cfg, world, origin, placement, std::move(kernels),
                                        std::move(node));
        load_weights(state, run_ptr->model, &run_ptr->optimizer);
      }))
    return *failed;
  Run& run = *run_ptr;
  const auto t0 = Clock::now();
  if (!opts.choices.empty()) return score_choices(run, opts.choices, state);
  const double loss = validation_loss(run);
  if (world.rank() == 0)
    fmt::print(
        "eval: loss {:.6f}, perplexity {:.3f} on {} windows of {} tokens of {} (weights of step "
        "{} from {}; {} s)\n",
        loss, std::exp(loss), int64_t(cfg.train.val_batches) * cfg.train.micro_batch,
        cfg.model.seq_len, fmt::join(cfg.data.val, ", "), checkpoint_step(state), state,
        fmt::format("{:.1f}", std::chrono::duration<double>(Clock::now() - t0).count()));
  return 0;
}

}  // namespace trainer
