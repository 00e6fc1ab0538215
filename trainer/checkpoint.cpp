#include "trainer/checkpoint.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <sstream>
#include <thread>

#include "comm/mpi_comm.h"
#include "io/atomic_file.h"
#include "io/hdf5_file.h"
#include "io/safetensors.h"
#include "trainer/hf_format.h"
#include "trainer/llmc_format.h"
#include "trainer/weight_import.h"

namespace fs = std::filesystem;

namespace trainer {
namespace {

// The model's dimensions, stored as attributes (and covered by meta_hash) so that a checkpoint
// of another model is recognised before any tensor is read. Version 4 added the architecture's
// (for a version 3 checkpoint, GPT-2's values: kv heads = heads, MLP 4 C, tied head, biases).
struct ModelDim {
  const char* name;
  int64_t (*of)(const ModelConfig&);
  int64_t lo = 1, hi = 1 << 24;  // the values a checkpoint may hold
};
constexpr ModelDim kDims[] = {
    {"vocab_size", [](const ModelConfig& m) -> int64_t { return m.vocab_size; }},
    {"seq_len", [](const ModelConfig& m) -> int64_t { return m.seq_len; }},
    {"n_layer", [](const ModelConfig& m) -> int64_t { return m.n_layer; }},
    {"n_head", [](const ModelConfig& m) -> int64_t { return m.n_head; }},
    {"d_model", [](const ModelConfig& m) -> int64_t { return m.d_model; }},
    {"n_kv_head", [](const ModelConfig& m) -> int64_t { return m.kv_heads(); }},
    {"ffn_hidden", [](const ModelConfig& m) -> int64_t { return m.ffn(); }},
    {"tie_embeddings", [](const ModelConfig& m) -> int64_t { return m.tie_embeddings; }, 0, 1},
    {"bias", [](const ModelConfig& m) -> int64_t { return m.bias; }, 0, 1}};
constexpr size_t kDimsBefore4 = 5;
constexpr int64_t kArchVersion = 4;

struct StoredModel {
  std::string arch = "gpt2";
  int64_t dims[std::size(kDims)] = {};
};

// FNV-1a, 64 bits, as hex: a stored config text that does not match its hash was damaged.
std::string text_hash(const std::string& text) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return fmt::format("{:016x}", h);
}

std::string step_name(int64_t step) {
  return fmt::format("step_{:08d}", step);
}

// A step directory's name: step_ and eight or more digits (nothing else: no path).
bool is_step_name(const std::string& name) {
  return name.size() >= 13 && name.starts_with("step_") &&
         std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The complete checkpoints in dir, newest first: real directories named like a step (not a
// symlink to another run's, not a temporary).
std::vector<std::string> complete_checkpoints(const fs::path& root) {
  std::vector<std::string> steps;
  if (!fs::is_directory(root)) return steps;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    if (e.is_directory() && !e.is_symlink() && is_step_name(name)) steps.push_back(name);
  }
  std::sort(steps.rbegin(), steps.rend());  // zero-padded: newest first
  return steps;
}

// After a step every rank may have failed at: the first failing rank's message on every rank
// ("" when none failed).
std::string agree_on_error(Communicator* comm, std::string error) {
  if (!comm || comm->size() == 1) return error;
  const int root = first_failing_rank(*comm, !error.empty());
  if (root < 0) return "";
  broadcast_string(*comm, error, root);
  return root != comm->rank() ? fmt::format("rank {}: {}", root, error) : error;
}

// Test hook: TRAINER_TEST_WRITE_DELAY="step,seconds" stalls the writing of that step's
// checkpoint half-way (after the parameters), so that a test can kill the process mid-write.
void test_write_delay(int64_t step) {
  const char* spec = std::getenv("TRAINER_TEST_WRITE_DELAY");
  long long at = -1;
  double seconds = 0;
  if (spec && std::sscanf(spec, "%lld,%lf", &at, &seconds) == 2 && at == step)
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
}

// Another model is not damage: it is the config that does not fit (exit 2 all the same, but
// resume = "auto" stops there instead of passing over every checkpoint of the run).
StoredModel stored_model(const H5File& f, int64_t version) {
  StoredModel m;
  const bool v4 = version >= kArchVersion;
  for (size_t i = 0; i < (v4 ? std::size(kDims) : kDimsBefore4); i++)
    m.dims[i] = f.attr_int(kDims[i].name);
  if (v4) {
    m.arch = f.attr_string("arch");
    return m;
  }
  // GPT-2, the only architecture before version 4: the rest are its values for these sizes.
  ModelConfig gpt2;
  gpt2.n_head = int(m.dims[3]);
  gpt2.d_model = int(m.dims[4]);
  for (size_t i = kDimsBefore4; i < std::size(kDims); i++) m.dims[i] = kDims[i].of(gpt2);
  return m;
}

void check_dims(const H5File& f, const std::string& state_file, const ModelConfig& model) {
  const StoredModel stored = stored_model(f, check_version(f, state_file));
  const auto mismatch = [&](const std::string& name, const std::string& saved,
                            const std::string& ours) {
    throw ConfigError(fmt::format(
        "{}: the checkpoint is of a model with [model] {} = {}, this run's config has {} = {}: "
        "resume with the model it was trained with, or start a fresh run in another out_dir",
        state_file, name, saved, name, ours));
  };
  if (stored.arch != arch_name(model.arch))
    mismatch("arch", "\"" + stored.arch + "\"", fmt::format("\"{}\"", arch_name(model.arch)));
  for (size_t i = 0; i < std::size(kDims); i++) {
    const int64_t saved = stored.dims[i], ours = kDims[i].of(model);
    if (saved != ours) mismatch(kDims[i].name, std::to_string(saved), std::to_string(ours));
  }
}

// Everything a checkpoint's attributes say besides the config text (covered by config_hash),
// one "name=value" line each in a fixed order: the text meta_hash is the hash of, so that an
// edited or bit-flipped attribute makes the checkpoint unusable.
struct Meta {
  int64_t version = kCheckpointFormatVersion, seed = 0;
  std::string config_hash;
  StoredModel model;
  TrainState state;
};

std::string meta_text(const Meta& m) {
  std::string t;
  auto add = [&](std::string_view name, const auto& value) {
    t += fmt::format("{}={}\n", name, value);
  };
  const TrainState& s = m.state;
  add("format_version", m.version);
  add("step", s.step);
  add("tokens", s.tokens);
  add("data_samples", s.data_samples);
  add("data_skipped", s.data_skipped);
  if (!s.blend.weights.empty()) {  // only with a blend: older checkpoints keep their hash
    add("data_blend_weights", fmt::format("{}", fmt::join(s.blend.weights, ",")));
    add("data_blend_start", s.blend.start);
    add("data_blend_base", fmt::format("{}", fmt::join(s.blend.base, ",")));
    add("data_source_samples", fmt::format("{}", fmt::join(s.source_samples, ",")));
  }
  add("config_hash", m.config_hash);
  const bool v4 = m.version >= kArchVersion;
  for (size_t i = 0; i < (v4 ? std::size(kDims) : kDimsBefore4); i++)
    add(kDims[i].name, m.model.dims[i]);
  if (v4) add("arch", m.model.arch);
  add("loss_scale", s.scaler.scale);
  add("loss_scale_clean_steps", s.scaler.clean_steps);
  add("loss_scale_hysteresis_left", s.scaler.hysteresis_left);
  add("loss_scale_min_scale_overflows", s.scaler.min_scale_overflows);
  add("loss_scale_overflows", s.scaler.overflows);
  add("layout_world", s.layout.world);
  add("layout_dp", s.layout.dp);
  add("layout_tp", s.layout.tp);
  add("layout_pp", s.layout.pp);
  if (s.layout.cp > 1) add("layout_cp", s.layout.cp);
  add("layout_zero", s.layout.zero);
  add("layout_order", s.layout.order);
  add("rng_seed", m.seed);
  add("recent_losses", fmt::format("{}", fmt::join(s.recent_losses, ",")));
  add("recent_norms", fmt::format("{}", fmt::join(s.recent_norms, ",")));
  return t;
}

// A blend's attributes: one weight, base and position per source, the weights > 0 summing to 1,
// and the positions accounting for exactly the samples since the plan's start.
template <class Bad>
void read_blend(const H5File& f, TrainState& s, Bad bad) {
  BlendPlan& b = s.blend;
  b.weights = f.attr_doubles("data_blend_weights");
  b.start = f.attr_int("data_blend_start");
  b.base = f.attr_ints("data_blend_base");
  s.source_samples = f.attr_ints("data_source_samples");
  const size_t n = b.weights.size();
  if (n < 2 || n > 4096) bad("data_blend_weights", fmt::format("[{} values]", n), "2 to 4096");
  double sum = 0;
  for (double w : b.weights) {
    if (!(w > 0 && w <= 1)) bad("data_blend_weights", fmt::format("[... {} ...]", w), "(0, 1]");
    sum += w;
  }
  if (std::abs(sum - 1) > 1e-9) bad("data_blend_weights", fmt::format("summing to {}", sum), "1");
  if (b.start < 0 || b.start > s.data_samples)
    bad("data_blend_start", std::to_string(b.start), fmt::format("0 to {}", s.data_samples));
  for (const auto& [name, values] :
       {std::pair{"data_blend_base", &b.base}, std::pair{"data_source_samples", &s.source_samples}})
    if (values->size() != n)
      bad(name, fmt::format("[{} values]", values->size()), fmt::format("one per source, {}", n));
  constexpr int64_t kMax = int64_t(1) << 50;
  int64_t since = 0;
  for (size_t k = 0; k < n; k++) {
    if (b.base[k] < 0 || b.base[k] > kMax)
      bad("data_blend_base", std::to_string(b.base[k]), fmt::format("0 to {}", kMax));
    if (s.source_samples[k] < b.base[k] || s.source_samples[k] > kMax)
      bad("data_source_samples", std::to_string(s.source_samples[k]),
          fmt::format("source {}'s position, {} (its base) to {}", k, b.base[k], kMax));
    since += s.source_samples[k] - b.base[k];
  }
  if (since != s.data_samples - b.start)
    bad("data_source_samples", fmt::format("{} samples since the blend's start", since),
        fmt::format("data_samples - data_blend_start = {}", s.data_samples - b.start));
}

// Reads every attribute of a checkpoint besides the config, checks each against its range and
// the others, and (version 3) against meta_hash. Throws CheckpointError naming the attribute.
Meta read_meta(const H5File& f, const std::string& file) {
  Meta m;
  m.version = check_version(f, file);
  auto bad = [&](const std::string& name, const std::string& value, const std::string& expected) {
    throw CheckpointError(fmt::format("{}: attribute {} = {} out of range (expected {})", file,
                                      name, value, expected));
  };
  // An integer attribute within [lo, hi].
  auto integer = [&](const char* name, int64_t lo, int64_t hi) {
    const int64_t v = f.attr_int(name);
    if (v < lo || v > hi) bad(name, std::to_string(v), fmt::format("{} to {}", lo, hi));
    return v;
  };
  constexpr int64_t kMax = int64_t(1) << 50;  // far beyond any run, far from overflow
  TrainState& s = m.state;
  s.step = integer("step", 0, kMax);
  s.data_samples = integer("data_samples", s.step, kMax);  // a step takes at least one sample
  s.data_skipped = integer("data_skipped", 0, s.data_samples);
  if (f.exists_attr("data_blend_weights")) read_blend(f, s, bad);
  for (size_t i = 0; i < (m.version >= kArchVersion ? std::size(kDims) : kDimsBefore4); i++)
    integer(kDims[i].name, kDims[i].lo, kDims[i].hi);
  m.model = stored_model(f, m.version);
  if (m.model.arch != "gpt2" && m.model.arch != "llama")
    bad("arch", "\"" + m.model.arch + "\"", "\"gpt2\" or \"llama\"");
  const int64_t T = m.model.dims[1];
  s.tokens = f.attr_int("tokens");
  if (s.tokens != (s.data_samples - s.data_skipped) * T)
    bad("tokens", std::to_string(s.tokens),
        fmt::format("(data_samples - data_skipped) x seq_len = {}",
                    (s.data_samples - s.data_skipped) * T));
  m.config_hash = f.attr_string("config_hash");
  s.scaler.scale = f.attr_double("loss_scale");
  if (!std::isfinite(s.scaler.scale) || s.scaler.scale <= 0 || s.scaler.scale > 1e38)
    bad("loss_scale", fmt::format("{}", s.scaler.scale), "a finite scale > 0");
  s.scaler.clean_steps = integer("loss_scale_clean_steps", 0, kMax);
  s.scaler.hysteresis_left = integer("loss_scale_hysteresis_left", 0, kMax);
  s.scaler.min_scale_overflows = integer("loss_scale_min_scale_overflows", 0, kMax);
  s.scaler.overflows = integer("loss_scale_overflows", 0, kMax);
  Layout& l = s.layout;
  l.world = int(integer("layout_world", 1, 1 << 24));
  l.dp = int(integer("layout_dp", 1, l.world));
  l.tp = int(integer("layout_tp", 1, l.world));
  l.pp = int(integer("layout_pp", 1, l.world));
  if (f.exists_attr("layout_cp")) l.cp = int(integer("layout_cp", 2, l.world));
  if (int64_t(l.dp) * l.cp * l.tp * l.pp != l.world)
    bad("layout_world", std::to_string(l.world),
        fmt::format("layout_dp x layout_cp x layout_tp x layout_pp = {}",
                    int64_t(l.dp) * l.cp * l.tp * l.pp));
  l.zero = int(integer("layout_zero", 0, 3));
  l.order = f.attr_string("layout_order");
  {
    std::string parts = l.order;
    for (char& c : parts) c = c == '-' ? ' ' : c;
    std::vector<std::string> names;
    std::istringstream in(parts);
    for (std::string w; in >> w;) names.push_back(w);
    std::sort(names.begin(), names.end());
    if (names != std::vector<std::string>{"dp", "pp", "tp"} || l.order.size() != 8)
      bad("layout_order", "\"" + l.order + "\"", "an order of tp, pp and dp such as tp-pp-dp");
  }
  m.seed = f.attr_int("rng_seed");
  for (auto [name, values] :
       {std::pair{"recent_losses", &s.recent_losses}, std::pair{"recent_norms", &s.recent_norms}}) {
    if (!f.exists_attr(name)) continue;
    *values = f.attr_doubles(name);
    if (values->size() > (size_t(1) << 20))
      bad(name, fmt::format("[{} values]", values->size()), "at most 2^20 values");
    for (double v : *values)
      if (!std::isfinite(v)) bad(name, fmt::format("[... {} ...]", v), "finite values");
  }
  if (m.version >= 3) {
    const std::string want = f.attr_string("meta_hash"), found = text_hash(meta_text(m));
    if (want != found)
      throw CheckpointError(
          fmt::format("{}: the attributes do not match their checksum meta_hash "
                      "{} (found {}): edited or damaged",
                      file, want, found));
  }
  // The step directory names the step the file holds.
  const std::string dir = fs::path(file).parent_path().filename().string();
  if (dir.starts_with("step_") && dir != fmt::format("step_{:08d}", s.step))
    bad("step", std::to_string(s.step), "the step of its directory, " + dir);
  return m;
}

std::string stored_config(const H5File& f, const std::string& state_file) {
  const std::string text = f.attr_string("config");
  const std::string hash = f.attr_string("config_hash");
  if (text_hash(text) != hash)
    throw CheckpointError(fmt::format("{}: the stored config does not match its hash {} (found {})",
                                      state_file, hash, text_hash(text)));
  return text;
}

// More than the file will take: the values, a checksum per chunk, and HDF5's metadata (object
// headers, chunk indexes, attributes) at well under 16 KB per dataset.
int64_t file_size_bound(const Snapshot& snap, const ParamTable& full) {
  int64_t values = 0, datasets = 0;
  for (const ParamInfo& q : full.params) {
    values += q.logical_numel() * (snap.has_moments ? 3 : 1);
    datasets += snap.has_moments ? 3 : 1;
  }
  for (const Snapshot::RankState& r : snap.rank_states)
    for (int64_t n : r.sizes) values += n, datasets += n > 0;
  return values * 4 + datasets * 16384 + int64_t(snap.config_text.size()) +
         int64_t(snap.tokenizer.size()) + (1 << 20);
}

constexpr const char* kRankStateGroups[] = {"comm/state", "outer/state"};

// Rank r's state in `group` (empty when it has none).
std::vector<float> rank_state_of(const H5File& f, const std::string& group, int rank) {
  const std::string name = fmt::format("{}/rank_{}", group, rank);
  if (!f.exists(name)) return {};
  const std::vector<int64_t> shape = f.shape(name);
  std::vector<float> values(shape.at(0));
  f.read(name, shape, values.data());
  return values;
}

}  // namespace

// The rectangles (in the dataset's (rows, last dimension) view) that hold a parameter's local
// elements [begin, begin + count): runs of consecutive logical indices cut at row ends, rows
// stacked where they line up. (Values are written in local order, which is logical order.) A column
// slice of a matrix is one box, a row range one, the q, k and v blocks of a head-split QKV three.
void append_boxes(const ParamInfo& p, int64_t begin, int64_t count, std::vector<Box>& boxes) {
  const int64_t cols = p.shape.back();
  auto add_run = [&](int64_t start, int64_t len) {
    while (len > 0) {
      const int64_t row = start / cols, col = start % cols;
      Box b{row, col, 1, std::min(len, cols - col)};
      if (col == 0 && len >= cols) b = {row, 0, len / cols, cols};
      Box* last = boxes.empty() ? nullptr : &boxes.back();
      if (last && last->col == b.col && last->cols == b.cols && last->row + last->rows == b.row)
        last->rows += b.rows;
      else
        boxes.push_back(b);
      start += b.rows * b.cols;
      len -= b.rows * b.cols;
    }
  };
  p.for_each_run(begin, begin + count,
                 [&](int64_t, int64_t logical, int64_t n) { add_run(logical, n); });
}

// Version 2 had no metadata checksum; version 3 adds meta_hash.
constexpr int64_t kOldestReadableVersion = 2;

int64_t check_version(const H5File& f, const std::string& state_file) {
  const int64_t version = f.attr_int("format_version");
  if (version < kOldestReadableVersion || version > kCheckpointFormatVersion)
    throw CheckpointError(fmt::format("{}: format_version {} is not supported (expected {} to {})",
                                      state_file, version, kOldestReadableVersion,
                                      kCheckpointFormatVersion));
  return version;
}

void take_snapshot(const StageExecutor& model, const AdamW* optimizer, bool writes, Snapshot& out) {
  out.parts.clear();
  out.has_moments = optimizer != nullptr;
  if (!writes) return out.params.clear(), out.m.clear(), out.v.clear();
  const ParamTable& table = model.table();
  struct Source {
    int64_t offset, count, state_offset;
  };
  std::vector<Source> sources;
  if (optimizer)
    for (const AdamW::Segment& s : optimizer->segments())
      sources.push_back({s.offset, s.count, s.state_offset});
  else
    for (const ParamInfo& p : table.params) sources.push_back({p.offset, p.numel, p.offset});
  struct Copy {
    Snapshot::Part part;
    int64_t flat, state;
  };
  std::vector<Copy> copies;
  for (const Source& s : sources)
    for (const ParamInfo& p : table.params) {  // a segment lies within one parameter
      if (s.offset < p.offset || s.offset >= p.offset + p.numel || !p.owned()) continue;
      const int64_t begin = s.offset - p.offset;
      const int64_t end = std::min(begin + s.count, p.local_numel());  // no padded vocab rows
      if (end > begin) copies.push_back({{&p, begin, end - begin, 0}, s.offset, s.state_offset});
    }
  std::sort(copies.begin(), copies.end(), [](const Copy& a, const Copy& b) {
    return std::pair(a.part.param, a.part.begin) < std::pair(b.part.param, b.part.begin);
  });
  int64_t total = 0;
  for (Copy& c : copies) {
    c.part.at = total;
    total += c.part.count;
  }
  Kernels& k = model.kernels();
  // Every element is overwritten below: the same sizes as last time cost nothing here.
  out.params.resize(total);
  out.m.resize(optimizer ? total : 0);
  out.v.resize(optimizer ? total : 0);
  for (const Copy& c : copies) {
    const int64_t n = c.part.count, at = c.part.at;
    // The exact fp32 weights: a 16-bit (or offloading) optimizer's master, or ZeRO-3's shard.
    if (optimizer && optimizer->state_weights())
      optimizer->read_state(AdamW::State::weights, c.state, out.params.data() + at, n);
    else
      k.download_f32(out.params.data() + at, model.params() + c.flat, n);
    if (optimizer) {
      optimizer->read_state(AdamW::State::m, c.state, out.m.data() + at, n);
      optimizer->read_state(AdamW::State::v, c.state, out.v.data() + at, n);
    }
    out.parts.push_back(c.part);
  }
}

std::string write_checkpoint(const Snapshot& snap, const ModelConfig& model, Communicator* comm,
                             const std::string& dir, int keep_last) {
  const ParamTable full = param_table(model);
  const bool leader = !comm || comm->rank() == 0;
  const fs::path root(dir);
  const std::string name = step_name(snap.state.step);
  const fs::path final_dir = root / name, tmp_dir = root / (name + ".tmp");
  auto fail = [&](const std::string& error) {
    if (leader) {
      std::error_code ignored;
      fs::remove_all(tmp_dir, ignored);
    }
    throw CheckpointWriteError(
        fmt::format("checkpoint at step {} not written: {}", snap.state.step, error));
  };
  // Rank 0 makes the directory the others create the file in, after checking that there is
  // room for it: HDF5 1.10 cannot recover from a write that fails while closing the file.
  std::string error;
  if (leader) try {
      fs::create_directories(root);
      fs::remove_all(tmp_dir);  // a leftover, or a planted symlink (the link goes, not its target)
      if (!fs::create_directory(tmp_dir))
        throw CheckpointWriteError(tmp_dir.string() + ": appeared while being created");
      check_space((tmp_dir / "state.h5").string(), file_size_bound(snap, full));
    } catch (const std::exception& e) {
      error = e.what();
    }
  if (!(error = agree_on_error(comm, error)).empty()) fail(error);

  const std::string state_file = (tmp_dir / "state.h5").string();
  try {
    H5File f = comm && comm->size() > 1 ? H5File::create_parallel(state_file, mpi_comm_of(*comm))
                                        : H5File::create(state_file);
    const TrainState& s = snap.state;
    f.set_attr("format_version", kCheckpointFormatVersion);
    f.set_attr("step", s.step);
    f.set_attr("tokens", s.tokens);
    f.set_attr("data_samples", s.data_samples);
    f.set_attr("data_skipped", s.data_skipped);
    if (!s.blend.weights.empty()) {
      f.set_attr("data_blend_weights", s.blend.weights);
      f.set_attr("data_blend_start", s.blend.start);
      f.set_attr("data_blend_base", s.blend.base);
      f.set_attr("data_source_samples", s.source_samples);
    }
    f.set_attr("config", snap.config_text);
    f.set_attr("config_hash", text_hash(snap.config_text));
    if (!snap.tokenizer.empty()) f.write_bytes("tokenizer", snap.tokenizer);
    for (const auto& d : kDims) f.set_attr(d.name, d.of(model));
    f.set_attr("arch", std::string(arch_name(model.arch)));
    f.set_attr("loss_scale", s.scaler.scale);
    f.set_attr("loss_scale_clean_steps", s.scaler.clean_steps);
    f.set_attr("loss_scale_hysteresis_left", s.scaler.hysteresis_left);
    f.set_attr("loss_scale_min_scale_overflows", s.scaler.min_scale_overflows);
    f.set_attr("loss_scale_overflows", s.scaler.overflows);
    const Layout& l = s.layout;
    f.set_attr("layout_world", int64_t(l.world));
    f.set_attr("layout_dp", int64_t(l.dp));
    f.set_attr("layout_tp", int64_t(l.tp));
    f.set_attr("layout_pp", int64_t(l.pp));
    if (l.cp > 1) f.set_attr("layout_cp", int64_t(l.cp));
    f.set_attr("layout_zero", int64_t(l.zero));
    f.set_attr("layout_order", l.order);
    f.set_attr("rng_seed", int64_t(snap.seed));
    if (!s.recent_losses.empty()) f.set_attr("recent_losses", s.recent_losses);
    if (!s.recent_norms.empty()) f.set_attr("recent_norms", s.recent_norms);
    Meta meta;
    meta.seed = int64_t(snap.seed);
    meta.config_hash = text_hash(snap.config_text);
    meta.state = s;
    meta.model.arch = arch_name(model.arch);
    for (size_t i = 0; i < std::size(kDims); i++) meta.model.dims[i] = kDims[i].of(model);
    f.set_attr("meta_hash", text_hash(meta_text(meta)));

    // Every rank creates every dataset, in the same order, and writes its own boxes (the same
    // for the weights and both moments).
    std::vector<std::vector<Box>> boxes(full.params.size());
    std::vector<int64_t> starts(full.params.size(), 0);  // where its values are in a group
    size_t next = 0;                                     // parts are in table order
    for (size_t t = 0; t < full.params.size(); t++) {
      for (; next < snap.parts.size() && snap.parts[next].param->name == full.params[t].name;
           next++) {
        const Snapshot::Part& part = snap.parts[next];
        if (boxes[t].empty()) starts[t] = part.at;
        append_boxes(*part.param, part.begin, part.count, boxes[t]);
      }
    }
    if (next != snap.parts.size()) throw std::logic_error("snapshot parts out of table order");
    auto write_group = [&](const std::string& group, const HostVector<float>& values) {
      for (size_t t = 0; t < full.params.size(); t++) {
        const ParamInfo& q = full.params[t];
        f.write_part(group + q.name, q.shape, boxes[t], values.data() + starts[t]);
      }
    };
    write_group("params/", snap.params);
    test_write_delay(s.step);
    if (snap.has_moments) {
      write_group("optim/m/", snap.m);
      write_group("optim/v/", snap.v);
    }
    const int me = comm ? comm->rank() : 0;
    for (const Snapshot::RankState& state : snap.rank_states)
      for (size_t r = 0; r < state.sizes.size(); r++) {
        const int64_t n = state.sizes[r];
        if (n == 0) continue;
        // In writes of about a chunk: one collective write of a filtered dataset holds buffers
        // for every chunk it touches (a node's whole weights and moments, for outer steps).
        constexpr int64_t kWrite = 1 << 20;
        std::vector<Box> mine;
        if (int(r) == me)
          for (int64_t at = 0; at < n; at += kWrite)
            mine.push_back({0, at, 1, std::min(kWrite, n - at)});
        f.write_part(fmt::format("{}/rank_{}", state.group, r), {n}, mine, state.mine.data());
      }
    f.flush();  // collective: every rank's data is on the file system before the rename
    f.close();
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!(error = agree_on_error(comm, error)).empty()) fail(error);

  // Complete on every rank: rank 0 puts it in place, then moves `latest`. A checkpoint of the
  // same step already there (a finished run resumed, a rollback) moves aside under a fresh name
  // and is removed only once the new one is in place.
  fs::path old_dir;
  if (leader) try {
      write_file_atomic((tmp_dir / "config.toml").string(), snap.config_text);
      fsync_path(state_file);
      if (fs::exists(fs::symlink_status(final_dir))) {
        old_dir = root / fmt::format("{}.old.{}.tmp", name, ::getpid());
        fs::remove_all(old_dir);
        fs::rename(final_dir, old_dir);
      }
      fs::rename(tmp_dir, final_dir);
      fsync_path(root.string());
    } catch (const std::exception& e) {
      error = e.what();
    }
  if (!(error = agree_on_error(comm, error)).empty()) fail(error);
  // The checkpoint is complete: what fails from here on is a warning, not a lost checkpoint.
  auto warn = [&](auto&& what) {
    try {
      what();
    } catch (const std::exception& e) {
      fmt::print(stderr, "trainer: warning: after writing {}: {}\n", final_dir.string(), e.what());
    }
  };
  if (leader) {
    if (!old_dir.empty()) warn([&] { fs::remove_all(old_dir); });
    warn([&] { write_file_atomic((root / "latest").string(), name + "\n"); });
    if (keep_last > 0)  // older ones go only now that a newer one is complete
      warn([&] {
        const std::vector<std::string> steps = complete_checkpoints(root);
        // Newest first, from this one down: newer leftovers of another run are not touched.
        int kept = 0;
        for (const std::string& step : steps)
          if (step <= name && ++kept > keep_last) fs::remove_all(root / step);
      });
  }
  return final_dir.string();
}

std::string save_checkpoint(const std::string& dir, const Config& cfg, const StageExecutor& model,
                            const AdamW* optimizer, const TrainState& state,
                            const Tokenizer* tokenizer) {
  Snapshot snap;
  take_snapshot(model, optimizer, true, snap);
  snap.state = state;
  snap.config_text = config_to_toml(cfg);
  if (tokenizer) snap.tokenizer = tokenizer->serialize();
  snap.seed = cfg.run.seed;
  return write_checkpoint(snap, cfg.model, nullptr, dir, 0);
}

std::string checkpoint_dir(const Config& cfg) {
  return cfg.checkpoint.dir.empty() ? (fs::path(cfg.run.out_dir) / "checkpoints").string()
                                    : cfg.checkpoint.dir;
}

void remove_incomplete_checkpoints(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!name.ends_with(".tmp") || !(name.starts_with("step_") || name.starts_with("latest.")))
      continue;
    // What cannot be removed (permissions, a busy file system) is reported, not fatal: it is
    // never read, and the run it would block is worth more.
    if (fs::remove_all(e.path(), ec) == static_cast<std::uintmax_t>(-1) || ec)
      fmt::print(stderr, "trainer: warning: cannot remove the leftover {}: {}\n", e.path().string(),
                 ec.message());
  }
}

std::string resolve_checkpoint(const std::string& path) {
  fs::path p(path);
  if (!fs::exists(p)) throw CheckpointError(fmt::format("{}: no such checkpoint", path));
  if (fs::is_regular_file(p) || HfDirectory::is_one(path)) return p.string();
  for (int depth = 0; depth < 3; depth++) {
    if (fs::exists(p / "state.h5")) return (p / "state.h5").string();
    if (fs::exists(p / "latest")) {
      std::ifstream in(p / "latest");
      std::string name;
      in >> name;
      // `latest` names a step directory beside it, nothing else (no path out of it).
      if (!is_step_name(name) || fs::is_symlink(p / name))
        throw CheckpointError(fmt::format(
            "{}: names \"{}\", not a step directory beside it (step_NNNNNNNN, not a symlink)",
            (p / "latest").string(), name));
      p = p / name;
    } else if (fs::exists(p / "checkpoints")) {
      p = p / "checkpoints";
    } else {
      break;
    }
  }
  throw CheckpointError(fmt::format(
      "{}: not a checkpoint (expected a directory with state.h5, or a run directory)", path));
}

Config checkpoint_config(const std::string& state_file) {
  if (SafetensorsFile::is_one(state_file) || HfDirectory::is_one(state_file) ||
      LlmcFile::is_one(state_file))
    throw CheckpointError(fmt::format(
        "{}: weights without a run (safetensors, a transformers directory or llm.c's format): "
        "usable as [init] from, not as a checkpoint of ours",
        state_file));
  H5File f = H5File::open_read(state_file);
  check_version(f, state_file);
  try {
    return parse_config(stored_config(f, state_file), state_file + ":config");
  } catch (const ConfigError& e) {  // the stored config is part of the checkpoint
    throw CheckpointError(e.what());
  }
}

void check_same_tokenizer(const std::string& state_file, const Tokenizer& tokenizer,
                          const std::string& named) {
  std::unique_ptr<Tokenizer> stored = checkpoint_tokenizer(state_file);
  // One from before tokenizers were stored was trained on the config's, which was bytes.
  if (!stored && checkpoint_config(state_file).tokenizer.kind == "bytes")
    stored = load_tokenizer("bytes", "");
  if (stored && stored->identity_hash() != tokenizer.identity_hash())
    throw ConfigError(fmt::format(
        "{}: trained with tokenizer {} (identity hash {:016x}), but [tokenizer] is {} ({:016x}): "
        "resume with the tokenizer the run was trained with",
        state_file, stored->kind(), stored->identity_hash(), named, tokenizer.identity_hash()));
}

std::unique_ptr<Tokenizer> checkpoint_tokenizer(const std::string& state_file) {
  H5File f = H5File::open_read(state_file);
  check_version(f, state_file);
  if (!f.exists("tokenizer")) return nullptr;
  return tokenizer_from_bytes(f.read_bytes("tokenizer"), state_file + ":tokenizer");
}

int64_t checkpoint_step(const std::string& state_file) {
  H5File f = H5File::open_read(state_file);
  return read_meta(f, state_file).state.step;
}

void check_same_model(const std::string& state_file, const ModelConfig& model) {
  check_dims(H5File::open_read(state_file), state_file, model);
}

void verify_checkpoint(const std::string& state_file, const ModelConfig& model) {
  H5File f = H5File::open_read(state_file);
  check_dims(f, state_file, model);
  const Meta meta = read_meta(f, state_file);
  stored_config(f, state_file);
  for (const ParamInfo& q : param_table(model).params) {
    std::vector<float> values(q.logical_numel());
    for (const std::string group : {"params/", "optim/m/", "optim/v/"})
      if (group == "params/" || f.exists(group + q.name))
        f.read(group + q.name, q.shape, values.data());
  }
  for (const char* group : kRankStateGroups)
    for (int r = 0; r < meta.state.layout.world; r++) rank_state_of(f, group, r);
  if (f.exists("tokenizer"))  // checksummed bytes that rebuild a tokenizer
    tokenizer_from_bytes(f.read_bytes("tokenizer"), state_file + ":tokenizer");
}

std::string newest_valid_checkpoint(const std::string& dir, const ModelConfig& model,
                                    std::vector<std::string>& rejected) {
  std::vector<std::string> candidates = complete_checkpoints(dir);
  // `latest` moves only once a checkpoint is complete: the run's newest is the one it names.
  // Newer directories are not this run's (or their write did not finish); older ones are the
  // fall-back when it does not verify.
  std::string latest;
  if (std::ifstream in(fs::path(dir) / "latest"); in >> latest && !is_step_name(latest)) {
    rejected.push_back(fmt::format("{}: names \"{}\", not a step directory beside it",
                                   (fs::path(dir) / "latest").string(), latest));
    latest.clear();  // then every complete step is a candidate, newest first
  }
  if (!latest.empty()) {
    std::vector<std::string> ordered;
    if (std::find(candidates.begin(), candidates.end(), latest) != candidates.end())
      ordered.push_back(latest);
    else
      rejected.push_back(fmt::format("{}: `latest` names {}, which is not a complete checkpoint",
                                     (fs::path(dir) / "latest").string(), latest));
    for (const std::string& name : candidates)
      if (name < latest)
        ordered.push_back(name);
      else if (name > latest)
        rejected.push_back(
            fmt::format("{}: newer than `latest` ({}): not this run's checkpoint, "
                        "or its write did not finish",
                        (fs::path(dir) / name).string(), latest));
    candidates = std::move(ordered);
  }
  for (const std::string& name : candidates) {
    const std::string state = (fs::path(dir) / name / "state.h5").string();
    try {
      verify_checkpoint(state, model);
      return state;
    } catch (const ConfigError&) {  // another model: not damage, the config does not fit
      throw;
    } catch (const InputError& e) {
      rejected.push_back(e.what());
    }
  }
  return "";
}

TrainState load_checkpoint(const std::string& state_file, StageExecutor& model, AdamW* optimizer) {
  H5File f = H5File::open_read(state_file);
  check_dims(f, state_file, model.config());
  const Meta meta = read_meta(f, state_file);
  load_params(f, model, optimizer);
  if (optimizer) {
    load_state(f, "optim/m/", model, *optimizer, AdamW::State::m);
    load_state(f, "optim/v/", model, *optimizer, AdamW::State::v);
  }
  return meta.state;
}

std::vector<float> rank_state(const std::string& state_file, const std::string& group, int rank) {
  return rank_state_of(H5File::open_read(state_file), group, rank);
}

}  // namespace trainer
