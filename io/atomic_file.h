#pragma once
#include <cstdint>
#include <cstdio>
#include <string>

namespace trainer {

// A fresh temporary file beside `path`, named <path>.XXXXXX.tmp (the X's filled in, returned in
// `tmp`), created exclusively (O_CREAT | O_EXCL), so nothing planted beside `path` is written
// through; mode 0644, open for reading and writing. Throws DataError.
FILE* open_temporary_beside(const std::string& path, std::string& tmp);

// Writes `text` to `path` through a fresh temporary file (created exclusively beside it, named
// <path>.XXXXXX.tmp) that is flushed, fsynced and renamed, so that `path` is either the old file
// or the complete new one, and nothing planted there is written through. Throws DataError.
void write_file_atomic(const std::string& path, const std::string& text);

// Checks that `bytes` can be written at `path` (a file created, allocated and removed again):
// a full disk or a file-size limit is then a clear error before a long write starts, not a
// failure half-way through it. File systems that cannot preallocate are not checked. Throws
// DataError naming the path, the size and the reason.
void check_space(const std::string& path, int64_t bytes);

// A temporary file with no name in `dir` (O_TMPFILE; where the file system cannot, one from
// tmpfile()), gone when closed or when the process ends, however it ends. For data too large to
// hold in memory: beside the output, where there is room for it. Throws DataError.
FILE* open_anonymous_file(const std::string& dir);

// fsync of a file or directory (after a rename, the directory holding it).
void fsync_path(const std::string& path);

}  // namespace trainer
