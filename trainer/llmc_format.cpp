#include "trainer/llmc_format.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "io/atomic_file.h"
#include "io/errors.h"
#include "io/mapped_file.h"
#include "kernels/half.h"

namespace trainer {

namespace {

constexpr int32_t kMagic = 20240326;
constexpr int kVocabMultiple = 128;  // llm.c pads the vocabulary to a multiple of 128

int64_t padded(int64_t v) {
  return (v + kVocabMultiple - 1) / kVocabMultiple * kVocabMultiple;
}

// Every parameter's offset, in llm.c's order; `total` the elements of the file's body.
std::vector<std::pair<std::string, int64_t>> layout(const ModelConfig& m, int64_t& total) {
  const int64_t C = m.d_model, L = m.n_layer, Vp = padded(m.vocab_size), T = m.seq_len;
  std::vector<std::pair<std::string, int64_t>> out;
  int64_t at = 0;
  out.push_back({"wte.weight", at});
  at += Vp * C;
  out.push_back({"wpe.weight", at});
  at += T * C;
  // Each kind stacked over the layers: (our name's suffix, elements per layer).
  const std::pair<const char*, int64_t> kinds[] = {{"ln1.weight", C},
                                                   {"ln1.bias", C},
                                                   {"attn.qkv.weight", 3 * C * C},
                                                   {"attn.qkv.bias", 3 * C},
                                                   {"attn.proj.weight", C * C},
                                                   {"attn.proj.bias", C},
                                                   {"ln2.weight", C},
                                                   {"ln2.bias", C},
                                                   {"mlp.fc.weight", 4 * C * C},
                                                   {"mlp.fc.bias", 4 * C},
                                                   {"mlp.proj.weight", 4 * C * C},
                                                   {"mlp.proj.bias", C}};
  for (const auto& [kind, n] : kinds)
    for (int64_t l = 0; l < L; l++, at += n) out.push_back({fmt::format("h.{}.{}", l, kind), at});
  out.push_back({"ln_f.weight", at});
  at += C;
  out.push_back({"ln_f.bias", at});
  at += C;
  total = at;
  return out;
}

}  // namespace

void write_llmc(const ModelConfig& m,
                const std::function<std::vector<float>(const std::string&)>& read,
                const std::string& path, const std::string& dtype) {
  if (m.arch != Arch::gpt2 || !m.tie_embeddings || !m.bias)
    throw ConfigError(fmt::format(
        "{}: llm.c's format holds GPT-2 with tied embeddings and biases; this model is {}{}{}",
        path, arch_name(m.arch), m.tie_embeddings ? "" : ", untied", m.bias ? "" : ", no biases"));
  int32_t header[256] = {};
  header[0] = kMagic;
  header[1] = dtype == "BF16" ? 5 : 3;
  header[2] = m.seq_len;
  header[3] = m.vocab_size;
  header[4] = m.n_layer;
  header[5] = m.n_head;
  header[6] = m.d_model;
  header[7] = int32_t(padded(m.vocab_size));
  std::string tmp;
  // Closed and removed on any way out but the rename (a failed read included).
  struct Temporary {
    FILE* f;
    const std::string& name;
    bool kept = false;
    ~Temporary() {
      if (f) std::fclose(f);
      if (!kept) ::unlink(name.c_str());
    }
  } guard{open_temporary_beside(path, tmp), tmp};
  FILE* f = guard.f;
  auto fail = [&](const std::string& why) {
    throw DataError(fmt::format("{}: write failed: {}", path, why));
  };
  if (std::fwrite(header, sizeof header, 1, f) != 1) fail(strerror(errno));
  int64_t total = 0;
  for (const auto& [name, offset] : layout(m, total)) {
    std::vector<float> v = read(name);
    if (name == "wte.weight") v.resize(size_t(padded(m.vocab_size) * m.d_model), 0.0f);
    if (header[1] == 5) {
      std::vector<uint16_t> half(v.size());
      for (size_t i = 0; i < v.size(); i++) half[i] = to_bf16(v[i]).bits;
      if (std::fwrite(half.data(), 2, half.size(), f) != half.size()) fail(strerror(errno));
    } else if (std::fwrite(v.data(), 4, v.size(), f) != v.size()) {
      fail(strerror(errno));
    }
  }
  if (std::fflush(f) != 0 || ::fsync(::fileno(f)) != 0) fail(strerror(errno));
  std::fclose(f);
  guard.f = nullptr;
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw DataError(fmt::format("{}: cannot rename into place: {}", path, strerror(errno)));
  guard.kept = true;
}

bool LlmcFile::is_one(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  int32_t magic = 0;
  return in.read(reinterpret_cast<char*>(&magic), 4) && magic == kMagic;
}

LlmcFile::LlmcFile(const std::string& path)
    : path_(path), file_(path, sizeof header_, "llm.c's 1024-byte header") {
  const size_t size_ = file_.size();
  std::memcpy(header_, file_.data(), sizeof header_);
  auto bad = [&](const std::string& what) { return DataError(fmt::format("{}: {}", path, what)); };
  if (header_[0] != kMagic) throw bad(fmt::format("magic {}, not llm.c's {}", header_[0], kMagic));
  if (header_[1] != 3 && header_[1] != 5)
    throw bad(fmt::format("version {}: llm.c writes 3 (fp32) or 5 (bf16)", header_[1]));
  const char* names[] = {"max_seq_len", "vocab_size", "n_layer", "n_head", "d_model"};
  for (int i = 2; i <= 6; i++)
    if (header_[i] <= 0 || header_[i] > (1 << 24))
      throw bad(fmt::format("header {} = {}, not a size", names[i - 2], header_[i]));
  if (header_[7] != padded(header_[3]))
    throw bad(fmt::format("padded_vocab_size {}, expected {} (vocab_size {} rounded up to 128)",
                          header_[7], padded(header_[3]), header_[3]));
  // The size the header implies, before anything is laid out (a forged header must not make
  // the reader build billions of names): exact in 128 bits, each field at most 2^24.
  {
    const __int128 C = header_[6], L = header_[4], T = header_[2], Vp = header_[7];
    const __int128 elements = Vp * C + T * C + L * (12 * C * C + 13 * C) + 2 * C;
    const __int128 bytes = __int128(sizeof header_) + elements * (header_[1] == 5 ? 2 : 4);
    if (bytes != __int128(size_))
      throw bad(fmt::format("{} bytes, the header's model needs {}", size_,
                            int64_t(std::min<__int128>(bytes, INT64_MAX))));
  }
  model_.seq_len = header_[2];
  model_.vocab_size = header_[3];
  model_.n_layer = header_[4];
  model_.n_head = header_[5];
  model_.d_model = header_[6];
  int64_t total = 0;  // the size matched above
  for (const auto& [name, at] : layout(model_, total)) offsets_.emplace(name, at);
}

LlmcFile::~LlmcFile() = default;

void LlmcFile::check(const ModelConfig& m) const {
  std::vector<std::string> wrong;
  auto field = [&](const char* theirs, int64_t value, const char* ours, int64_t our_value) {
    if (value != our_value)
      wrong.push_back(fmt::format("{} = {}, [model] {} = {}", theirs, value, ours, our_value));
  };
  if (m.arch != Arch::gpt2 || !m.tie_embeddings || !m.bias)
    wrong.push_back(fmt::format("llm.c's GPT-2 (tied embeddings, biases), [model] arch = {}{}{}",
                                arch_name(m.arch), m.tie_embeddings ? "" : ", untied",
                                m.bias ? "" : ", bias = false"));
  field("max_seq_len", model_.seq_len, "seq_len", m.seq_len);
  field("vocab_size", model_.vocab_size, "vocab_size", m.vocab_size);
  field("n_layer", model_.n_layer, "n_layer", m.n_layer);
  field("n_head", model_.n_head, "n_head", m.n_head);
  field("d_model", model_.d_model, "d_model", m.d_model);
  if (!wrong.empty()) throw CheckpointError(fmt::format("{}: {}", path_, fmt::join(wrong, "; ")));
}

void LlmcFile::read_part(const std::string& name, const std::vector<int64_t>& shape,
                         const std::vector<Box>& boxes, float* values) const {
  const auto it = offsets_.find(name);
  if (it == offsets_.end()) throw std::logic_error("LlmcFile::read_part: no tensor " + name);
  const int64_t offset = it->second;
  const bool bf16_file = header_[1] == 5;
  const std::byte* base = file_.data() + sizeof header_;
  auto value = [&](int64_t i) -> float {
    if (bf16_file) {
      uint16_t bits;
      std::memcpy(&bits, base + (offset + i) * 2, 2);
      return to_float(bf16{bits});
    }
    float x;
    std::memcpy(&x, base + (offset + i) * 4, 4);
    return x;
  };
  read_boxes(shape, boxes, value, values);
}

}  // namespace trainer
