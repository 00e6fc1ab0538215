#pragma once
// Collective and point-to-point communication on one group of ranks, behind an interface that
// carries no MPI (or NCCL) types, so that model and trainer code stay backend-neutral. Buffers
// are dtype-carrying pointers; counts are in elements. Every call has a non-blocking form that
// returns a Request to wait on. A group of size one costs nothing: collectives become local
// copies or no-ops.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/dtype.h"

namespace trainer {

enum class ReduceOp { sum, max };

// A pending non-blocking operation. wait() completes it; a Request that is destroyed without
// wait() is waited for then, so buffers are never left in flight.
class Request {
 public:
  struct Impl {
    virtual ~Impl() = default;
    virtual void wait() = 0;
    virtual bool test() = 0;  // true once complete; drives progress
  };
  Request() = default;
  explicit Request(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
  Request(Request&&) = default;
  Request& operator=(Request&& o) {
    wait();
    impl_ = std::move(o.impl_);
    return *this;
  }
  ~Request() { wait(); }

  void wait() {
    if (impl_) impl_->wait();
    impl_.reset();
  }
  bool test() {
    if (impl_ && impl_->test()) impl_.reset();
    return !impl_;
  }

 private:
  std::unique_ptr<Impl> impl_;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;  // in this group
  virtual int size() const = 0;

  // In place: buf(n) = op over ranks of buf(n).
  virtual Request iall_reduce(DPtr buf, int64_t n, ReduceOp op) = 0;
  // send(size * count) summed over ranks; this rank keeps block rank(): recv(count).
  virtual Request ireduce_scatter(DPtr send, DPtr recv, int64_t count) = 0;
  // recv(size * count) = the send(count) blocks of all ranks, in rank order. send may be this
  // rank's block of recv (in place).
  virtual Request iall_gather(DPtr send, DPtr recv, int64_t count) = 0;
  virtual Request ibroadcast(DPtr buf, int64_t n, int root) = 0;
  virtual Request isend(DPtr buf, int64_t n, int peer, int tag) = 0;
  virtual Request irecv(DPtr buf, int64_t n, int peer, int tag) = 0;
  virtual void barrier() = 0;
  // A new communicator over the same ranks (collective): collectives issued on it are ordered
  // independently of this one's.
  virtual std::unique_ptr<Communicator> dup() = 0;

  // What this rank sent (bytes a ring or tree algorithm moves out of it) and how long it was
  // blocked in wait(), since the communicator was made: the communication cost that compute
  // did not hide.
  struct Traffic {
    int64_t bytes_sent = 0;
    double wait_s = 0;
  };
  virtual Traffic traffic() const = 0;
  // The communicator this one uses for host buffers (itself, unless it wraps one: NCCL and
  // staged communicators wrap MPI).
  virtual Communicator& host_comm() { return *this; }

  void all_reduce(DPtr buf, int64_t n, ReduceOp op) { iall_reduce(buf, n, op).wait(); }
  void reduce_scatter(DPtr send, DPtr recv, int64_t count) {
    ireduce_scatter(send, recv, count).wait();
  }
  void all_gather(DPtr send, DPtr recv, int64_t count) { iall_gather(send, recv, count).wait(); }
  void broadcast(DPtr buf, int64_t n, int root) { ibroadcast(buf, n, root).wait(); }
  void send(DPtr buf, int64_t n, int peer, int tag) { isend(buf, n, peer, tag).wait(); }
  void recv(DPtr buf, int64_t n, int peer, int tag) { irecv(buf, n, peer, tag).wait(); }
};

// The lowest rank of `comm` on which `failed` is true, or -1 when it is false everywhere
// (collective).
inline int first_failing_rank(Communicator& comm, bool failed) {
  double first = failed ? comm.size() - comm.rank() : 0;  // max = the lowest failing rank
  comm.all_reduce(host_ptr(&first), 1, ReduceOp::max);
  return first == 0 ? -1 : comm.size() - int(first);
}

// Root's text on every rank of `comm` (collective).
inline void broadcast_string(Communicator& comm, std::string& text, int root) {
  double length = double(text.size());
  comm.broadcast(host_ptr(&length), 1, root);
  text.resize(size_t(length));
  comm.broadcast(host_ptr(reinterpret_cast<std::byte*>(text.data())), int64_t(length), root);
}

// The processes of a job: the world communicator, node detection and group creation.
class World {
 public:
  virtual ~World() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const std::string& host() const = 0;
  virtual int local_rank() const = 0;  // rank among the processes on this node
  virtual int local_size() const = 0;
  // The node (shared-memory domain) of each world rank, numbered from 0 in rank order.
  virtual int node_of(int rank) const = 0;
  virtual const std::string& host_of(int rank) const = 0;
  virtual Communicator& comm() = 0;  // all ranks
  // Ends every process of the job with `code` (after an error on one rank, so none hangs).
  [[noreturn]] virtual void abort(int code) = 0;
  // Collective over all ranks: each rank passes the members of its own group (world ranks,
  // in group-rank order); returns this rank's communicator for it.
  virtual std::unique_ptr<Communicator> group(const std::vector<int>& members) = 0;
  // A wait on any communicator of the job that blocks longer than `seconds` (0 = never) ends
  // the job with one line naming the operation and the training step last set, rather than
  // hanging on a dead or stopped peer.
  virtual void set_collective_timeout(double seconds) = 0;
  virtual void set_step(int64_t step) = 0;
  virtual double collective_timeout() const = 0;
  virtual int64_t step() const = 0;
  // Whether two threads may communicate at once (on different communicators).
  virtual bool thread_multiple() const = 0;
};

// Starts MPI (a plain process without mpirun is a world of one) and finalises it on
// destruction. One per process.
std::unique_ptr<World> make_mpi_world(int* argc, char*** argv);

}  // namespace trainer
