#include "trainer/node_shards.h"

#include <unistd.h>

#include <exception>
#include <vector>

#include "io/errors.h"

namespace trainer {

namespace {
constexpr char kSep = '\0';  // between the fields of the broadcast (no path holds one)
}

DecompressedShard NodeShardDecompressor::open(const std::string& zst) {
  // Local rank 0's result as "ok" or "error", then the fields, NUL-separated.
  std::string message;
  std::exception_ptr error;
  DecompressedShard d;
  if (node_.rank() == 0) {
    try {
      d = ShardDecompressor::open(zst);
      message = std::string("ok") + kSep + (d.temporary ? "1" : "0") + kSep + d.path + kSep + d.how;
    } catch (const std::exception& e) {
      error = std::current_exception();
      message = std::string("error") + kSep + e.what();
    }
  }
  broadcast_string(node_, message, 0);
  if (error) std::rethrow_exception(error);
  std::vector<std::string> fields;
  for (size_t at = 0;;) {
    const size_t end = message.find(kSep, at);
    fields.push_back(message.substr(at, end - at));
    if (end == std::string::npos) break;
    at = end + 1;
  }
  if (fields[0] == "error") throw DataError(fields.at(1));
  if (node_.rank() == 0) return d;
  return {fields.at(2), fields.at(1) == "1", fields.at(3)};
}

void NodeShardDecompressor::mapped(const DecompressedShard& d) {
  node_.barrier();
  if (node_.rank() == 0) ShardDecompressor::mapped(d);
}

}  // namespace trainer
