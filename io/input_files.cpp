#include "io/input_files.h"

#include <fmt/format.h>
#include <glob.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>

#include "io/errors.h"
#include "io/token_shard.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;

// `path` itself, or the regular files below it when it is a directory.
void add_path(const std::string& path, std::vector<InputFile>& out) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw DataError(fmt::format("{}: cannot open input text file", path));
  if (S_ISREG(st.st_mode)) {
    out.push_back({path, int64_t(st.st_size)});
    return;
  }
  if (!S_ISDIR(st.st_mode))
    throw DataError(fmt::format("{}: not a regular file ({}): an input text file must be one", path,
                                file_kind(st.st_mode)));
  std::vector<InputFile> found;
  std::error_code ec;
  for (fs::recursive_directory_iterator
           it(path, fs::directory_options::follow_directory_symlink, ec),
       end;
       !ec && it != end; it.increment(ec)) {
    // Special files below a directory are skipped, not read: only the named ones are refused.
    if (it->is_regular_file(ec)) found.push_back({it->path().string(), int64_t(it->file_size())});
  }
  if (ec) throw DataError(fmt::format("{}: cannot list the directory: {}", path, ec.message()));
  if (found.empty()) throw DataError(fmt::format("{}: the directory holds no input files", path));
  std::sort(found.begin(), found.end(),
            [](const InputFile& a, const InputFile& b) { return a.path < b.path; });
  out.insert(out.end(), found.begin(), found.end());
}

}  // namespace

std::vector<std::string> glob_sorted(const std::string& pattern, const std::string& what) {
  glob_t g{};
  const int rc = glob(pattern.c_str(), GLOB_ERR, nullptr, &g);
  std::vector<std::string> matched(g.gl_pathv, g.gl_pathv + g.gl_pathc);  // sorted by glob
  globfree(&g);
  if (rc != 0 || matched.empty())
    throw DataError(fmt::format("{}: no {} matches this pattern", pattern, what));
  return matched;
}

std::vector<InputFile> expand_input_files(const std::vector<std::string>& args) {
  std::vector<InputFile> out;
  for (const std::string& a : args) {
    if (a.find_first_of("*?[") == std::string::npos) {
      add_path(a, out);
      continue;
    }
    for (const auto& m : glob_sorted(a, "input file")) add_path(m, out);
  }
  if (out.empty()) throw DataError("no input files given");
  return out;
}

}  // namespace trainer
