#include "trainer/checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "io/atomic_file.h"
#include "io/hdf5_file.h"

namespace fs = std::filesystem;

namespace trainer {
namespace {

struct ModelDims {
  const char* name;
  int GPTConfig::*field;
};
constexpr ModelDims kDims[] = {{"vocab_size", &GPTConfig::vocab_size},
                               {"seq_len", &GPTConfig::seq_len},
                               {"n_layer", &GPTConfig::n_layer},
                               {"n_head", &GPTConfig::n_head},
                               {"d_model", &GPTConfig::d_model}};

}  // namespace

ModelState collect_state(const GPT& model, const AdamW* optimizer, Communicator* world,
                         bool replica_leader, bool sharded_optimizer) {
  const ParamTable full = gpt2_param_table(model.config());
  ModelState out;
  auto tensors = [&] {
    std::vector<NamedTensor> t;
    for (const ParamInfo& q : full.params)
      t.push_back({q.name, q.shape, std::vector<float>(q.logical_numel(), 0.0f)});
    return t;
  };
  out.params = tensors();
  const int64_t total = model.table().total;
  Kernels& k = model.kernels();
  // A state buffer of the optimizer in the flat layout of the parameters, and which elements
  // this rank contributes.
  auto flat = [&](DPtr state, std::vector<float>& values, std::vector<char>& held) {
    values.assign(total, 0.0f);
    held.assign(total, 0);
    if (!sharded_optimizer && !replica_leader) return;
    std::vector<float> host(optimizer->state_elems());
    k.download_f32(host.data(), state, optimizer->state_elems());
    for (const AdamW::Segment& s : optimizer->segments())
      for (int64_t i = 0; i < s.count; i++) {
        values[s.offset + i] = host[s.state_offset + i];
        held[s.offset + i] = 1;
      }
  };
  auto scatter = [&](std::vector<NamedTensor>& dst, const std::vector<float>& values,
                     const std::vector<char>& held) {
    for (const ParamInfo& p : model.table().params) {
      if (!p.owned()) continue;
      std::vector<float>& t = dst[full.index.at(p.name)].values;
      for (int64_t i = 0; i < p.local_numel(); i++)
        if (held[p.offset + i]) t[p.logical_index(i)] = values[p.offset + i];
    }
  };
  std::vector<float> values;
  std::vector<char> held;
  if (optimizer && optimizer->master()) {  // 16-bit model: the fp32 master weights
    flat(optimizer->master(), values, held);
    scatter(out.params, values, held);
  } else if (replica_leader) {
    for (const ParamInfo& p : model.table().params) {
      if (!p.owned()) continue;
      const std::vector<float> v = model.read<float>(p, model.params());
      std::vector<float>& dst = out.params[full.index.at(p.name)].values;
      for (int64_t i = 0; i < int64_t(v.size()); i++) dst[p.logical_index(i)] = v[i];
    }
  }
  if (optimizer) {
    out.m = tensors();
    out.v = tensors();
    flat(optimizer->m(), values, held);
    scatter(out.m, values, held);
    flat(optimizer->v(), values, held);
    scatter(out.v, values, held);
  }
  if (world && world->size() > 1)
    for (auto* group : {&out.params, &out.m, &out.v})
      for (NamedTensor& t : *group)
        world->all_reduce(host_ptr(t.values.data()), int64_t(t.values.size()), ReduceOp::sum);
  return out;
}

std::vector<std::vector<float>> gather_per_rank(const std::vector<float>& mine,
                                                Communicator& world) {
  double longest = double(mine.size());
  world.all_reduce(host_ptr(&longest), 1, ReduceOp::max);
  const int64_t L = int64_t(longest) + 1;  // a length, then the values, padded
  std::vector<float> block(L, 0.0f), all(L * world.size());
  block[0] = float(mine.size());  // exact below 2^24 elements per rank and bucket set
  std::copy(mine.begin(), mine.end(), block.begin() + 1);
  world.all_gather(host_ptr(block.data()), host_ptr(all.data()), L);
  std::vector<std::vector<float>> out(world.size());
  for (int r = 0; r < world.size(); r++) {
    const float* b = all.data() + r * L;
    out[r].assign(b + 1, b + 1 + int64_t(b[0]));
  }
  return out;
}

std::string save_checkpoint(const std::string& out_dir, const Config& cfg, const ModelState& model,
                            const TrainState& state) {
  const fs::path root = fs::path(out_dir) / "checkpoints";
  const std::string name = fmt::format("step_{:08d}", state.step);
  const fs::path final_dir = root / name, tmp_dir = root / (name + ".tmp");
  fs::create_directories(root);
  fs::remove_all(tmp_dir);
  fs::create_directories(tmp_dir);
  const std::string config_text = config_to_toml(cfg);
  {
    H5File f = H5File::create((tmp_dir / "state.h5").string());
    f.set_attr("format_version", kCheckpointFormatVersion);
    f.set_attr("step", state.step);
    f.set_attr("tokens", state.tokens);
    f.set_attr("config", config_text);
    for (const auto& d : kDims) f.set_attr(d.name, int64_t(cfg.model.*d.field));
    for (const NamedTensor& t : model.params) f.write("params/" + t.name, t.shape, t.values.data());
    for (const NamedTensor& t : model.m) f.write("optim/m/" + t.name, t.shape, t.values.data());
    for (const NamedTensor& t : model.v) f.write("optim/v/" + t.name, t.shape, t.values.data());
    for (size_t r = 0; r < model.residuals.size(); r++)
      if (!model.residuals[r].empty())
        f.write(fmt::format("comm/residual/rank_{}", r), {int64_t(model.residuals[r].size())},
                model.residuals[r].data());
    f.set_attr("loss_scale", model.loss_scale);
    f.flush();
  }
  write_file_atomic((tmp_dir / "config.toml").string(), config_text);
  fsync_path((tmp_dir / "state.h5").string());
  fs::remove_all(final_dir);
  fs::rename(tmp_dir, final_dir);
  fsync_path(root.string());
  write_file_atomic((root / "latest").string(), name + "\n");
  return final_dir.string();
}

std::string resolve_checkpoint(const std::string& path) {
  fs::path p(path);
  if (!fs::exists(p)) throw CheckpointError(fmt::format("{}: no such checkpoint", path));
  if (fs::is_regular_file(p)) return p.string();
  for (int depth = 0; depth < 3; depth++) {
    if (fs::exists(p / "state.h5")) return (p / "state.h5").string();
    if (fs::exists(p / "latest")) {
      std::ifstream in(p / "latest");
      std::string name;
      in >> name;
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

namespace {
void check_version(const H5File& f, const std::string& state_file) {
  const int64_t version = f.attr_int("format_version");
  if (version != kCheckpointFormatVersion)
    throw CheckpointError(fmt::format("{}: format_version {} is not supported (expected {})",
                                      state_file, version, kCheckpointFormatVersion));
}

void check_dims(const H5File& f, const std::string& state_file, const GPTConfig& model) {
  for (const auto& d : kDims) {
    const int64_t saved = f.attr_int(d.name), ours = model.*d.field;
    if (saved != ours)
      throw CheckpointError(
          fmt::format("{}: checkpoint is for a model with {} = {}, this model has {} = {}",
                      state_file, d.name, saved, d.name, ours));
  }
}
}  // namespace

Config checkpoint_config(const std::string& state_file) {
  H5File f = H5File::open_read(state_file);
  check_version(f, state_file);
  try {
    return parse_config(f.attr_string("config"), state_file + ":config");
  } catch (const ConfigError& e) {  // the stored config is part of the checkpoint
    throw CheckpointError(e.what());
  }
}

void verify_checkpoint(const std::string& state_file, const GPTConfig& model) {
  H5File f = H5File::open_read(state_file);
  check_version(f, state_file);
  check_dims(f, state_file, model);
  f.attr_int("step");
  f.attr_int("tokens");
  for (const ParamInfo& q : gpt2_param_table(model).params) {
    std::vector<float> values(q.logical_numel());
    for (const std::string group : {"params/", "optim/m/", "optim/v/"})
      if (group == "params/" || f.exists(group + q.name))
        f.read(group + q.name, q.shape, values.data());
  }
}

std::string newest_valid_checkpoint(const std::string& out_dir, const GPTConfig& model,
                                    std::vector<std::string>& rejected) {
  const fs::path root = fs::path(out_dir) / "checkpoints";
  if (!fs::is_directory(root)) return "";
  std::vector<std::string> steps;  // complete checkpoints only: temporaries end in .tmp
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    if (e.is_directory() && name.starts_with("step_") && !name.ends_with(".tmp"))
      steps.push_back(name);
  }
  std::sort(steps.rbegin(), steps.rend());  // zero-padded: newest first
  for (const std::string& name : steps) {
    const std::string state = (root / name / "state.h5").string();
    try {
      verify_checkpoint(state, model);
      return state;
    } catch (const InputError& e) {
      rejected.push_back(e.what());
    }
  }
  return "";
}

TrainState load_checkpoint(const std::string& state_file, GPT& model, AdamW* optimizer,
                           RunState* run, int rank) {
  H5File f = H5File::open_read(state_file);
  check_dims(f, state_file, model.config());
  const ParamTable full = gpt2_param_table(model.config());
  const int64_t total = model.table().total;
  Kernels& k = model.kernels();
  // This rank's elements of a group of tensors, in the flat layout of its parameters.
  auto local = [&](const std::string& group) {
    std::vector<float> flat(total, 0.0f);
    for (const ParamInfo& p : model.table().params) {
      const ParamInfo& q = full.at(p.name);
      std::vector<float> values(q.logical_numel());
      f.read(group + p.name, q.shape, values.data());
      for (int64_t i = 0; i < p.local_numel(); i++) flat[p.offset + i] = values[p.logical_index(i)];
    }
    return flat;
  };
  // flat -> a state buffer indexed by the optimizer's segments.
  auto to_state = [&](const std::vector<float>& flat, DPtr state) {
    std::vector<float> host(optimizer->state_elems(), 0.0f);
    for (const AdamW::Segment& s : optimizer->segments())
      std::copy(flat.begin() + s.offset, flat.begin() + s.offset + s.count,
                host.begin() + s.state_offset);
    k.upload_f32(state, host.data(), optimizer->state_elems());
  };
  const std::vector<float> params = local("params/");
  k.upload_f32(model.params(), params.data(), total);
  if (optimizer) {
    if (optimizer->master()) to_state(params, optimizer->master());
    to_state(local("optim/m/"), optimizer->m());
    to_state(local("optim/v/"), optimizer->v());
  }
  if (run) {
    run->loss_scale = f.exists_attr("loss_scale") ? f.attr_double("loss_scale") : 1.0;
    const std::string residual = fmt::format("comm/residual/rank_{}", rank);
    run->residuals.clear();
    if (f.exists(residual)) {
      const std::vector<int64_t> shape = f.shape(residual);
      run->residuals.resize(shape.at(0));
      f.read(residual, shape, run->residuals.data());
    }
  }
  return {f.attr_int("step"), f.attr_int("tokens")};
}

}  // namespace trainer
