#include "comm/staged_comm.h"

#include <algorithm>
#include <functional>
#include <utility>
#include <vector>

namespace trainer {
namespace {

// Pinned host buffers, reused: pinning memory is slow, and a step stages the same sizes again.
class PinnedPool {
 public:
  explicit PinnedPool(Kernels& k) : k_(k) {}
  ~PinnedPool() {
    for (Buffer& b : buffers_) k_.free_host(b.p);
  }
  void* take(int64_t bytes) {
    for (Buffer& b : buffers_)
      if (!b.busy && b.bytes >= bytes) {
        b.busy = true;
        return b.p;
      }
    buffers_.push_back({k_.alloc_host(bytes), bytes, true});
    return buffers_.back().p;
  }
  void give_back(void* p) {
    for (Buffer& b : buffers_)
      if (b.p == p) b.busy = false;
  }

 private:
  struct Buffer {
    void* p;
    int64_t bytes;
    bool busy;
  };
  Kernels& k_;
  std::vector<Buffer> buffers_;
};

// The host operation, then the copies back to the device and the staging buffers' return.
class StagedRequest final : public Request::Impl {
 public:
  StagedRequest(Request inner, std::function<void()> finish)
      : inner_(std::move(inner)), finish_(std::move(finish)) {}
  ~StagedRequest() override { wait(); }
  void wait() override {
    inner_.wait();
    complete();
  }
  bool test() override {
    if (!inner_.test()) return false;
    complete();
    return true;
  }

 private:
  void complete() {
    if (finish_) std::exchange(finish_, nullptr)();
  }
  Request inner_;
  std::function<void()> finish_;
};

class StagedCommunicator final : public Communicator {
 public:
  StagedCommunicator(std::unique_ptr<Communicator> host, Kernels& k)
      : host_(std::move(host)), k_(k), pool_(k) {}
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }

  Request iall_reduce(DPtr buf, int64_t n, ReduceOp op) override {
    if (!buf.device || size() == 1) return host_->iall_reduce(buf, n, op);
    DPtr h = stage_out(buf, n);
    return finish(host_->iall_reduce(h, n, op), {{buf, h, n}});
  }
  Request ireduce_scatter(DPtr send, DPtr recv, int64_t count) override {
    if (!send.device && !recv.device) return host_->ireduce_scatter(send, recv, count);
    if (size() == 1 && send.device && recv.device) return local_copy(recv, send, count);
    DPtr hs = stage_out(send, size() * count), hr = stage(recv, count);
    return finish(host_->ireduce_scatter(hs, hr, count), {{recv, hr, count}}, {hs});
  }
  Request iall_gather(DPtr send, DPtr recv, int64_t count) override {
    if (!send.device && !recv.device) return host_->iall_gather(send, recv, count);
    if (size() == 1 && send.device && recv.device) return local_copy(recv, send, count);
    // Gathered in place in the staging buffer: this rank's block first copied into it.
    DPtr hr = stage(recv, size() * count), mine = hr + int64_t(rank()) * count;
    copy_out(mine, send, count);
    return finish(host_->iall_gather(mine, hr, count), {{recv, hr, size() * count}});
  }
  Request ibroadcast(DPtr buf, int64_t n, int root) override {
    if (!buf.device || size() == 1) return host_->ibroadcast(buf, n, root);
    DPtr h = rank() == root ? stage_out(buf, n) : stage(buf, n);
    return finish(host_->ibroadcast(h, n, root), {{buf, h, n}});
  }
  Request isend(DPtr buf, int64_t n, int peer, int tag) override {
    if (!buf.device) return host_->isend(buf, n, peer, tag);
    DPtr h = stage_out(buf, n);
    return finish(host_->isend(h, n, peer, tag), {}, {h});
  }
  Request irecv(DPtr buf, int64_t n, int peer, int tag) override {
    if (!buf.device) return host_->irecv(buf, n, peer, tag);
    DPtr h = stage(buf, n);
    return finish(host_->irecv(h, n, peer, tag), {{buf, h, n}});
  }
  void barrier() override { host_->barrier(); }
  std::unique_ptr<Communicator> dup() override {
    return std::make_unique<StagedCommunicator>(host_->dup(), k_);
  }
  Traffic traffic() const override { return host_->traffic(); }
  Communicator& host_comm() override { return host_->host_comm(); }

 private:
  struct CopyBack {
    DPtr device, host;
    int64_t n;
  };
  Request local_copy(DPtr dst, DPtr src, int64_t n) {
    k_.convert(dst, src, n, 0);  // same dtype: a device-to-device copy
    return {};
  }
  // A pinned buffer shaped like `like`.
  DPtr stage(DPtr like, int64_t n) {
    return {static_cast<std::byte*>(pool_.take(n * int64_t(dtype_size(like.dtype)))), like.dtype,
            false};
  }
  void copy_out(DPtr host, DPtr src, int64_t n) {
    if (src.device)
      k_.copy_to_host(host.p, src, n);
    else if (host.p != src.p)
      std::copy_n(src.p, n * int64_t(dtype_size(src.dtype)), host.p);
  }
  DPtr stage_out(DPtr buf, int64_t n) {
    DPtr h = stage(buf, n);
    copy_out(h, buf, n);
    return h;
  }
  Request finish(Request inner, std::vector<CopyBack> back, std::vector<DPtr> release = {}) {
    for (const CopyBack& c : back) release.push_back(c.host);
    return Request(std::make_unique<StagedRequest>(
        std::move(inner), [this, back = std::move(back), release = std::move(release)] {
          for (const CopyBack& c : back) {
            if (c.device.device)
              k_.copy_from_host(c.device, c.host.p, c.n);
            else
              std::copy_n(c.host.p, c.n * int64_t(dtype_size(c.host.dtype)), c.device.p);
          }
          for (DPtr h : release) pool_.give_back(h.p);
        }));
  }

  std::unique_ptr<Communicator> host_;
  Kernels& k_;
  PinnedPool pool_;
};

}  // namespace

std::unique_ptr<Communicator> make_staged_communicator(std::unique_ptr<Communicator> host,
                                                       Kernels& kernels) {
  return std::make_unique<StagedCommunicator>(std::move(host), kernels);
}

}  // namespace trainer
