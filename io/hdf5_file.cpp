#include "io/hdf5_file.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace trainer {
namespace {

// HDF5 prints its error stack by default; we report our own one-line errors instead.
void silence_hdf5() {
  static const bool once = [] {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    return true;
  }();
  (void)once;
}

// Owns one HDF5 identifier.
struct Handle {
  hid_t id;
  herr_t (*close)(hid_t);
  ~Handle() {
    if (id >= 0) close(id);
  }
};

// HDF5's metadata cache grows towards 32 MB while a file is written (a checkpoint of a deep
// model has thousands of datasets, each with its header and chunk index): capped, so that what a
// checkpoint write holds is bounded and in the memory plan.
void cap_metadata_cache(hid_t fapl, const std::string& path) {
  H5AC_cache_config_t c{};
  c.version = H5AC__CURR_CACHE_CONFIG_VERSION;
  bool ok = H5Pget_mdc_config(fapl, &c) >= 0;
  c.set_initial_size = true;
  c.min_size = H5File::kMetadataCacheBytes / 4;
  c.initial_size = c.min_size;
  c.max_size = H5File::kMetadataCacheBytes;
  ok = ok && H5Pset_mdc_config(fapl, &c) >= 0;
  if (!ok) throw H5Error(fmt::format("{}: HDF5 refused the metadata cache's settings", path));
}

}  // namespace

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); i++) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

H5File H5File::create(const std::string& path) {
  silence_hdf5();
  Handle fapl{H5Pcreate(H5P_FILE_ACCESS), H5Pclose};
  cap_metadata_cache(fapl.id, path);
  hid_t id = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.id);
  if (id < 0) throw H5Error(fmt::format("{}: cannot create HDF5 file", path));
  return H5File(path, id);
}

H5File H5File::create_parallel(const std::string& path, MPI_Comm comm) {
  silence_hdf5();
  Handle fapl{H5Pcreate(H5P_FILE_ACCESS), H5Pclose};
  cap_metadata_cache(fapl.id, path);
  H5Pset_fapl_mpio(fapl.id, comm, MPI_INFO_NULL);
  // Metadata (creating groups, datasets, attributes) is done by all ranks together.
  H5Pset_all_coll_metadata_ops(fapl.id, true);
  H5Pset_coll_metadata_write(fapl.id, true);
  hid_t id = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.id);
  if (id < 0) throw H5Error(fmt::format("{}: cannot create HDF5 file (parallel)", path));
  // Filtered (checksummed) datasets can only be written collectively.
  hid_t xfer = H5Pcreate(H5P_DATASET_XFER);
  H5Pset_dxpl_mpio(xfer, H5FD_MPIO_COLLECTIVE);
  return H5File(path, id, xfer, comm);
}

H5File H5File::open_read(const std::string& path) {
  silence_hdf5();
  hid_t id = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (id < 0) throw H5Error(fmt::format("{}: cannot open as an HDF5 file", path));
  return H5File(path, id);
}

H5File::~H5File() {
  if (xfer_ >= 0) H5Pclose(xfer_);
  if (id_ >= 0) H5Fclose(id_);
}

void H5File::close() {
  const hid_t id = std::exchange(id_, -1);
  errno = 0;
  if (id >= 0 && H5Fclose(id) < 0) {
    const int error = errno;
    throw H5Error(fmt::format("{}: cannot close the HDF5 file: {}", path_,
                              error ? std::strerror(error) : "write failed (disk full?)"));
  }
}

bool H5File::exists(const std::string& name) const {
  // H5Lexists needs every parent to exist, so walk the path one component at a time.
  size_t pos = 0;
  while (true) {
    pos = name.find('/', pos + 1);
    std::string prefix = name.substr(0, pos);
    if (H5Lexists(id_, prefix.c_str(), H5P_DEFAULT) <= 0) return false;
    if (pos == std::string::npos) return true;
  }
}

namespace {

// A float dataset of any rank, chunked along its first dimension with HDF5's Fletcher32
// checksum filter (a flipped byte fails the read); groups on its path are created.
hid_t create_dataset(hid_t file, const std::string& path, const std::string& name,
                     const std::vector<hsize_t>& dims, hid_t type = H5T_IEEE_F32LE) {
  Handle space{H5Screate_simple(int(dims.size()), dims.data(), nullptr), H5Sclose};
  Handle lcpl{H5Pcreate(H5P_LINK_CREATE), H5Pclose};
  H5Pset_create_intermediate_group(lcpl.id, 1);
  Handle dcpl{H5Pcreate(H5P_DATASET_CREATE), H5Pclose};
  if (!dims.empty() && dims[0] > 0) {
    // As many rows as fit ~1M elements (HDF5 caps a chunk at 4 GB), evened out over the
    // chunks: HDF5 stores a partial last chunk at full size.
    std::vector<hsize_t> chunk = dims;
    hsize_t row = 1;
    for (size_t d = 1; d < dims.size(); d++) row *= std::max<hsize_t>(dims[d], 1);
    const hsize_t most = std::clamp<hsize_t>((hsize_t(1) << 20) / row, 1, dims[0]);
    const hsize_t chunks = (dims[0] + most - 1) / most;
    chunk[0] = (dims[0] + chunks - 1) / chunks;
    H5Pset_chunk(dcpl.id, int(chunk.size()), chunk.data());
    H5Pset_fletcher32(dcpl.id);
  }
  const hid_t ds = H5Dcreate2(file, name.c_str(), type, space.id, lcpl.id, dcpl.id, H5P_DEFAULT);
  if (ds < 0) throw H5Error(fmt::format("{}: cannot create dataset {}", path, name));
  return ds;
}

}  // namespace

void H5File::write(const std::string& name, const std::vector<int64_t>& shape, const float* data) {
  Handle ds{create_dataset(id_, path_, name, {shape.begin(), shape.end()}), H5Dclose};
  if (H5Dwrite(ds.id, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, xfer_ >= 0 ? xfer_ : H5P_DEFAULT, data) <
      0)
    throw H5Error(fmt::format("{}: cannot write dataset {} (disk full?)", path_, name));
}

void H5File::write_part(const std::string& name, const std::vector<int64_t>& shape,
                        const std::vector<Box>& boxes, const float* values) {
  if (shape.empty() || shape.size() > 2)
    throw std::logic_error("H5File::write_part: 1-D and 2-D datasets only");
  const std::vector<hsize_t> dims(shape.begin(), shape.end());
  Handle ds{create_dataset(id_, path_, name, dims), H5Dclose};
  Handle space{H5Dget_space(ds.id), H5Sclose};
  // One write per box, each from a memory block of the box's own shape: HDF5 maps same-shaped
  // selections chunk by chunk (a 1-D buffer against a 2-D selection goes element by element).
  // In a parallel file every rank makes as many (collective) writes as the rank with the most
  // boxes, empty ones to make up its count.
  const hid_t xfer = xfer_ >= 0 ? xfer_ : H5P_DEFAULT;
  int n = int(boxes.size());
  if (comm_ != MPI_COMM_NULL && MPI_Allreduce(MPI_IN_PLACE, &n, 1, MPI_INT, MPI_MAX, comm_) != 0)
    throw H5Error(fmt::format("{}: cannot agree on the writes of dataset {}", path_, name));
  for (int w = 0; w < n; w++) {
    const Box b = w < int(boxes.size()) ? boxes[w] : Box{0, 0, 0, 0};
    const bool empty = b.rows <= 0 || b.cols <= 0;
    hsize_t start[2] = {hsize_t(b.row), hsize_t(b.col)};
    hsize_t count[2] = {hsize_t(std::max<int64_t>(b.rows, 1)),
                        hsize_t(std::max<int64_t>(b.cols, 1))};
    if (dims.size() == 1) start[0] = hsize_t(b.col), count[0] = count[1];
    Handle memory{H5Screate_simple(int(dims.size()), count, nullptr), H5Sclose};
    if (empty) {
      H5Sselect_none(space.id);
      H5Sselect_none(memory.id);
    } else {
      H5Sselect_hyperslab(space.id, H5S_SELECT_SET, start, nullptr, count, nullptr);
    }
    const float dummy = 0;
    if (H5Dwrite(ds.id, H5T_NATIVE_FLOAT, memory.id, space.id, xfer, empty ? &dummy : values) < 0)
      throw H5Error(fmt::format("{}: cannot write dataset {} (disk full?)", path_, name));
    if (!empty) values += b.rows * b.cols;
  }
}

void H5File::write_bytes(const std::string& name, const std::string& bytes) {
  const hsize_t n = bytes.size();
  Handle ds{create_dataset(id_, path_, name, {n}, H5T_STD_U8LE), H5Dclose};
  Handle space{H5Dget_space(ds.id), H5Sclose};
  // In a parallel file every rank holds the same bytes and rank 0 writes them.
  int rank = 0;
  if (comm_ != MPI_COMM_NULL) MPI_Comm_rank(comm_, &rank);
  Handle memory{H5Screate_simple(1, &n, nullptr), H5Sclose};
  if (rank != 0 || n == 0) {
    H5Sselect_none(space.id);
    H5Sselect_none(memory.id);
  }
  const char dummy = 0;
  if (H5Dwrite(ds.id, H5T_NATIVE_UCHAR, memory.id, space.id, xfer_ >= 0 ? xfer_ : H5P_DEFAULT,
               n ? bytes.data() : &dummy) < 0)
    throw H5Error(fmt::format("{}: cannot write dataset {} (disk full?)", path_, name));
}

std::string H5File::read_bytes(const std::string& name) const {
  const std::vector<int64_t> found = shape(name);
  if (found.size() != 1)
    throw H5Error(fmt::format("{}: dataset {} has shape {}, expected bytes (one dimension)", path_,
                              name, shape_string(found)));
  std::string bytes(size_t(found[0]), '\0');
  Handle ds{H5Dopen2(id_, name.c_str(), H5P_DEFAULT), H5Dclose};
  if (!bytes.empty() &&
      H5Dread(ds.id, H5T_NATIVE_UCHAR, H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data()) < 0)
    throw H5Error(fmt::format("{}: cannot read dataset {} (corrupt?)", path_, name));
  return bytes;
}

std::vector<int64_t> H5File::shape(const std::string& name) const {
  if (!exists(name)) throw H5Error(fmt::format("{}: dataset {} is missing", path_, name));
  Handle ds{H5Dopen2(id_, name.c_str(), H5P_DEFAULT), H5Dclose};
  Handle space{H5Dget_space(ds.id), H5Sclose};
  int rank = H5Sget_simple_extent_ndims(space.id);
  if (rank < 0) throw H5Error(fmt::format("{}: {} is not a dataset", path_, name));
  std::vector<hsize_t> dims(rank);
  H5Sget_simple_extent_dims(space.id, dims.data(), nullptr);
  return {dims.begin(), dims.end()};
}

void H5File::read(const std::string& name, const std::vector<int64_t>& expected,
                  float* data) const {
  std::vector<int64_t> found = shape(name);
  if (found != expected)
    throw H5Error(fmt::format("{}: dataset {} has shape {}, the model expects {}", path_, name,
                              shape_string(found), shape_string(expected)));
  Handle ds{H5Dopen2(id_, name.c_str(), H5P_DEFAULT), H5Dclose};
  if (H5Dread(ds.id, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0)
    throw H5Error(fmt::format("{}: cannot read dataset {} (corrupt?)", path_, name));
}

void H5File::read_part(const std::string& name, const std::vector<int64_t>& expected,
                       const std::vector<Box>& boxes, float* values) const {
  std::vector<int64_t> found = shape(name);
  if (found != expected)
    throw H5Error(fmt::format("{}: dataset {} has shape {}, the model expects {}", path_, name,
                              shape_string(found), shape_string(expected)));
  if (found.empty() || found.size() > 2)
    throw std::logic_error("H5File::read_part: 1-D and 2-D datasets only");
  Handle ds{H5Dopen2(id_, name.c_str(), H5P_DEFAULT), H5Dclose};
  Handle space{H5Dget_space(ds.id), H5Sclose};
  for (const Box& b : boxes) {
    if (b.rows <= 0 || b.cols <= 0) continue;
    hsize_t start[2] = {hsize_t(b.row), hsize_t(b.col)},
            count[2] = {hsize_t(b.rows), hsize_t(b.cols)};
    if (found.size() == 1) start[0] = hsize_t(b.col), count[0] = hsize_t(b.cols);
    Handle memory{H5Screate_simple(int(found.size()), count, nullptr), H5Sclose};
    H5Sselect_hyperslab(space.id, H5S_SELECT_SET, start, nullptr, count, nullptr);
    if (H5Dread(ds.id, H5T_NATIVE_FLOAT, memory.id, space.id, H5P_DEFAULT, values) < 0)
      throw H5Error(fmt::format("{}: cannot read dataset {} (corrupt?)", path_, name));
    values += b.rows * b.cols;
  }
}

void H5File::set_attr(const std::string& name, int64_t value) {
  Handle space{H5Screate(H5S_SCALAR), H5Sclose};
  Handle a{H5Acreate2(id_, name.c_str(), H5T_STD_I64LE, space.id, H5P_DEFAULT, H5P_DEFAULT),
           H5Aclose};
  if (a.id < 0 || H5Awrite(a.id, H5T_NATIVE_INT64, &value) < 0)
    throw H5Error(fmt::format("{}: cannot write attribute {}", path_, name));
}

void H5File::set_attr(const std::string& name, double value) {
  Handle space{H5Screate(H5S_SCALAR), H5Sclose};
  Handle a{H5Acreate2(id_, name.c_str(), H5T_IEEE_F64LE, space.id, H5P_DEFAULT, H5P_DEFAULT),
           H5Aclose};
  if (a.id < 0 || H5Awrite(a.id, H5T_NATIVE_DOUBLE, &value) < 0)
    throw H5Error(fmt::format("{}: cannot write attribute {}", path_, name));
}

void H5File::set_attr(const std::string& name, const std::string& value) {
  Handle type{H5Tcopy(H5T_C_S1), H5Tclose};
  H5Tset_size(type.id, std::max<size_t>(1, value.size()));
  H5Tset_cset(type.id, H5T_CSET_UTF8);
  Handle space{H5Screate(H5S_SCALAR), H5Sclose};
  Handle a{H5Acreate2(id_, name.c_str(), type.id, space.id, H5P_DEFAULT, H5P_DEFAULT), H5Aclose};
  std::string padded = value.empty() ? std::string(1, '\0') : value;
  if (a.id < 0 || H5Awrite(a.id, type.id, padded.data()) < 0)
    throw H5Error(fmt::format("{}: cannot write attribute {}", path_, name));
}

namespace {

// A one-dimensional attribute of `file_type`, read and written as `memory_type`.
template <class T>
void write_array_attr(hid_t id, const std::string& path, const std::string& name,
                      const std::vector<T>& values, hid_t file_type, hid_t memory_type) {
  const hsize_t n = values.size();
  Handle space{H5Screate_simple(1, &n, nullptr), H5Sclose};
  Handle a{H5Acreate2(id, name.c_str(), file_type, space.id, H5P_DEFAULT, H5P_DEFAULT), H5Aclose};
  if (a.id < 0 || H5Awrite(a.id, memory_type, values.data()) < 0)
    throw H5Error(fmt::format("{}: cannot write attribute {}", path, name));
}

template <class T>
std::vector<T> read_array_attr(hid_t id, const std::string& path, const std::string& name,
                               hid_t memory_type) {
  Handle a{H5Aopen(id, name.c_str(), H5P_DEFAULT), H5Aclose};
  if (a.id < 0) throw H5Error(fmt::format("{}: attribute {} is missing", path, name));
  Handle space{H5Aget_space(a.id), H5Sclose};
  std::vector<T> v(std::max<hssize_t>(H5Sget_simple_extent_npoints(space.id), 0));
  if (H5Aread(a.id, memory_type, v.data()) < 0)
    throw H5Error(fmt::format("{}: cannot read attribute {}", path, name));
  return v;
}

}  // namespace

void H5File::set_attr(const std::string& name, const std::vector<double>& values) {
  write_array_attr(id_, path_, name, values, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE);
}

void H5File::set_attr(const std::string& name, const std::vector<int64_t>& values) {
  write_array_attr(id_, path_, name, values, H5T_STD_I64LE, H5T_NATIVE_INT64);
}

std::vector<double> H5File::attr_doubles(const std::string& name) const {
  return read_array_attr<double>(id_, path_, name, H5T_NATIVE_DOUBLE);
}

std::vector<int64_t> H5File::attr_ints(const std::string& name) const {
  return read_array_attr<int64_t>(id_, path_, name, H5T_NATIVE_INT64);
}

int64_t H5File::attr_int(const std::string& name) const {
  Handle a{H5Aopen(id_, name.c_str(), H5P_DEFAULT), H5Aclose};
  int64_t v = 0;
  if (a.id < 0 || H5Aread(a.id, H5T_NATIVE_INT64, &v) < 0)
    throw H5Error(fmt::format("{}: attribute {} is missing", path_, name));
  return v;
}

double H5File::attr_double(const std::string& name) const {
  Handle a{H5Aopen(id_, name.c_str(), H5P_DEFAULT), H5Aclose};
  double v = 0;
  if (a.id < 0 || H5Aread(a.id, H5T_NATIVE_DOUBLE, &v) < 0)
    throw H5Error(fmt::format("{}: attribute {} is missing", path_, name));
  return v;
}

bool H5File::exists_attr(const std::string& name) const {
  return H5Aexists(id_, name.c_str()) > 0;
}

std::string H5File::attr_string(const std::string& name) const {
  Handle a{H5Aopen(id_, name.c_str(), H5P_DEFAULT), H5Aclose};
  if (a.id < 0) throw H5Error(fmt::format("{}: attribute {} is missing", path_, name));
  Handle type{H5Aget_type(a.id), H5Tclose};
  size_t n = H5Tget_size(type.id);
  std::string s(n, '\0');
  if (H5Aread(a.id, type.id, s.data()) < 0)
    throw H5Error(fmt::format("{}: cannot read attribute {}", path_, name));
  while (!s.empty() && s.back() == '\0') s.pop_back();
  return s;
}

void H5File::flush() {
  if (H5Fflush(id_, H5F_SCOPE_GLOBAL) < 0)
    throw H5Error(fmt::format("{}: flush failed (disk full?)", path_));
}

}  // namespace trainer
