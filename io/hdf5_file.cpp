#include "io/hdf5_file.h"

#include <fmt/format.h>

#include <algorithm>

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

}  // namespace

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); i++) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

H5File H5File::create(const std::string& path) {
  silence_hdf5();
  hid_t id = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  if (id < 0) throw H5Error(fmt::format("{}: cannot create HDF5 file", path));
  return H5File(path, id);
}

H5File H5File::open_read(const std::string& path) {
  silence_hdf5();
  hid_t id = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (id < 0) throw H5Error(fmt::format("{}: cannot open as an HDF5 file", path));
  return H5File(path, id);
}

H5File::~H5File() {
  if (id_ >= 0) H5Fclose(id_);
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

void H5File::write(const std::string& name, const std::vector<int64_t>& shape, const float* data) {
  std::vector<hsize_t> dims(shape.begin(), shape.end());
  Handle space{H5Screate_simple(int(dims.size()), dims.data(), nullptr), H5Sclose};
  Handle lcpl{H5Pcreate(H5P_LINK_CREATE), H5Pclose};
  H5Pset_create_intermediate_group(lcpl.id, 1);
  // Chunked with HDF5's Fletcher32 checksum filter: a flipped byte fails the read. Chunks of at
  // most ~1M elements along the first dimension (HDF5 caps a chunk at 4 GB).
  Handle dcpl{H5Pcreate(H5P_DATASET_CREATE), H5Pclose};
  if (!dims.empty() && dims[0] > 0) {
    std::vector<hsize_t> chunk = dims;
    hsize_t row = 1;
    for (size_t d = 1; d < dims.size(); d++) row *= std::max<hsize_t>(dims[d], 1);
    chunk[0] = std::clamp<hsize_t>((hsize_t(1) << 20) / std::max<hsize_t>(row, 1), 1, dims[0]);
    H5Pset_chunk(dcpl.id, int(chunk.size()), chunk.data());
    H5Pset_fletcher32(dcpl.id);
  }
  Handle ds{H5Dcreate2(id_, name.c_str(), H5T_IEEE_F32LE, space.id, lcpl.id, dcpl.id, H5P_DEFAULT),
            H5Dclose};
  if (ds.id < 0 || H5Dwrite(ds.id, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0)
    throw H5Error(fmt::format("{}: cannot write dataset {}", path_, name));
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
  if (H5Fflush(id_, H5F_SCOPE_GLOBAL) < 0) throw H5Error(fmt::format("{}: flush failed", path_));
}

}  // namespace trainer
