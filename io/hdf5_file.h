#pragma once
// A small RAII wrapper over the HDF5 C API: datasets of float with full logical shapes in
// nested groups ("params/h.0.ln1.weight"), and scalar attributes on the root. Every failure is
// an H5Error naming the file and the object.
#include <hdf5.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "io/errors.h"

namespace trainer {

// A missing or damaged HDF5 file or object is bad input like any other.
class H5Error : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
};

class H5File {
 public:
  static H5File create(const std::string& path);  // truncates
  static H5File open_read(const std::string& path);
  ~H5File();
  H5File(H5File&& o) noexcept : path_(std::move(o.path_)), id_(o.id_) { o.id_ = -1; }
  H5File(const H5File&) = delete;
  H5File& operator=(const H5File&) = delete;

  const std::string& path() const { return path_; }
  bool exists(const std::string& name) const;

  void write(const std::string& name, const std::vector<int64_t>& shape, const float* data);
  std::vector<int64_t> shape(const std::string& name) const;
  // Reads into data, after checking the stored shape equals `shape`.
  void read(const std::string& name, const std::vector<int64_t>& shape, float* data) const;

  void set_attr(const std::string& name, int64_t value);
  void set_attr(const std::string& name, double value);
  void set_attr(const std::string& name, const std::string& value);
  int64_t attr_int(const std::string& name) const;
  double attr_double(const std::string& name) const;
  bool exists_attr(const std::string& name) const;
  std::string attr_string(const std::string& name) const;

  void flush();

 private:
  H5File(std::string path, hid_t id) : path_(std::move(path)), id_(id) {}
  std::string path_;
  hid_t id_ = -1;
};

std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace trainer
