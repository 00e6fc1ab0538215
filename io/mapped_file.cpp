#include "io/mapped_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "io/errors.h"

namespace trainer {

MappedFile::MappedFile(const std::string& path, size_t min_bytes, const std::string& what) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just below).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw DataError(fmt::format("{}: cannot open: {}", path, strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw DataError(fmt::format("{}: not a regular file", path));
  }
  size_ = size_t(st.st_size);
  if (size_ < min_bytes) {
    ::close(fd);
    throw DataError(
        fmt::format("{}: {} bytes, too short for {} (at least {})", path, size_, what, min_bytes));
  }
  void* m = size_ ? ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0) : nullptr;
  ::close(fd);
  if (m == MAP_FAILED) throw DataError(fmt::format("{}: cannot map: {}", path, strerror(errno)));
  data_ = static_cast<const std::byte*>(m);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<std::byte*>(data_), size_);
}

}  // namespace trainer
