#pragma once
// zstd-compressed token shards (`prepare --compress`: `train.bin.zst`, ...), for moving data
// sets to a cluster at a third of their size. The file is a standard zstd file (`zstd -d`
// gives back the shard): a skippable frame {"TRSHARD1", u64 XXH3-64 of the shard, u64 its size}
// and then the shard as one zstd frame.
//
// A run decompresses each compressed shard once, before training, then maps it as any shard:
// into data.cache_dir when one is set, as `<name>-<hash>.bin` (content-addressed: ranks sharing
// a node share it, and it stays for the next run), checked against the recorded hash every time
// it is used and decompressed again when it does not match (a damaged or truncated cache file);
// without a cache directory (or for a .zst without our frame) into a temporary file that is
// gone once mapped. In a run, one rank per node decompresses and the others map its file.
#include <cstdint>
#include <string>
#include <utility>

namespace trainer {

// Whether `path` starts like a zstd file (a zstd frame or a skippable one).
bool is_zstd_file(const std::string& path);

// Compresses the shard at `src` into `dst` (atomically: `dst` is the whole file or absent).
// level: zstd's (3 is its default; 19 packs tighter, far slower). Throws DataError.
void compress_shard(const std::string& src, const std::string& dst, int level = 3);

// Where a compressed shard's tokens are, ready to map.
struct DecompressedShard {
  std::string path;
  bool temporary = false;  // remove once mapped
  // What happened: "decompressed", "from the cache", "decompressed again (the cached copy was
  // damaged)", "decompressed (no hash recorded: not cached)".
  std::string how;
};
// Throws DataError naming the file for a damaged compressed shard, or a decompressed shard whose
// hash is not the one recorded. Temporaries that a killed process left in the cache beside the
// shard's name (not written for ten minutes) are removed.
DecompressedShard decompress_shard(const std::string& zst, const std::string& cache_dir);

// How a data set turns its compressed shards into files to map. This one decompresses in the
// calling process; a run shares one decompression among the ranks of a node
// (trainer/node_shards.h).
class ShardDecompressor {
 public:
  explicit ShardDecompressor(std::string cache_dir = "") : cache_dir_(std::move(cache_dir)) {}
  virtual ~ShardDecompressor() = default;
  virtual DecompressedShard open(const std::string& zst) {
    return decompress_shard(zst, cache_dir_);
  }
  // This process has mapped `d` (or failed to): a temporary is removed (the mapping stays).
  virtual void mapped(const DecompressedShard& d);

 protected:
  const std::string cache_dir_;
};

}  // namespace trainer
