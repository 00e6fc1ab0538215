#pragma once
// Compressed shards decompressed once per node: local rank 0 decompresses each one (into
// data.cache_dir, or into a temporary file that every rank of the node maps before it is
// removed) and the others wait and map its file. Otherwise a node's ranks would each decompress
// every shard: eight GPUs, eight times the work at start-up, and without a cache eight copies
// in the page cache.
#include <string>

#include "comm/communicator.h"
#include "io/compressed_shard.h"
#include "trainer/node_peers.h"

namespace trainer {

class NodeShardDecompressor : public ShardDecompressor {
 public:
  // node: the ranks of this node (any group whose members share a file system works).
  NodeShardDecompressor(Communicator& node, std::string cache_dir)
      : ShardDecompressor(std::move(cache_dir)), node_(node) {}
  // Collective over the node. An error on local rank 0 is thrown on every rank of the node.
  DecompressedShard open(const std::string& zst) override;
  // Collective over the node: a temporary is removed once every rank has mapped it.
  void mapped(const DecompressedShard& d) override;

 private:
  Communicator& node_;
};

}  // namespace trainer
