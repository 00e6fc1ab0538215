#pragma once
// A small RAII wrapper over the HDF5 C API: datasets of float with full logical shapes in
// nested groups ("params/h.0.ln1.weight"), and scalar attributes on the root. Every failure is
// an H5Error naming the file and the object. A file created over an MPI communicator is written
// with parallel HDF5 (MPI-IO): every call is then collective, and each rank writes its own part
// of a dataset.
#include <hdf5.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "io/errors.h"

namespace trainer {

// A missing or damaged HDF5 file or object is bad input like any other.
class H5Error : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
};

// A rectangle of a dataset seen as (rows, last dimension): 1-D datasets are one row.
struct Box {
  int64_t row, col, rows, cols;
};

// The elements of `boxes` of a row-major tensor of `shape` (1-D: the columns of its one row),
// box after box, each in row-major order, into `out`: value(i) is the tensor's element i. What
// H5File::read_part reads, for the readers of other formats.
template <class Value>
float* read_boxes(const std::vector<int64_t>& shape, const std::vector<Box>& boxes, Value value,
                  float* out) {
  const int64_t cols = shape.back();
  for (const Box& b : boxes) {
    if (b.rows <= 0 || b.cols <= 0) continue;
    const int64_t row0 = shape.size() == 1 ? 0 : b.row;
    for (int64_t r = 0; r < b.rows; r++)
      for (int64_t c = 0; c < b.cols; c++) *out++ = value((row0 + r) * cols + b.col + c);
  }
  return out;
}

class H5File {
 public:
  // The most HDF5's metadata cache holds for a file this writes (HDF5's own default grows to
  // 32 MB).
  static constexpr size_t kMetadataCacheBytes = size_t(4) << 20;
  static H5File create(const std::string& path);  // truncates
  // Collective over `comm`: one file written by all its ranks through MPI-IO.
  static H5File create_parallel(const std::string& path, MPI_Comm comm);
  static H5File open_read(const std::string& path);
  ~H5File();
  H5File(H5File&& o) noexcept
      : path_(std::move(o.path_)),
        id_(std::exchange(o.id_, -1)),
        xfer_(std::exchange(o.xfer_, -1)),
        comm_(o.comm_) {}
  H5File(const H5File&) = delete;
  H5File& operator=(const H5File&) = delete;

  const std::string& path() const { return path_; }
  bool exists(const std::string& name) const;

  // Chunked, each chunk with a Fletcher32 checksum.
  void write(const std::string& name, const std::vector<int64_t>& shape, const float* data);
  // Creates the dataset (collectively, in a parallel file) and writes this rank's part:
  // `boxes` (none is fine), whose elements `values` holds box after box, each in row-major
  // order.
  void write_part(const std::string& name, const std::vector<int64_t>& shape,
                  const std::vector<Box>& boxes, const float* values);
  // A 1-D dataset of raw bytes (chunked and checksummed like the others). In a parallel file
  // every rank passes the same bytes.
  void write_bytes(const std::string& name, const std::string& bytes);
  std::string read_bytes(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  // Reads into data, after checking the stored shape equals `shape`.
  void read(const std::string& name, const std::vector<int64_t>& shape, float* data) const;
  // Reads only `boxes` (1-D and 2-D datasets), box after box, each in row-major order.
  void read_part(const std::string& name, const std::vector<int64_t>& shape,
                 const std::vector<Box>& boxes, float* values) const;

  void set_attr(const std::string& name, int64_t value);
  void set_attr(const std::string& name, double value);
  void set_attr(const std::string& name, const std::string& value);
  void set_attr(const std::string& name, const std::vector<double>& values);   // non-empty
  void set_attr(const std::string& name, const std::vector<int64_t>& values);  // non-empty
  int64_t attr_int(const std::string& name) const;
  double attr_double(const std::string& name) const;
  bool exists_attr(const std::string& name) const;
  std::string attr_string(const std::string& name) const;
  std::vector<double> attr_doubles(const std::string& name) const;
  std::vector<int64_t> attr_ints(const std::string& name) const;

  void flush();
  // Closes the file, reporting a failure (data still buffered when the disk fills) as an error.
  void close();

 private:
  H5File(std::string path, hid_t id, hid_t xfer = -1, MPI_Comm comm = MPI_COMM_NULL)
      : path_(std::move(path)), id_(id), xfer_(xfer), comm_(comm) {}
  std::string path_;
  hid_t id_ = -1;
  hid_t xfer_ = -1;  // the data-transfer properties: collective MPI-IO in a parallel file
  MPI_Comm comm_;    // the ranks writing a parallel file (MPI_COMM_NULL: one process)
};

std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace trainer
