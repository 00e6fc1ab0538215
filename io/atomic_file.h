#pragma once
#include <string>

namespace trainer {

// Writes `text` to `path` through a temporary file that is flushed, fsynced and renamed, so
// that `path` is either the old file or the complete new one. Throws DataError on failure.
void write_file_atomic(const std::string& path, const std::string& text);

// fsync of a file or directory (after a rename, the directory holding it).
void fsync_path(const std::string& path);

}  // namespace trainer
