#pragma once
// Data-parallel gradient reduction in buckets, overlapped with backward.
//
// The flat gradient buffer is cut, from its end, into buckets of about bucket_elems: backward
// produces gradients from the last layer to the first, so the buckets fill in that order. As
// backward reports that every gradient above an offset is final (ready()), each bucket it
// completes is started as a non-blocking collective, and the ones in flight are driven on
// (MPI progresses non-blocking collectives only inside MPI calls). finish() waits for the rest.
//
// Plain data parallelism all-reduces each bucket. ZeRO-1 (shard = true) reduce-scatters it
// instead: every rank keeps one dp-th of each bucket, updates those elements only, and
// gather_params() all-gathers the updated parameters. Hierarchically (intra and inter given),
// a bucket is first reduce-scattered among the ranks of one node, the parts are reduced across
// nodes between the ranks that hold the same part, and gathered back inside the node: the
// traffic between nodes shrinks by the ranks-per-node factor.
#include <cstdint>
#include <functional>
#include <vector>

#include "comm/communicator.h"
#include "comm/compression.h"
#include "kernels/kernels.h"

namespace trainer {

struct ReducerOptions {
  int64_t bucket_elems = 1 << 20;
  bool overlap = true;  // start buckets during backward; else all at finish()
  bool shard = false;   // ZeRO-1
  CompressionOptions compression;
  std::vector<MatrixView> matrices;  // weight matrices in the flat buffer, for PowerSGD
};

class GradReducer {
 public:
  // grads and params: the flat buffers, `total` elements, a multiple of 16 x dp.size().
  // intra and inter: the data-parallel group split by node (both or neither).
  GradReducer(Kernels& k, DPtr grads, DPtr params, int64_t total, Communicator& dp,
              Communicator* intra, Communicator* inter, const ReducerOptions& options);
  ~GradReducer();
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  // The next backward produces the gradients to reduce (the last micro-batch of a step).
  void arm() { armed_ = true; }
  // Every gradient at or above `frontier` is final: start the buckets that completes (with
  // overlap on, once armed). layers_left: how many layers' backward had not started then.
  void ready(int64_t frontier, int layers_left = 0);
  // Starts what is left and waits for all of it. Afterwards the gradients are summed over the
  // data-parallel group: in place, or (shard) in shard_grads().
  void finish();

  // ZeRO-1: this rank's part of each bucket, where it lives in the flat buffers and in the
  // shard buffers (shard_grads(), and the optimizer's state).
  struct Piece {
    int64_t offset, count, shard_offset;
  };
  const std::vector<Piece>& pieces() const { return pieces_; }
  int64_t shard_elems() const { return shard_elems_; }  // 0 without ZeRO-1
  DPtr shard_grads() const { return shard_; }           // null without ZeRO-1
  // All-gathers each bucket's pieces of the parameters (after the update of this rank's).
  void gather_params();

  int buckets() const { return int(buckets_.size()); }
  int64_t bucket_bytes() const { return bucket_bytes_; }  // the size buckets are cut to
  // The communicator of the hierarchical all-reduce's gather inside the node (a duplicate of
  // `intra`), null otherwise: its traffic is the node's too.
  Communicator* intra_gather() const { return intra_gather_.get(); }
  // How early each bucket of the last finish() was started, in bucket order (the end of the
  // buffer first): the layers_left that ready() reported, or -1 when it started in finish().
  const std::vector<int>& started_with_layers_left() const { return started_; }

  // Compression is used from step warmup_steps on (set before each step's backward).
  void set_step(int64_t step);
  bool compressing() const { return compressing_; }
  // Per step: what the compressed buckets would have sent uncompressed, and the seconds spent
  // compressing them (encode, exchange, decode).
  struct CompressionStats {
    int64_t uncompressed_bytes = 0;
    double seconds = 0;
  };
  CompressionStats take_compression_stats();
  // The compressors' state (error-feedback residuals, PowerSGD's Q) of every bucket,
  // concatenated in buffer order (empty without compression), for checkpoints.
  std::vector<float> compression_state() const;
  // Restores it; false (and nothing changed) if the length differs (another layout or method).
  bool set_compression_state(const std::vector<float>& all);

 private:
  using Step = std::function<Request()>;
  struct Bucket {
    int64_t begin, count;
    std::vector<Step> reduce, gather;
    size_t next = 0;  // steps of the running chain started so far
    Request pending;
    bool launched = false;
    int layers_left = -1;                    // when it was launched: see started_with_layers_left()
    std::unique_ptr<Compressor> compressor;  // null: reduced uncompressed
    int64_t piece_offset = 0;                // this rank's piece (ZeRO-1), in the buffer
  };
  void reduce_compressed(Bucket& b);
  void launch(Bucket& b);
  void progress();  // starts each chain's next step, keeping every step kind in bucket order
  static void run_chain(Bucket& b, const std::vector<Step>& chain);

  Kernels& k_;
  ReducerOptions opts_;
  // The hierarchical all-reduce's gather inside the node, on its own communicator: collectives
  // on one communicator must be issued in the same order on every rank, and each chain step
  // kind is issued in bucket order on its own communicator.
  std::unique_ptr<Communicator> intra_gather_;
  std::vector<Bucket> buckets_;  // from the end of the buffer to its start
  std::vector<Piece> pieces_;
  Communicator& dp_;
  DPtr grads_, scratch_, shard_;
  bool compressing_ = false;
  CompressionStats compression_stats_;
  std::vector<float> host_bucket_;  // a device bucket's copy for the (host) compressors
  int64_t shard_elems_ = 0, bucket_bytes_ = 0;
  bool armed_ = false;
  std::vector<int> started_;
};

}  // namespace trainer
