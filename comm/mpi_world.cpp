// The MPI implementation of World and Communicator (Open MPI on the CPU backend).
#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string_view>
#include <type_traits>

#include "comm/communicator.h"
#include "comm/mpi_comm.h"

namespace trainer {
namespace {

void check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw std::runtime_error(fmt::format("{} failed: {}", call, std::string(msg, len)));
}
#define MPI_CHECK(call) check((call), #call)

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f64:
      return MPI_DOUBLE;
    case DType::f32:
      return MPI_FLOAT;
    case DType::bf16:
    case DType::f16:
      return MPI_UINT16_T;
    case DType::u8:
      return MPI_BYTE;
  }
  return MPI_DATATYPE_NULL;
}

// MPI has no 16-bit float types: sums and maxima of bf16/fp16 buffers are user-defined
// operations that compute in fp32 and round each result (as a GPU's collective would).
template <class H, bool kMax>
void reduce_half(void* in, void* inout, int* len, MPI_Datatype*) {
  const H* a = static_cast<const H*>(in);
  H* b = static_cast<H*>(inout);
  if constexpr (std::is_same_v<H, bf16>) {
    for (int i = 0; i < *len; i++) {
      const float x = to_float(a[i]), y = to_float(b[i]);
      b[i] = to_bf16(kMax ? std::max(x, y) : x + y);
    }
  } else {  // _Float16: the same rounding as kernels/half.h (tested), in F16C instructions
    const _Float16* x = reinterpret_cast<const _Float16*>(in);
    _Float16* y = reinterpret_cast<_Float16*>(inout);
    for (int i = 0; i < *len; i++) {
      const float u = float(x[i]), v = float(y[i]);
      y[i] = _Float16(kMax ? std::max(u, v) : u + v);
    }
  }
}

// The MPI operations for each (dtype, ReduceOp), created once per process.
struct MpiOps {
  MPI_Op bf16_sum, bf16_max, f16_sum, f16_max;
  MpiOps() {
    MPI_Op_create(&reduce_half<bf16, false>, 1, &bf16_sum);
    MPI_Op_create(&reduce_half<bf16, true>, 1, &bf16_max);
    MPI_Op_create(&reduce_half<f16, false>, 1, &f16_sum);
    MPI_Op_create(&reduce_half<f16, true>, 1, &f16_max);
  }
  ~MpiOps() {
    for (MPI_Op* op : {&bf16_sum, &bf16_max, &f16_sum, &f16_max}) MPI_Op_free(op);
  }
  MPI_Op get(ReduceOp op, DType t) const {
    const bool max = op == ReduceOp::max;
    if (t == DType::bf16) return max ? bf16_max : bf16_sum;
    if (t == DType::f16) return max ? f16_max : f16_sum;
    return max ? MPI_MAX : MPI_SUM;
  }
};

int count_of(int64_t n) {
  if (n > INT32_MAX) throw std::length_error("message larger than 2^31 elements");
  return int(n);
}

// The job's collective timeout and the training step it is at, read by every wait (the
// checkpoint writer's thread too, hence atomics).
struct CollectiveWatch {
  std::atomic<double> timeout_s{0};
  std::atomic<int64_t> step{-1};

  // A dead or stopped peer never completes the operation: say which one, where, and end the job
  // (a wait may run in a destructor, so this cannot be an exception).
  [[noreturn]] void expire(const char* op, int group_size) const {
    std::fprintf(stderr,
                 "trainer: %s on a group of %d ranks did not finish within %g s at step %lld "
                 "(collective_timeout_s): a peer is dead or hung; ending the job\n",
                 op, group_size, timeout_s.load(), static_cast<long long>(step.load()));
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    std::_Exit(1);
  }
};

class MpiRequest final : public Request::Impl {
 public:
  MpiRequest(double* wait_s, const char* op, int group_size, const CollectiveWatch& watch)
      : wait_s_(wait_s), op_(op), group_size_(group_size), watch_(watch) {}
  MPI_Request req = MPI_REQUEST_NULL;
  ~MpiRequest() override {  // must not throw: complete it, ignoring errors
    if (req != MPI_REQUEST_NULL) MPI_Wait(&req, MPI_STATUS_IGNORE);
  }
  void wait() override {
    if (req == MPI_REQUEST_NULL) return;
    const double t0 = MPI_Wtime();
    const double timeout = watch_.timeout_s.load();
    if (timeout <= 0) {
      MPI_CHECK(MPI_Wait(&req, MPI_STATUS_IGNORE));
    } else {  // MPI_Wait polls too; this loop also looks at the clock
      for (int done = 0; !done;) {
        MPI_CHECK(MPI_Test(&req, &done, MPI_STATUS_IGNORE));
        if (!done && MPI_Wtime() - t0 > timeout) watch_.expire(op_, group_size_);
      }
    }
    *wait_s_ += MPI_Wtime() - t0;
  }
  bool test() override {
    int done = 1;
    if (req != MPI_REQUEST_NULL) MPI_CHECK(MPI_Test(&req, &done, MPI_STATUS_IGNORE));
    return done != 0;
  }

 private:
  double* wait_s_;
  const char* op_;
  int group_size_;
  const CollectiveWatch& watch_;
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, bool owned, const MpiOps& ops, const CollectiveWatch& watch)
      : comm_(comm), owned_(owned), ops_(ops), watch_(watch) {
    MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    MPI_CHECK(MPI_Comm_size(comm_, &size_));
  }
  ~MpiCommunicator() override {
    if (owned_) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Request iall_reduce(DPtr buf, int64_t n, ReduceOp op) override {
    if (size_ == 1) return {};
    auto r = request("all-reduce");
    sent(2 * n * (size_ - 1) / size_, buf.dtype);
    MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf.p, count_of(n), mpi_type(buf.dtype),
                             ops_.get(op, buf.dtype), comm_, &r->req));
    return Request(std::move(r));
  }
  Request ireduce_scatter(DPtr send, DPtr recv, int64_t count) override {
    if (size_ == 1) return local_copy(recv, send, count);
    auto r = request("reduce-scatter");
    sent(count * (size_ - 1), send.dtype);
    MPI_CHECK(MPI_Ireduce_scatter_block(send.p, recv.p, count_of(count), mpi_type(send.dtype),
                                        ops_.get(ReduceOp::sum, send.dtype), comm_, &r->req));
    return Request(std::move(r));
  }
  Request iall_gather(DPtr send, DPtr recv, int64_t count) override {
    if (size_ == 1) return local_copy(recv, send, count);
    auto r = request("all-gather");
    sent(count * (size_ - 1), send.dtype);
    const bool in_place = send.p == (recv + int64_t(rank_) * count).p;
    MPI_CHECK(MPI_Iallgather(in_place ? MPI_IN_PLACE : send.p, count_of(count),
                             mpi_type(send.dtype), recv.p, count_of(count), mpi_type(recv.dtype),
                             comm_, &r->req));
    return Request(std::move(r));
  }
  Request ibroadcast(DPtr buf, int64_t n, int root) override {
    if (size_ == 1) return {};
    auto r = request("broadcast");
    if (rank_ == root) sent(n, buf.dtype);
    MPI_CHECK(MPI_Ibcast(buf.p, count_of(n), mpi_type(buf.dtype), root, comm_, &r->req));
    return Request(std::move(r));
  }
  Request isend(DPtr buf, int64_t n, int peer, int tag) override {
    auto r = request("send");
    sent(n, buf.dtype);
    MPI_CHECK(MPI_Isend(buf.p, count_of(n), mpi_type(buf.dtype), peer, tag, comm_, &r->req));
    return Request(std::move(r));
  }
  Request irecv(DPtr buf, int64_t n, int peer, int tag) override {
    auto r = request("receive");
    MPI_CHECK(MPI_Irecv(buf.p, count_of(n), mpi_type(buf.dtype), peer, tag, comm_, &r->req));
    return Request(std::move(r));
  }
  void barrier() override {
    if (size_ == 1) return;
    auto r = request("barrier");
    MPI_CHECK(MPI_Ibarrier(comm_, &r->req));
    Request(std::move(r)).wait();
  }
  Traffic traffic() const override { return traffic_; }
  std::unique_ptr<Communicator> dup() override {
    MPI_Comm copy;
    MPI_CHECK(MPI_Comm_dup(comm_, &copy));
    return std::make_unique<MpiCommunicator>(copy, true, ops_, watch_);
  }
  MPI_Comm handle() const { return comm_; }

 private:
  std::unique_ptr<MpiRequest> request(const char* op) {
    return std::make_unique<MpiRequest>(&traffic_.wait_s, op, size_, watch_);
  }
  void sent(int64_t elems, DType t) { traffic_.bytes_sent += elems * dtype_size(t); }
  static Request local_copy(DPtr dst, DPtr src, int64_t n) {
    if (dst.p != src.p) std::memmove(dst.p, src.p, n * dtype_size(src.dtype));
    return {};
  }

  MPI_Comm comm_;
  bool owned_;
  const MpiOps& ops_;
  const CollectiveWatch& watch_;
  int rank_ = 0, size_ = 1;
  Traffic traffic_;
};

class MpiWorld final : public World {
 public:
  MpiWorld(int* argc, char*** argv) {
    int initialized = 0;
    MPI_CHECK(MPI_Initialized(&initialized));
    if (!initialized) {
      int provided = 0;
      // The training thread and the checkpoint writer's thread (parallel HDF5 on its own
      // communicator) call MPI at the same time. TRAINER_MPI_THREAD_LEVEL=funneled asks for
      // less, for MPI libraries that are slower with threads (checkpoints are then written
      // in the step).
      const char* level = std::getenv("TRAINER_MPI_THREAD_LEVEL");
      const int wanted = level && std::string_view(level) == "funneled" ? MPI_THREAD_FUNNELED
                                                                        : MPI_THREAD_MULTIPLE;
      // A plain process (no launcher) is a world of one: Open MPI's singleton need not start a
      // daemon for spawning, which we never do (0.73 -> 0.41 s for MPI_Init alone here). Under
      // mpirun or srun the setting does not apply; a user's own setting is kept.
      setenv("OMPI_MCA_ess_singleton_isolated", "1", 0);
      MPI_CHECK(MPI_Init_thread(argc, argv, wanted, &provided));
      thread_multiple_ = provided >= MPI_THREAD_MULTIPLE;
      owns_mpi_ = true;
    } else {
      int provided = 0;
      MPI_CHECK(MPI_Query_thread(&provided));
      thread_multiple_ = provided >= MPI_THREAD_MULTIPLE;
    }
    ops_ = std::make_unique<MpiOps>();
    world_ = std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, false, *ops_, watch_);
    MPI_Comm node;
    MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_->rank(),
                                  MPI_INFO_NULL, &node));
    MPI_CHECK(MPI_Comm_rank(node, &local_rank_));
    MPI_CHECK(MPI_Comm_size(node, &local_size_));
    // Every rank learns every rank's node: the world rank of the node's first process, then
    // numbered densely in order of appearance.
    int leader = world_->rank();
    MPI_CHECK(MPI_Bcast(&leader, 1, MPI_INT, 0, node));
    MPI_Comm_free(&node);
    std::vector<int> leaders(world_->size());
    MPI_CHECK(MPI_Allgather(&leader, 1, MPI_INT, leaders.data(), 1, MPI_INT, MPI_COMM_WORLD));
    std::vector<int> seen;
    for (int l : leaders) {
      auto it = std::find(seen.begin(), seen.end(), l);
      nodes_.push_back(int(it - seen.begin()));
      if (it == seen.end()) seen.push_back(l);
    }
    char name[MPI_MAX_PROCESSOR_NAME] = {};
    int len = 0;
    MPI_CHECK(MPI_Get_processor_name(name, &len));
    host_.assign(name, len);
    std::vector<char> all(size_t(world_->size()) * MPI_MAX_PROCESSOR_NAME);
    MPI_CHECK(MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all.data(),
                            MPI_MAX_PROCESSOR_NAME, MPI_CHAR, MPI_COMM_WORLD));
    for (int r = 0; r < world_->size(); r++) {
      const char* h = all.data() + size_t(r) * MPI_MAX_PROCESSOR_NAME;
      hosts_.emplace_back(h, strnlen(h, MPI_MAX_PROCESSOR_NAME));
    }
  }
  ~MpiWorld() override {
    world_.reset();
    ops_.reset();
    if (owns_mpi_) MPI_Finalize();
  }
  int rank() const override { return world_->rank(); }
  int size() const override { return world_->size(); }
  const std::string& host() const override { return host_; }
  int local_rank() const override { return local_rank_; }
  int local_size() const override { return local_size_; }
  Communicator& comm() override { return *world_; }
  int node_of(int rank) const override { return nodes_.at(rank); }
  const std::string& host_of(int rank) const override { return hosts_.at(rank); }
  [[noreturn]] void abort(int code) override {
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);
  }

  std::unique_ptr<Communicator> group(const std::vector<int>& members) override {
    int index = -1;
    for (size_t i = 0; i < members.size(); i++)
      if (members[i] == rank()) index = int(i);
    if (index < 0)
      throw std::invalid_argument("group() must be given a group containing this rank");
    MPI_Comm comm;
    // The group's first member names it; the position in `members` orders it.
    MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, members.front(), index, &comm));
    return std::make_unique<MpiCommunicator>(comm, true, *ops_, watch_);
  }
  void set_collective_timeout(double seconds) override { watch_.timeout_s = seconds; }
  void set_step(int64_t step) override { watch_.step = step; }
  double collective_timeout() const override { return watch_.timeout_s; }
  int64_t step() const override { return watch_.step; }
  bool thread_multiple() const override { return thread_multiple_; }

 private:
  CollectiveWatch watch_;
  std::unique_ptr<MpiOps> ops_;  // before the communicators that use it
  std::unique_ptr<MpiCommunicator> world_;
  bool owns_mpi_ = false, thread_multiple_ = false;
  std::string host_;
  int local_rank_ = 0, local_size_ = 1;
  std::vector<int> nodes_;
  std::vector<std::string> hosts_;
};

}  // namespace

MPI_Comm mpi_comm_of(Communicator& comm) {
  auto* mpi = dynamic_cast<MpiCommunicator*>(&comm.host_comm());
  if (!mpi) throw std::logic_error("mpi_comm_of: not an MPI communicator");
  return mpi->handle();
}

std::unique_ptr<World> make_mpi_world(int* argc, char*** argv) {
  return std::make_unique<MpiWorld>(argc, argv);
}

}  // namespace trainer
