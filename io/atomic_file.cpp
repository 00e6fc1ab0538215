#include "io/atomic_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
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

FILE* open_anonymous_file(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR, 0600);
  FILE* f = fd >= 0 ? ::fdopen(fd, "w+b") : std::tmpfile();
  if (!f) {
    if (fd >= 0) ::close(fd);
    throw DataError(fmt::format("{}: cannot create a temporary file: {}", dir, strerror(errno)));
  }
  return f;
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

FILE* open_temporary_beside(const std::string& path, std::string& tmp) {
  tmp = path + ".XXXXXX.tmp";
  const int fd = ::mkstemps(tmp.data(), 4);
  if (fd < 0) throw DataError(fmt::format("{}: cannot write: {}", tmp, strerror(errno)));
  ::fchmod(fd, 0644);
  FILE* f = ::fdopen(fd, "w+b");
  if (!f) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw DataError(fmt::format("{}: cannot write: {}", tmp, strerror(errno)));
  }
  return f;
}

void write_file_atomic(const std::string& path, const std::string& text) {
  // A fresh temporary, created exclusively (mkstemp: O_CREAT | O_EXCL): nothing planted beside
  // `path` (a symlink named like the temporary) is written through. The rename then replaces
  // `path` itself, a symlink included, never what it points to.
  std::string tmp;
  FILE* f = open_temporary_beside(path, tmp);
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
