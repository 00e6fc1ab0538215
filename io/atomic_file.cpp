#include "io/atomic_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "io/errors.h"

namespace trainer {

void fsync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0 && errno != EINVAL)  // some file systems cannot fsync directories
    throw DataError(fmt::format("{}: fsync failed: {}", path, strerror(errno)));
}

void check_space(const std::string& path, int64_t bytes) {
  const int fd = ::open(path.c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0644);
  if (fd < 0) throw DataError(fmt::format("{}: cannot create: {}", path, strerror(errno)));
  const int rc = ::fallocate(fd, 0, 0, bytes);
  const int error = errno;
  ::close(fd);
  ::unlink(path.c_str());
  if (rc != 0 && error != EOPNOTSUPP && error != ENOSYS)
    throw DataError(fmt::format("{}: no room for {:.1f} MB: {}", path, double(bytes) / (1 << 20),
                                strerror(error)));
}

void write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw DataError(fmt::format("{}: cannot write: {}", tmp, strerror(errno)));
  bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  ok = std::fflush(f) == 0 && ok;
  ok = ::fsync(fileno(f)) == 0 && ok;
  ok = std::fclose(f) == 0 && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = strerror(errno);
    std::remove(tmp.c_str());
    throw DataError(fmt::format("{}: write failed: {}", path, why));
  }
}

}  // namespace trainer
