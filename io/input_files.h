#pragma once
// The input files of `trainer prepare`: files, directories (every regular file below them) and
// glob patterns, each expanded in sorted order, so that the same arguments always give the same
// files in the same order (and so the same tokens).
#include <cstdint>
#include <string>
#include <vector>

namespace trainer {

struct InputFile {
  std::string path;
  int64_t bytes = 0;  // its size on disk (compressed, for a compressed file)
};

// The paths a glob pattern matches, sorted; none is a DataError ("PATTERN: no WHAT matches this
// pattern").
std::vector<std::string> glob_sorted(const std::string& pattern, const std::string& what);

// Throws DataError for a missing file, a pattern that matches nothing, a directory that holds no
// files and a special file (a FIFO, a device), naming it; no input at all is an error too.
std::vector<InputFile> expand_input_files(const std::vector<std::string>& args);

}  // namespace trainer
