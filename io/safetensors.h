#pragma once
// The safetensors format (Hugging Face's; what `torch`, `transformers` and most tools exchange
// weights in): a little-endian u64 N, N bytes of JSON header (padded with spaces to a multiple of
// 8), then the tensors' bytes. The header maps each tensor's name to
// {"dtype": "F32" | "BF16" | ..., "shape": [...], "data_offsets": [begin, end]} (offsets into the
// bytes after the header) and may hold "__metadata__": {string: string}.
//
// The reader maps the file and checks the whole header before anything is read: a header that is
// not JSON, an unknown dtype, a shape and offsets that disagree, offsets past the end of the file
// or tensors that overlap are one DataError naming the file and the tensor (exit 2).
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "io/hdf5_file.h"  // Box
#include "io/mapped_file.h"

namespace trainer {

class SafetensorsFile {
 public:
  struct Tensor {
    std::string dtype;  // "F32", "F16", "BF16", "F64", ...
    std::vector<int64_t> shape;
    int64_t begin = 0, end = 0;  // bytes, from the start of the data
  };

  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  // Named *.safetensors, or a regular file that starts like one: a header length within the
  // file, then "{".
  static bool is_one(const std::string& path);
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, Tensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool exists(const std::string& name) const { return tensors_.count(name) > 0; }
  const Tensor& at(const std::string& name) const;

  // Reads only `boxes` of a 1-D or 2-D tensor of shape `shape` (as H5File::read_part does),
  // converted to fp32 from F32, F64, BF16 or F16. A tensor of another shape or dtype is a
  // DataError naming it.
  void read_part(const std::string& name, const std::vector<int64_t>& shape,
                 const std::vector<Box>& boxes, float* values) const;

 private:
  std::string path_;
  MappedFile file_;
  const std::byte* data_ = nullptr;  // after the header
  std::map<std::string, Tensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Bytes per element of a safetensors dtype name, or 0 for a name the format does not have.
int safetensors_dtype_size(const std::string& dtype);

// Writes a safetensors file tensor by tensor, so that a model larger than memory can be
// exported: add() each tensor's header entry first, then write() the tensors' data in the same
// order. The file appears atomically at close() (written beside it and renamed).
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, std::map<std::string, std::string> metadata);
  ~SafetensorsWriter();
  // dtype: "F32", "BF16" or "F16" (values arrive as fp32 and are rounded to nearest even).
  void add(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape);
  void write(const std::string& name, const float* values);
  void close();

 private:
  struct Entry {
    std::string name, dtype;
    std::vector<int64_t> shape;
    int64_t begin, end;
  };
  void start_data();

  std::string path_, tmp_;
  std::map<std::string, std::string> metadata_;
  std::vector<Entry> entries_;
  size_t written_ = 0;  // entries whose data is in the file
  int64_t bytes_ = 0;
  void* file_ = nullptr;  // FILE*, once the header is out
};

}  // namespace trainer
