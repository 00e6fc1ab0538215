#pragma once
// A whole regular file mapped read-only (weights files: safetensors, llm.c checkpoints), unmapped
// when destroyed.
#include <cstddef>
#include <string>

namespace trainer {

class MappedFile {
 public:
  // Throws DataError naming `path`: it cannot be opened, is not a regular file, or is shorter
  // than `min_bytes` (then `what` says what it should have been: "a safetensors file").
  MappedFile(const std::string& path, size_t min_bytes, const std::string& what);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  const std::byte* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace trainer
