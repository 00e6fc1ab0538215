#include "trainer/weight_import.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdlib>
#include <functional>
#include <map>

#include "io/hdf5_file.h"
#include "io/safetensors.h"
#include "kernels/cpu/host_memory.h"
#include "trainer/checkpoint.h"
#include "trainer/hf_format.h"
#include "trainer/llmc_format.h"

namespace trainer {

namespace {

// Tensors under the model's logical names, to read weights from: a group of one of our
// checkpoints ("params/", "optim/m/") or a safetensors file (trainer export, or a tool's).
class TensorSource {
 public:
  virtual ~TensorSource() = default;
  virtual bool exists(const std::string& name) const = 0;
  virtual std::vector<int64_t> shape(const std::string& name) const = 0;
  virtual void read_part(const std::string& name, const std::vector<int64_t>& shape,
                         const std::vector<Box>& boxes, float* values) const = 0;
};

class H5Group : public TensorSource {
 public:
  H5Group(const H5File& f, std::string group) : f_(f), group_(std::move(group)) {}
  bool exists(const std::string& name) const override { return f_.exists(group_ + name); }
  std::vector<int64_t> shape(const std::string& name) const override {
    return f_.shape(group_ + name);
  }
  void read_part(const std::string& name, const std::vector<int64_t>& shape,
                 const std::vector<Box>& boxes, float* values) const override {
    f_.read_part(group_ + name, shape, boxes, values);
  }

 private:
  const H5File& f_;
  std::string group_;
};

class SafetensorsSource : public TensorSource {
 public:
  explicit SafetensorsSource(const SafetensorsFile& f) : f_(f) {}
  bool exists(const std::string& name) const override { return f_.exists(name); }
  std::vector<int64_t> shape(const std::string& name) const override { return f_.at(name).shape; }
  void read_part(const std::string& name, const std::vector<int64_t>& shape,
                 const std::vector<Box>& boxes, float* values) const override {
    f_.read_part(name, shape, boxes, values);
  }

 private:
  const SafetensorsFile& f_;
};

// A file of another layout read under our names once checked (a transformers directory, an
// llm.c checkpoint): `read` gives boxes of our parameter.
class ConvertedSource : public TensorSource {
 public:
  using Read = std::function<void(const std::string& name, const std::vector<int64_t>& shape,
                                  const std::vector<Box>& boxes, float* values)>;
  ConvertedSource(const ModelConfig& m, Read read)
      : table_(param_table(m)), read_(std::move(read)) {}
  bool exists(const std::string&) const override { return true; }
  std::vector<int64_t> shape(const std::string& name) const override {
    return table_.at(name).shape;
  }
  void read_part(const std::string& name, const std::vector<int64_t>& shape,
                 const std::vector<Box>& boxes, float* values) const override {
    read_(name, shape, boxes, values);
  }

 private:
  ParamTable table_;
  Read read_;
};

// Elements a load reads at a time: 16 MB, or (test hook) TRAINER_TEST_LOAD_PIECE=7 for pieces
// that cut rows and the blocks of split tensors anywhere.
int64_t load_piece_elems() {
  if (const char* spec = std::getenv("TRAINER_TEST_LOAD_PIECE"))
    if (const long long n = std::atoll(spec); n > 0) return n;
  return int64_t(1) << 22;
}

// This rank's elements of the model's tensors, piece by piece: deliver(at, values, n) gets
// elements [at, at + n) of the flat layout of its parameters. Each rank reads only the boxes of
// its slices (the values arrive in local order), and a load holds one piece of at most 16 MB,
// not a copy of the state (which a resumed CPU run held on top of the model: +32% of its plan).
// `wanted` (when given) says whether a piece is needed at all: a ZeRO rank's optimizer state
// covers 1/dp of the elements, and it reads only the pieces that overlap its segments.
using Deliver = std::function<void(int64_t at, const float* values, int64_t n)>;
using Wanted = std::function<bool(int64_t at, int64_t n)>;
void for_each_local_piece(const TensorSource& source, const StageExecutor& model,
                          const Deliver& deliver, const Wanted& wanted = nullptr) {
  const int64_t piece_elems = load_piece_elems();
  const ParamTable full = param_table(model.config());
  HostVector<float> piece;  // handed back to the system when the load ends (host_memory.h)
  for (const ParamInfo& p : model.table().params)
    for (int64_t at = 0; at < p.local_numel(); at += piece_elems) {
      const int64_t n = std::min(piece_elems, p.local_numel() - at);
      if (wanted && !wanted(p.offset + at, n)) continue;
      std::vector<Box> boxes;
      append_boxes(p, at, n, boxes);
      piece.resize(size_t(n));
      source.read_part(p.name, full.at(p.name).shape, boxes, piece.data());
      deliver(p.offset + at, piece.data(), n);
    }
}

// Whether any of elements [at, at + n) of the flat layout is in the optimizer's state.
bool in_state(const AdamW& optimizer, int64_t at, int64_t n) {
  for (const AdamW::Segment& s : optimizer.segments())
    if (std::max(at, s.offset) < std::min(at + n, s.offset + s.count)) return true;
  return false;
}

// Elements [at, at + n) of the flat layout into the optimizer's state, indexed by its segments.
void write_state_piece(AdamW& optimizer, AdamW::State which, int64_t at, const float* values,
                       int64_t n) {
  for (const AdamW::Segment& s : optimizer.segments()) {
    const int64_t lo = std::max(at, s.offset), hi = std::min(at + n, s.offset + s.count);
    if (lo < hi)
      optimizer.write_state(which, s.state_offset + (lo - s.offset), values + (lo - at), hi - lo);
  }
}

// The weights into the model (ZeRO-3: its held units, and this rank's shard of the rest) and
// the optimizer's exact fp32 copy, if it keeps one (16-bit or offloaded).
void load_params(const TensorSource& source, StageExecutor& model, AdamW* optimizer) {
  const bool copy = optimizer && optimizer->state_weights();
  const int64_t elems = model.params_elems();
  for_each_local_piece(source, model, [&](int64_t at, const float* values, int64_t n) {
    // Into 16-bit weights each upload stages its fp32 values on the device.
    if (at < elems)
      model.kernels().upload_f32(model.params() + at, values, std::min(n, elems - at));
    if (copy) write_state_piece(*optimizer, AdamW::State::weights, at, values, n);
  });
}

std::string shape_text(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// Every tensor the model needs is in `source` with its shape. `prefix` names them in messages
// ("params/"); `model_note` says what the file's model is, when it is known.
void check_tensors(const TensorSource& source, const std::string& file, const std::string& prefix,
                   const ModelConfig& model, const std::string& model_note) {
  for (const ParamInfo& p : param_table(model).params) {
    if (!source.exists(p.name))
      throw CheckpointError(fmt::format("{}: no tensor {}{}, which this model needs ({}{})", file,
                                        prefix, p.name, shape_text(p.shape), model_note));
    const std::vector<int64_t> shape = source.shape(p.name);
    if (shape != p.shape)
      throw CheckpointError(fmt::format("{}: {}{} has shape {}, this model's is {}", file, prefix,
                                        p.name, shape_text(shape), shape_text(p.shape)));
  }
}

// A safetensors file's weights fit the model: every tensor it needs, of its shape, and no other
// (a tensor this model has no place for means the file is another model's).
void check_safetensors(const SafetensorsFile& f, const ModelConfig& model) {
  check_tensors(SafetensorsSource(f), f.path(), "", model, "");
  const ParamTable table = param_table(model);
  for (const auto& [name, t] : f.tensors())
    if (!table.find(name))
      throw CheckpointError(fmt::format("{}: tensor {} ({} {}) has no place in this model ({})",
                                        f.path(), name, t.dtype, shape_text(t.shape),
                                        arch_name(model.arch)));
  // Our own export records the model; the same shapes may still be another (n_head).
  const auto it = f.metadata().find("n_head");
  if (it != f.metadata().end() && it->second != std::to_string(model.n_head))
    throw CheckpointError(
        fmt::format("{}: the weights are for a model with n_head = {}, this "
                    "model has n_head = {}",
                    f.path(), it->second, model.n_head));
}

}  // namespace

void load_state(const H5File& f, const std::string& group, const StageExecutor& model,
                AdamW& optimizer, AdamW::State which) {
  for_each_local_piece(
      H5Group(f, group), model,
      [&](int64_t at, const float* values, int64_t n) {
        write_state_piece(optimizer, which, at, values, n);
      },
      [&](int64_t at, int64_t n) { return in_state(optimizer, at, n); });
}

void load_params(const H5File& f, StageExecutor& model, AdamW* optimizer) {
  load_params(H5Group(f, "params/"), model, optimizer);
}

void check_weights(const std::string& state_file, const ModelConfig& model) {
  if (SafetensorsFile::is_one(state_file))
    return check_safetensors(SafetensorsFile(state_file), model);
  if (HfDirectory::is_one(state_file)) return HfDirectory(state_file).check(model);
  if (LlmcFile::is_one(state_file)) return LlmcFile(state_file).check(model);
  H5File f = H5File::open_read(state_file);
  check_version(f, state_file);
  const int64_t n_layer = f.attr_int("n_layer"), n_head = f.attr_int("n_head");
  check_tensors(H5Group(f, "params/"), state_file, "params/", model,
                fmt::format("; the checkpoint's model has n_layer = {}", n_layer));
  // A deeper model's blocks would be silently dropped: the first parameter of block n_layer.
  ModelConfig deeper = model;
  deeper.n_layer++;
  std::string extra;
  for (const ParamInfo& p : param_table(deeper).params)
    if (p.layer == model.n_layer && extra.empty()) extra = "params/" + p.name;
  if (f.exists(extra))
    throw CheckpointError(
        fmt::format("{}: {} has no place in this model (n_layer = {} there, {} here)", state_file,
                    extra, n_layer, model.n_layer));
  if (n_head != model.n_head)  // the same shapes, another model
    throw CheckpointError(
        fmt::format("{}: checkpoint is for a model with n_head = {}, this "
                    "model has n_head = {}",
                    state_file, n_head, model.n_head));
}

void load_weights(const std::string& state_file, StageExecutor& model, AdamW* optimizer) {
  check_weights(state_file, model.config());
  if (SafetensorsFile::is_one(state_file)) {
    const SafetensorsFile f(state_file);
    return load_params(SafetensorsSource(f), model, optimizer);
  }
  if (HfDirectory::is_one(state_file)) {
    const HfDirectory d(state_file);
    std::map<std::string, HfTensor> by_ours;  // our parameter -> the tensor it comes from
    for (const HfTensor& t : hf_tensors(model.config()))
      if (!t.ours.empty()) by_ours.emplace(t.ours, t);
    return load_params(
        ConvertedSource(model.config(),
                        [&](const std::string& name, const std::vector<int64_t>& shape,
                            const std::vector<Box>& boxes, float* values) {
                          d.read_part(by_ours.at(name), shape, boxes, values);
                        }),
        model, optimizer);
  }
  if (LlmcFile::is_one(state_file)) {
    const LlmcFile f(state_file);
    return load_params(
        ConvertedSource(model.config(),
                        [&](const std::string& name, const std::vector<int64_t>& shape,
                            const std::vector<Box>& boxes,
                            float* values) { f.read_part(name, shape, boxes, values); }),
        model, optimizer);
  }
  H5File f = H5File::open_read(state_file);
  load_params(f, model, optimizer);
}

}  // namespace trainer
