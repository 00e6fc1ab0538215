#include "comm/nccl_comm.h"

#include <fmt/format.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "comm/staged_comm.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_kernels.h"

namespace trainer {
namespace {

void check_nccl(ncclResult_t r, const char* call, const char* file, int line) {
  if (r != ncclSuccess) cuda::fail(ncclGetErrorString(r), call, file, line);
}
#define NCCL_CHECK(call) check_nccl((call), #call, __FILE__, __LINE__)

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::bf16:
      return ncclBfloat16;
    case DType::f16:
      return ncclFloat16;
    case DType::u8:
      return ncclUint8;
  }
  return ncclUint8;
}

using Clock = std::chrono::steady_clock;

class NcclCommunicator;

class NcclRequest final : public Request::Impl {
 public:
  NcclRequest(NcclCommunicator& comm, cudaEvent_t done, const char* op)
      : comm_(comm), done_(done), op_(op) {}
  ~NcclRequest() override {
    wait();
    cudaEventDestroy(done_);
  }
  void wait() override;
  bool test() override;

 private:
  NcclCommunicator& comm_;
  cudaEvent_t done_;
  const char* op_;
  bool finished_ = false;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::unique_ptr<Communicator> host, Kernels& k, World& world)
      : staged_(make_staged_communicator(std::move(host), k)),
        k_(k),
        world_(world),
        compute_(cuda::compute_stream(k)),
        rank_(staged_->rank()),
        size_(staged_->size()) {
    CUDA_CHECK(cudaSetDevice(cuda::device_of(k)));
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    if (size_ > 1) {
      ncclUniqueId id{};
      if (rank_ == 0) NCCL_CHECK(ncclGetUniqueId(&id));
      staged_->broadcast(host_ptr(reinterpret_cast<std::byte*>(&id)), sizeof(id), 0);
      NCCL_CHECK(ncclCommInitRank(&comm_, size_, id, rank_));
    }
  }
  ~NcclCommunicator() override {
    cudaStreamSynchronize(stream_);
    if (comm_) ncclCommDestroy(comm_);
    cudaEventDestroy(ready_);
    cudaStreamDestroy(stream_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Request iall_reduce(DPtr buf, int64_t n, ReduceOp op) override {
    if (size_ == 1 || !buf.device) return staged_->iall_reduce(buf, n, op);
    sent(2 * n * (size_ - 1) / size_, buf.dtype);
    return launch("all-reduce", [&] {
      return ncclAllReduce(buf.p, buf.p, size_t(n), nccl_type(buf.dtype),
                           op == ReduceOp::max ? ncclMax : ncclSum, comm_, stream_);
    });
  }
  Request ireduce_scatter(DPtr send, DPtr recv, int64_t count) override {
    if (size_ == 1 || !send.device || !recv.device)
      return staged_->ireduce_scatter(send, recv, count);
    sent(count * (size_ - 1), send.dtype);
    return launch("reduce-scatter", [&] {
      return ncclReduceScatter(send.p, recv.p, size_t(count), nccl_type(send.dtype), ncclSum, comm_,
                               stream_);
    });
  }
  Request iall_gather(DPtr send, DPtr recv, int64_t count) override {
    if (size_ == 1 || !send.device || !recv.device) return staged_->iall_gather(send, recv, count);
    sent(count * (size_ - 1), send.dtype);
    return launch("all-gather", [&] {
      return ncclAllGather(send.p, recv.p, size_t(count), nccl_type(send.dtype), comm_, stream_);
    });
  }
  Request ibroadcast(DPtr buf, int64_t n, int root) override {
    if (size_ == 1 || !buf.device) return staged_->ibroadcast(buf, n, root);
    if (rank_ == root) sent(n, buf.dtype);
    return launch("broadcast", [&] {
      return ncclBroadcast(buf.p, buf.p, size_t(n), nccl_type(buf.dtype), root, comm_, stream_);
    });
  }
  Request isend(DPtr buf, int64_t n, int peer, int tag) override {
    return staged_->isend(buf, n, peer, tag);
  }
  Request irecv(DPtr buf, int64_t n, int peer, int tag) override {
    return staged_->irecv(buf, n, peer, tag);
  }
  void barrier() override { staged_->barrier(); }
  std::unique_ptr<Communicator> dup() override {
    return std::make_unique<NcclCommunicator>(staged_->host_comm().dup(), k_, world_);
  }
  Traffic traffic() const override {
    Traffic t = staged_->traffic();
    t.bytes_sent += traffic_.bytes_sent;
    t.wait_s += traffic_.wait_s;
    return t;
  }
  Communicator& host_comm() override { return staged_->host_comm(); }

  // Polls `done` until the operation has finished; NCCL's asynchronous errors and the job's
  // collective timeout end the job (a peer that died would otherwise hang this rank forever).
  void wait_for(cudaEvent_t done, const char* op) {
    const auto t0 = Clock::now();
    for (;;) {
      const cudaError_t q = cudaEventQuery(done);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) CUDA_CHECK(q);
      ncclResult_t async = ncclSuccess;
      NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
      const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
      const double timeout = world_.collective_timeout();
      if (async != ncclSuccess && async != ncclInProgress)
        end_job(fmt::format("NCCL {} on a group of {} ranks failed at step {}: {}", op, size_,
                            world_.step(), ncclGetErrorString(async)));
      if (timeout > 0 && waited > timeout)
        end_job(
            fmt::format("NCCL {} on a group of {} ranks did not finish within {:g} s at step {} "
                        "(collective_timeout_s): a peer is dead or hung; ending the job",
                        op, size_, timeout, world_.step()));
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    traffic_.wait_s += std::chrono::duration<double>(Clock::now() - t0).count();
    // Kernels enqueued from now on may read or overwrite the buffers.
    CUDA_CHECK(cudaStreamWaitEvent(compute_, done, 0));
  }

 private:
  template <class F>
  Request launch(const char* op, F&& enqueue) {
    CUDA_CHECK(cudaEventRecord(ready_, compute_));  // after the kernels that wrote the buffers
    CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
    NCCL_CHECK(enqueue());
    cudaEvent_t done;
    CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(done, stream_));
    return Request(std::make_unique<NcclRequest>(*this, done, op));
  }
  [[noreturn]] void end_job(const std::string& message) {
    std::fprintf(stderr, "trainer: %s\n", message.c_str());
    std::fflush(stderr);
    ncclCommAbort(comm_);
    comm_ = nullptr;
    world_.abort(1);
    std::_Exit(1);  // not reached
  }
  void sent(int64_t elems, DType t) { traffic_.bytes_sent += elems * int64_t(dtype_size(t)); }

  std::unique_ptr<Communicator> staged_;
  Kernels& k_;
  World& world_;
  cudaStream_t compute_, stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  ncclComm_t comm_ = nullptr;
  int rank_, size_;
  Traffic traffic_;
};

void NcclRequest::wait() {
  if (finished_) return;
  comm_.wait_for(done_, op_);
  finished_ = true;
}

bool NcclRequest::test() {
  if (!finished_ && cudaEventQuery(done_) == cudaSuccess) wait();
  return finished_;
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(std::unique_ptr<Communicator> host,
                                                     Kernels& cuda, World& world) {
  return std::make_unique<NcclCommunicator>(std::move(host), cuda, world);
}

}  // namespace trainer
