#pragma once
// Gradient compression for the data-parallel reduction: each method is a lossy all-reduce (sum
// over the group) of one bucket of fp32 gradients, applied by GradReducer bucket by bucket.
//
//   fp16, bf16  the bucket cast to 16 bits, all-reduced in 16 bits (2x fewer bytes)
//   int8        per-chunk (256) absmax scale + int8 values, summed on arrival: all-gathered in a
//               group of two, beyond it in two phases (a part's messages to the rank that sums
//               it, which encodes the sum again for all: 2 (p - 1) / p messages a rank)
//   onebit      signs (1 bit) + per-chunk mean magnitude, exchanged as int8 (1-bit Adam /
//               signSGD with scale), ~32x fewer bytes
//   topk        the k = topk_ratio x n largest magnitudes as (index, value), all-gathered
//   powersgd    rank-r factors P (m x r) and Q (n x r) of each weight matrix in the bucket,
//               all-reduced in two rounds with a warm-started Q and an orthogonalised P
//               (Vogels et al. 2019); vectors and matrices too small to gain go uncompressed
//
// With error feedback a rank keeps what compression dropped (its residual) and adds it to the
// next step's gradients, so that nothing is lost, only delayed: the sum over steps of what was
// sent plus the residual equals the sum of the true gradients (in two phases, the rank summing a
// part keeps a residual of that sum too). Messages that cannot be summed on the wire cannot be
// reduce-scattered: under ZeRO-1 the bucket is all-reduced compressed and each rank keeps its
// part (the bytes saved by compression are larger than the all-gather's extra).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace trainer {

struct CompressionOptions {
  std::string method = "none";
  double topk_ratio = 0.01;
  int powersgd_rank = 4;
  bool error_feedback = true;
  int warmup_steps = 0;          // uncompressed steps first
  int64_t min_bucket_elems = 0;  // smaller buckets go uncompressed
  uint64_t seed = 0;             // PowerSGD's initial Q (the same on every rank)
  // PowerSGD's rank per matrix: > 0, the fraction of a matrix's values its factors take,
  // rank = budget x rows x cols / (rows + cols) (at least 1), instead of powersgd_rank for all.
  double powersgd_budget = 0;
  // int8, onebit: among more than two ranks in two phases, else all-gathered (see above).
  bool two_phase = true;
};

// A weight matrix inside the flat gradient buffer (for PowerSGD): rows x cols at offset.
struct MatrixView {
  int64_t offset, rows, cols;
};
// Elements summed exactly, never compressed: parameters that the tensor-parallel ranks replicate
// (norms, biases). Their gradients are equal on those ranks, but a compressor decides from a
// whole bucket (a chunk's scale, the top k), whose other elements differ from rank to rank:
// compressed, the copies would drift apart.
struct ExactRange {
  int64_t offset, count;
};

// Where a compressor exchanges: its rank in the group, and the group's size.
struct GroupPlace {
  int rank = 0, size = 1;
};

class Compressor {
 public:
  virtual ~Compressor() = default;
  // g(n): this rank's gradients in; the (approximate) sum over the group's ranks out. In the
  // group the compressor was made for.
  virtual void all_reduce(Communicator& group, float* g, int64_t n) = 0;
  // What error feedback holds for the next exchange (n, zero when there is none): this rank's
  // residual, plus, where it sums a part for the group, that sum's residual. Summed over the
  // group's ranks: everything given and not yet delivered.
  virtual std::vector<float> residual() const = 0;
  // What a resumed run needs to continue exactly: the residual (with error feedback), then the
  // method's own state (PowerSGD's Q; the residual of the part this rank sums): save_state
  // writes state_size() values, set_state takes them back.
  virtual void save_state(float* out) const = 0;
  virtual int64_t state_size() const = 0;
  virtual void set_state(const float* values) = 0;
  // Top-k only (Deep Gradient Compression, comm/grad_reducer.h): the fraction of the values it
  // keeps from now on (the sparsity warm-up), and v(n) zeroed where this rank's last message
  // carried a value (momentum factor masking; the elements summed exactly are left alone).
  virtual void set_ratio(double ratio);
  virtual void mask_sent(float* v) const;
};

// One compressor per bucket: it keeps that bucket's residual (and PowerSGD's Q). `matrices`:
// the weight matrices inside the bucket (or the whole rows of one that the bucket cuts), `exact`
// the elements to sum exactly, offsets relative to its start. (fp16 and bf16 treat equal inputs
// alike whatever their neighbours; PowerSGD sends matrices with exact elements as they are.)
std::unique_ptr<Compressor> make_compressor(const CompressionOptions& options, int64_t n,
                                            const std::vector<MatrixView>& matrices,
                                            const std::vector<ExactRange>& exact, GroupPlace group);

// The bytes one rank sends to all-reduce n fp32 values uncompressed with a ring over p ranks:
// what compression is measured against.
inline int64_t uncompressed_bytes(int64_t n, int p) {
  return p > 1 ? 2 * n * 4 * (p - 1) / p : 0;
}

}  // namespace trainer
