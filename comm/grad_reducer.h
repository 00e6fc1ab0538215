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
//
// ZeRO-2 (units given) keeps ZeRO-1's shards but not the flat gradient buffer: the buckets are
// the executor's gradient units (model/grad_units.h), whose gradients arrive in windows this
// reducer lends for one backward of one unit. Each window is reduce-scattered as soon as its
// unit's backward ends, in every backward (every micro-batch), and this rank's piece is added
// into its shard; the window is lent again once its reduction is done. A unit held for the
// whole step (a tied embedding's) is reduced from the flat buffer at finish(), as ZeRO-1.
//
// 1-bit Adam (ReducerOptions::momentum; Tang et al. 2021, "1-bit Adam: Communication Efficient
// Large-Scale Training with Adam's Convergence Speed") exchanges momentum instead of gradients
// from a given step on, with Adam's variance frozen. Each rank keeps the momentum m of its part
// of every bucket (all of it, or hierarchically its 1/L), the same on the ranks it is exchanged
// with. Its compressor gets u = beta1 m / R + (1 - beta1) s g over the R ranks it is exchanged
// with (g: the gradients summed so far, s: set_gradient_scale()), so that the sum of the u is
// the momentum AdamW would have; their compressed sum is the new m, and what the reducer leaves
// in the gradients' place for the optimizer. The signs of a momentum change far less from step
// to step than a gradient's, which is what lets 1 bit with error feedback keep Adam's
// convergence. (Exchanging m / (sqrt(v) + eps) instead, the update's direction, bounds each
// element's error by its chunk's mean update; measured on tiny.toml it did worse: +2.2% against
// +0.4% validation loss with v frozen at step 50 of 1000, bench/compression_quality.sh.)
//
// Deep Gradient Compression (Lin et al. 2018) for Adam (momentum.local) takes the same frozen
// variance: with v fixed, AdamW is momentum SGD whose steps are scaled per element by
// 1 / (sqrt(v) + eps), and DGC is a method for momentum SGD. (Adam's v, a function of each
// step's whole gradient, cannot be formed from sparse sums; and sparse gradients fed to a live
// Adam would move each element only when it is sent, by about lr whatever it accumulated.)
// Each rank keeps its own velocity u = beta1 u + (1 - beta1) s g of its part, u = m / R at the
// start, so that the sum over ranks of the u is AdamW's m (momentum correction); the top-k
// compressor's error feedback accumulates u (the velocity, not the gradient) and sends its
// largest values; where they were sent u is zeroed (momentum factor masking: the momentum of a
// value just applied would push it again, stale); the gradients were clipped as they joined u
// (train_step: by the replicas' root mean square norm, the same factor on every rank); and the
// fraction kept falls exponentially from 25% to topk_ratio over sparsity_warmup_steps. The sum
// received is the step's m, and what the reducer leaves in the gradients' place.
//
// Every reduction in flight, of any bucket and backward, is one entry of a queue in the order
// they were started: each kind of chain step is issued in that order on its communicator (the
// same on every rank), and finished reductions are retired from its front, so that the sums
// into a shard are added in one order on every run.
#include <cstdint>
#include <deque>
#include <functional>
#include <vector>

#include "comm/communicator.h"
#include "comm/compression.h"
#include "kernels/kernels.h"
#include "model/grad_units.h"

namespace trainer {

struct ReducerOptions {
  int64_t bucket_elems = 1 << 20;
  bool overlap = true;  // start buckets during backward; else all at finish()
  bool shard = false;   // ZeRO-1 (and ZeRO-2)
  CompressionOptions compression;
  std::vector<MatrixView> matrices;  // weight matrices in the flat buffer, for PowerSGD
  std::vector<ExactRange> exact;     // elements compression leaves exact (compression.h)
  // 1-bit Adam: from step from_step on, every bucket exchanges momentum (see above), compressed
  // with `compression` (1 bit); before it the gradients, with ReducerOptions::compression.
  // DGC (local): each rank's own velocity instead, its accumulation sent as top-k (see above).
  struct MomentumExchange {
    bool on = false;
    float beta1 = 0.9f;
    int64_t from_step = 0;
    CompressionOptions compression;
    bool local = false;                 // DGC
    bool masking = true;                // DGC: the velocity zeroed where its values were sent
    int64_t sparsity_warmup_steps = 0;  // DGC: 25% kept at from_step, down to topk_ratio
  } momentum;
  // ZeRO-2 (with shard): the gradient units, each a bucket, their boundaries multiples of
  // 16 x dp.size(); `windows` of the largest non-held unit's size are lent in turn.
  std::vector<GradUnit> units;
  int windows = 2;
};

class GradReducer : public GradientWindows {
 public:
  // grads and params: the flat buffers, `total` elements, a multiple of 16 x dp.size() (with
  // units, grads holds only the held units' gradients, from offset 0; null when none is held;
  // params null under ZeRO-3, whose parameters the ParamGatherer gathers).
  // intra and inter: the data-parallel group split by node (both or neither).
  GradReducer(Kernels& k, DPtr grads, DPtr params, int64_t total, Communicator& dp,
              Communicator* intra, Communicator* inter, const ReducerOptions& options);
  ~GradReducer();
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  // Before each step's backward: compression is used from step warmup_steps on, and ZeRO-2's
  // shard starts from zero (it accumulates every backward's pieces).
  void start_step(int64_t step);
  // The next backward produces the gradients to reduce (the last micro-batch of a step; ZeRO-2
  // reduces every backward's and needs no arming).
  void arm() { armed_ = true; }
  // Every gradient at or above `frontier` is final: start the buckets that completes (with
  // overlap on, once armed). layers_left: how many layers' backward had not started then.
  // Also drives the reductions in flight (ZeRO-2: only that; its units start at close()).
  void ready(int64_t frontier, int layers_left = 0);
  // Starts what is left and waits for all of it. Afterwards the gradients are summed over the
  // data-parallel group: in place, or (shard) in shard_grads().
  void finish();

  // ZeRO-2: the windows (GradientWindows). open() waits for the oldest reductions in flight
  // while no window is free.
  DPtr open(int unit) override;
  void close(int unit, int layers_left) override;
  int64_t window_elems() const { return window_elems_; }  // 0 without ZeRO-2
  int windows() const { return int(windows_.size()); }
  // What ZeRO-2's windows and their reduction buffers hold, in gradient elements: `windows`
  // windows of the largest unit not held, each with its piece (1/dp) and, hierarchically
  // (node_ranks > 0), its part summed inside the node (1/node_ranks), with the held units'
  // parts summed inside the node. The gradient memory of a ZeRO-2 rank is this, its shard and
  // the held units.
  static int64_t window_buffer_elems(const std::vector<GradUnit>& units, int dp, int node_ranks,
                                     int windows);

  // ZeRO-1 and -2: this rank's part of each bucket, where it lives in the flat buffers and in
  // the shard buffers (shard_grads(), and the optimizer's state).
  struct Piece {
    int64_t offset, count, shard_offset;
  };
  const std::vector<Piece>& pieces() const { return pieces_; }
  int64_t shard_elems() const { return shard_elems_; }  // 0 without ZeRO
  DPtr shard_grads() const { return shard_; }           // null without ZeRO
  // All-gathers each bucket's pieces of the parameters (after the update of this rank's).
  void gather_params();

  int buckets() const { return int(buckets_.size()); }
  // The size buckets are cut to (ZeRO-2: a window's, the largest unit's).
  int64_t bucket_bytes() const { return bucket_bytes_; }
  // The communicator of the hierarchical all-reduce's gather inside the node (a duplicate of
  // `intra`), null otherwise: its traffic is the node's too.
  Communicator* intra_gather() const { return intra_gather_.get(); }
  // How early each bucket of the last finish() was started, in bucket order (the end of the
  // buffer first): the layers_left that ready() reported (ZeRO-2: close(), in the step's last
  // backward), or -1 when it started in finish() (ZeRO-2: or backward waited for it).
  const std::vector<int>& started_with_layers_left() const { return started_; }

  bool compressing() const { return compressing_; }
  // DGC: the fraction of each momentum bucket kept at `step` (the sparsity warm-up's).
  double kept_fraction(int64_t step) const;
  // 1-bit Adam, DGC: this step (after start_step) exchanges momentum, not gradients.
  bool exchanges_momentum() const { return exchanging_momentum_; }
  // Whether the momentum is there to continue from (a restored state, or start_momentum()).
  bool momentum_ready() const { return momentum_ready_; }
  // n values of the optimizer's at state offset `at` (its pieces' shard offsets under ZeRO,
  // else the flat buffer's).
  using OptimizerReader = std::function<void(int64_t at, float* dst, int64_t n)>;
  // The momentum from the optimizer's (collective): at the first step that exchanges it, or
  // after a restore without it. Under ZeRO the ranks exchanging a part gather their pieces.
  void start_momentum(const OptimizerReader& momentum);
  // What multiplies the gradients as they join the momentum (clipping, 1 / loss scale).
  void set_gradient_scale(float scale) { gradient_scale_ = scale; }
  // A step whose gradients are not reduced (the step guard skips it, before finish()).
  void skip();
  // Per step: what the compressed buckets would have sent uncompressed, and the seconds spent
  // compressing them (encode, exchange, decode).
  struct CompressionStats {
    int64_t uncompressed_bytes = 0;
    double seconds = 0;
  };
  CompressionStats take_compression_stats();
  // The compressors' state (error-feedback residuals, PowerSGD's Q) of every bucket,
  // concatenated in buffer order (empty without compression), for checkpoints; with 1-bit Adam
  // each bucket's momentum follows its compressor's, and a last value says if it is there.
  // Written into `out` (a checkpoint's copy, its capacity reused from the last one).
  void compression_state(std::vector<float>& out) const;
  std::vector<float> compression_state() const;
  // Restores it; false (and nothing changed) if the length differs (another layout or method).
  bool set_compression_state(const std::vector<float>& all);
  // Back to a fresh run's: residuals zero, PowerSGD's first Q, no momentum.
  void reset_compression_state();

 private:
  int64_t compression_state_size() const;
  // Where one reduction of a bucket reads its gradients, keeps its 1/L part summed inside the
  // node (hierarchical) and leaves this rank's piece (ZeRO).
  struct Buffers {
    DPtr grads, node, piece;
  };
  using Step = std::function<Request(const Buffers&)>;
  using GatherStep = std::function<Request()>;
  struct Bucket {
    int64_t begin, count;
    std::vector<Step> reduce;
    std::vector<GatherStep> gather;
    size_t gathered = 0;  // gather steps started
    Request gathering;
    bool launched = false;                   // in this step (windowed buckets: in this backward)
    bool held = false;                       // ZeRO-2: reduced from the flat buffer at finish()
    int layers_left = -1;                    // when it was launched: see started_with_layers_left()
    std::unique_ptr<Compressor> compressor;  // null: reduced uncompressed
    std::unique_ptr<Compressor> momentum_compressor;  // 1-bit Adam's
    std::function<std::unique_ptr<Compressor>(const CompressionOptions&)> make_compressor;
    std::vector<float> momentum;  // this rank's part's (DGC: its own velocity)
    int64_t piece_offset = 0;     // this rank's piece (ZeRO), in the buffer
  };
  // One reduction in flight: a bucket's chain on some buffers (a window's, or -1).
  struct Flight {
    Bucket* bucket;
    Buffers at;
    int window = -1;
    size_t next = 0;  // steps of the chain started so far
    Request pending;
  };
  // A window, with the buffers of its reduction.
  struct Window {
    Buffers at;
    bool lent = false;
  };
  void reduce_compressed(Bucket& b);
  // The compressor of this step's exchange of b (null: uncompressed).
  Compressor* active(const Bucket& b) const {
    return exchanging_momentum_ ? b.momentum_compressor.get() : b.compressor.get();
  }
  // This rank's part of b from the optimizer's state, into dst (the part's size).
  void read_part(const Bucket& b, const OptimizerReader& read, float* dst);
  Buffers flat_buffers(const Bucket& b) const;
  void launch(Bucket& b, Buffers at, int window = -1);
  void progress();  // starts each flight's next step, keeping every step kind in flight order
  // Waits for the oldest flight, then retires it: a window's piece is added into the shard and
  // the window freed.
  void retire_front();

  Kernels& k_;
  ReducerOptions opts_;
  // The hierarchical all-reduce's gather inside the node, on its own communicator: collectives
  // on one communicator must be issued in the same order on every rank, and each chain step
  // kind is issued in bucket order on its own communicator.
  std::unique_ptr<Communicator> intra_gather_;
  std::vector<Bucket> buckets_;   // from the end of the buffer to its start
  std::deque<Flight> flights_;    // oldest first
  std::vector<Window> windows_;   // ZeRO-2
  std::vector<int> unit_bucket_;  // ZeRO-2: the bucket of each unit
  std::vector<int> unit_window_;  // ZeRO-2: the window each unit has open, or -1
  int64_t window_elems_ = 0, node_ranks_ = 1;
  std::vector<Piece> pieces_;
  Communicator& dp_;
  Communicator *intra_, *inter_;  // hierarchical: dp split by node (else null)
  bool windowed_ = false;         // ZeRO-2
  bool gathers_params_;           // a parameter buffer was given (not under ZeRO-3)
  DPtr grads_, scratch_, shard_;
  bool compressing_ = false, exchanging_momentum_ = false;
  bool momentum_ready_ = false;
  float gradient_scale_ = 1;
  CompressionStats compression_stats_;
  std::vector<float> host_bucket_;  // a device bucket's copy for the (host) compressors
  int64_t shard_elems_ = 0, bucket_bytes_ = 0;
  bool armed_ = false;
  std::vector<int> started_;
};

}  // namespace trainer
