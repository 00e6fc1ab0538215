#include "io/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "io/atomic_file.h"
#include "io/errors.h"
#include "io/mapped_file.h"
#include "kernels/half.h"

namespace trainer {

namespace {

// A header larger than this is not a weights file (the format's own limit is 100 MB).
constexpr uint64_t kMaxHeader = 100u << 20;

std::string shape_text(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

}  // namespace

int safetensors_dtype_size(const std::string& dtype) {
  static const std::map<std::string, int> sizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2},  {"BF16", 2},    {"I64", 8},
      {"I32", 4}, {"I16", 2}, {"I8", 1},   {"U64", 8},     {"U32", 4},
      {"U16", 2}, {"U8", 1},  {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

bool SafetensorsFile::is_one(const std::string& path) {
  if (path.ends_with(".safetensors")) return true;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < 10) return false;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return false;
  unsigned char head[9] = {};
  const bool read = std::fread(head, 1, 9, f) == 9;
  std::fclose(f);
  uint64_t n = 0;
  std::memcpy(&n, head, 8);
  return read && head[8] == '{' && n >= 2 && n <= uint64_t(st.st_size) - 8;
}

SafetensorsFile::SafetensorsFile(const std::string& path)
    : path_(path), file_(path, 8, "a safetensors file") {
  const std::byte* map_ = file_.data();
  const size_t size_ = file_.size();
  {
    uint64_t n = 0;
    std::memcpy(&n, map_, 8);  // little-endian, as every machine this runs on
    if (n > kMaxHeader || n > size_ - 8)
      throw DataError(fmt::format(
          "{}: header length {} (the first 8 bytes) is past the end of the file ({} bytes) or "
          "over the format's 100 MB: not a safetensors file",
          path, n, size_));
    data_ = map_ + 8 + n;
    const int64_t data_bytes = int64_t(size_ - 8 - n);
    nlohmann::json header;
    try {
      header = nlohmann::json::parse(reinterpret_cast<const char*>(map_ + 8),
                                     reinterpret_cast<const char*>(data_));
    } catch (const nlohmann::json::exception& e) {
      throw DataError(fmt::format("{}: the header is not JSON ({})", path, e.what()));
    }
    if (!header.is_object())
      throw DataError(fmt::format("{}: the header is JSON but not an object", path));
    for (const auto& [name, entry] : header.items()) {
      auto bad = [&](const std::string& what) {
        return DataError(fmt::format("{}: tensor {}: {}", path, name, what));
      };
      if (name == "__metadata__") {
        if (!entry.is_object()) throw bad("expected an object of strings");
        for (const auto& [key, value] : entry.items()) {
          if (!value.is_string()) throw bad(fmt::format("{} is not a string", key));
          metadata_[key] = value.get<std::string>();
        }
        continue;
      }
      if (!entry.is_object() || !entry.contains("dtype") || !entry["dtype"].is_string() ||
          !entry.contains("shape") || !entry["shape"].is_array() ||
          !entry.contains("data_offsets") || !entry["data_offsets"].is_array() ||
          entry["data_offsets"].size() != 2)
        throw bad("expected {\"dtype\": string, \"shape\": [...], \"data_offsets\": [begin, end]}");
      Tensor t;
      t.dtype = entry["dtype"].get<std::string>();
      const int size = safetensors_dtype_size(t.dtype);
      if (size == 0) throw bad(fmt::format("unknown dtype \"{}\"", t.dtype));
      int64_t numel = 1;
      for (const auto& d : entry["shape"]) {
        if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t(1) << 40))
          throw bad(fmt::format("shape {} is not a list of sizes", entry["shape"].dump()));
        t.shape.push_back(d.get<int64_t>());
        constexpr int64_t kMaxElements = int64_t(1) << 48;
        if (t.shape.back() != 0 && numel > kMaxElements / t.shape.back())
          throw bad("more elements than any model has");
        numel *= t.shape.back();
      }
      for (const auto& o : entry["data_offsets"])
        if (!o.is_number_unsigned() || o.get<uint64_t>() > uint64_t(data_bytes))
          throw bad(fmt::format("data_offsets {} past the end of the data ({} bytes)",
                                entry["data_offsets"].dump(), data_bytes));
      t.begin = entry["data_offsets"][0].get<int64_t>();
      t.end = entry["data_offsets"][1].get<int64_t>();
      if (t.end < t.begin)
        throw bad(fmt::format("data_offsets [{}, {}] end before they begin", t.begin, t.end));
      if (t.end - t.begin != numel * size)
        throw bad(fmt::format("data_offsets [{}, {}] hold {} bytes, shape {} of {} needs {}",
                              t.begin, t.end, t.end - t.begin, shape_text(t.shape), t.dtype,
                              numel * size));
      tensors_[name] = std::move(t);
    }
    // No two tensors share bytes.
    std::vector<std::pair<const std::string*, const Tensor*>> order;
    for (const auto& [name, t] : tensors_) order.push_back({&name, &t});
    std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {  // empty ones first
      return std::pair(a.second->begin, a.second->end) < std::pair(b.second->begin, b.second->end);
    });
    for (size_t i = 1; i < order.size(); i++)
      if (order[i].second->begin < order[i - 1].second->end)
        throw DataError(fmt::format("{}: tensors {} and {} overlap (bytes [{}, {}) and [{}, {}))",
                                    path, *order[i - 1].first, *order[i].first,
                                    order[i - 1].second->begin, order[i - 1].second->end,
                                    order[i].second->begin, order[i].second->end));
  }
}

SafetensorsFile::~SafetensorsFile() = default;

const SafetensorsFile::Tensor& SafetensorsFile::at(const std::string& name) const {
  const auto it = tensors_.find(name);
  if (it == tensors_.end()) throw DataError(fmt::format("{}: no tensor {}", path_, name));
  return it->second;
}

void SafetensorsFile::read_part(const std::string& name, const std::vector<int64_t>& shape,
                                const std::vector<Box>& boxes, float* values) const {
  const Tensor& t = at(name);
  if (t.shape != shape)
    throw DataError(fmt::format("{}: tensor {} has shape {}, the model expects {}", path_, name,
                                shape_text(t.shape), shape_text(shape)));
  if (shape.empty() || shape.size() > 2)
    throw std::logic_error("SafetensorsFile::read_part: 1-D and 2-D tensors only");
  const std::byte* base = data_ + t.begin;
  auto value = [&](int64_t i) -> float {  // element i, converted (unaligned reads via memcpy)
    if (t.dtype == "F32") {
      float x;
      std::memcpy(&x, base + i * 4, 4);
      return x;
    }
    if (t.dtype == "BF16" || t.dtype == "F16") {
      uint16_t bits;
      std::memcpy(&bits, base + i * 2, 2);
      return t.dtype == "BF16" ? to_float(bf16{bits}) : to_float(f16{bits});
    }
    double x;
    std::memcpy(&x, base + i * 8, 8);
    return float(x);
  };
  if (t.dtype != "F32" && t.dtype != "BF16" && t.dtype != "F16" && t.dtype != "F64")
    throw DataError(
        fmt::format("{}: tensor {} is {}, not a floating-point weight", path_, name, t.dtype));
  read_boxes(shape, boxes, value, values);
}

SafetensorsWriter::SafetensorsWriter(std::string path, std::map<std::string, std::string> metadata)
    : path_(std::move(path)), metadata_(std::move(metadata)) {}

SafetensorsWriter::~SafetensorsWriter() {
  if (file_) {  // not closed: an error on the way; nothing half-written stays
    std::fclose(static_cast<FILE*>(file_));
    ::unlink(tmp_.c_str());
  }
}

void SafetensorsWriter::add(const std::string& name, const std::string& dtype,
                            const std::vector<int64_t>& shape) {
  if (file_) throw std::logic_error("SafetensorsWriter::add after write");
  if (dtype != "F32" && dtype != "BF16" && dtype != "F16")
    throw std::invalid_argument("SafetensorsWriter: F32, BF16 or F16");
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const int64_t end = bytes_ + numel * safetensors_dtype_size(dtype);
  entries_.push_back({name, dtype, shape, bytes_, end});
  bytes_ = end;
}

void SafetensorsWriter::start_data() {
  nlohmann::ordered_json header;
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  for (const Entry& e : entries_)
    header[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {e.begin, e.end}}};
  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');  // the data starts 8-byte aligned
  FILE* f = open_temporary_beside(path_, tmp_);
  file_ = f;
  const uint64_t n = text.size();
  if (std::fwrite(&n, 8, 1, f) != 1 || std::fwrite(text.data(), 1, text.size(), f) != text.size())
    throw DataError(fmt::format("{}: write failed: {}", tmp_, strerror(errno)));
}

void SafetensorsWriter::write(const std::string& name, const float* values) {
  if (!file_) start_data();
  if (written_ >= entries_.size() || entries_[written_].name != name)
    throw std::logic_error("SafetensorsWriter::write: tensors in the order they were added");
  const Entry& e = entries_[written_++];
  FILE* f = static_cast<FILE*>(file_);
  const int size = safetensors_dtype_size(e.dtype);
  const int64_t numel = (e.end - e.begin) / size;
  std::vector<uint16_t> half;
  constexpr int64_t kChunk = 1 << 20;
  for (int64_t at = 0; at < numel; at += kChunk) {
    const int64_t n = std::min(kChunk, numel - at);
    const void* bytes = values + at;
    if (e.dtype != "F32") {
      half.resize(size_t(n));
      for (int64_t i = 0; i < n; i++)
        half[i] = e.dtype == "BF16" ? to_bf16(values[at + i]).bits : to_f16(values[at + i]).bits;
      bytes = half.data();
    }
    if (std::fwrite(bytes, size_t(size), size_t(n), f) != size_t(n))
      throw DataError(fmt::format("{}: write failed: {}", tmp_, strerror(errno)));
  }
}

void SafetensorsWriter::close() {
  if (!file_) start_data();  // a file without tensors
  if (written_ != entries_.size())
    throw std::logic_error("SafetensorsWriter::close before every tensor was written");
  FILE* f = static_cast<FILE*>(file_);
  const bool ok = std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
  std::fclose(f);
  file_ = nullptr;
  if (!ok || std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const std::string why = strerror(errno);
    ::unlink(tmp_.c_str());
    throw DataError(fmt::format("{}: write failed: {}", path_, why));
  }
}

}  // namespace trainer
