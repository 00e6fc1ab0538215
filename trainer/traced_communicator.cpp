#include "trainer/traced_communicator.h"

#include <mutex>
#include <vector>

namespace trainer {
namespace {

class TracedCommunicator : public Communicator {
 public:
  TracedCommunicator(std::unique_ptr<Communicator> inner, Trace& trace, const std::string& group)
      : inner_(std::move(inner)), trace_(trace), group_(group), track_("comm " + group) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  Request iall_reduce(DPtr buf, int64_t n, ReduceOp op) override {
    return traced("all_reduce", [&] { return inner_->iall_reduce(buf, n, op); });
  }
  Request ireduce_scatter(DPtr send, DPtr recv, int64_t count) override {
    return traced("reduce_scatter", [&] { return inner_->ireduce_scatter(send, recv, count); });
  }
  Request iall_gather(DPtr send, DPtr recv, int64_t count) override {
    return traced("all_gather", [&] { return inner_->iall_gather(send, recv, count); });
  }
  Request ibroadcast(DPtr buf, int64_t n, int root) override {
    return traced("broadcast", [&] { return inner_->ibroadcast(buf, n, root); });
  }
  Request isend(DPtr buf, int64_t n, int peer, int tag) override {
    return traced("send", [&] { return inner_->isend(buf, n, peer, tag); });
  }
  Request irecv(DPtr buf, int64_t n, int peer, int tag) override {
    return traced("recv", [&] { return inner_->irecv(buf, n, peer, tag); });
  }
  void barrier() override { inner_->barrier(); }
  std::unique_ptr<Communicator> dup() override {
    return std::make_unique<TracedCommunicator>(inner_->dup(), trace_, group_);
  }
  Traffic traffic() const override { return inner_->traffic(); }
  Communicator& host_comm() override { return inner_->host_comm(); }

 private:
  // The inner request, completed through this one: its span ends where it is seen complete.
  struct Impl : Request::Impl {
    Request inner;
    TracedCommunicator* comm;
    std::string op;
    Trace::Clock::time_point start;
    double bytes;
    int lane;
    void wait() override {
      const auto t0 = Trace::Clock::now();
      inner.wait();
      const auto t1 = Trace::Clock::now();
      comm->trace_.add("wait " + op + " " + comm->group_, "comm_wait", t0, t1);
      done(t1);
    }
    bool test() override {
      if (!inner.test()) return false;
      done(Trace::Clock::now());
      return true;
    }
    void done(Trace::Clock::time_point t) {
      const std::string track =
          lane == 0 ? comm->track_ : comm->track_ + " " + std::to_string(lane + 1);
      comm->trace_.add(op + " " + comm->group_, "collective", start, t, 0, track, bytes);
      comm->free_lane(lane);
    }
  };

  template <class Start>
  Request traced(const char* op, Start&& start) {
    if (!trace_.recording()) return start();
    const int64_t sent = inner_->traffic().bytes_sent;
    auto impl = std::make_unique<Impl>();
    impl->start = Trace::Clock::now();
    impl->lane = take_lane();
    impl->inner = start();
    impl->comm = this;
    impl->op = op;
    // What the start accounted (the traffic counter counts at the start of an operation).
    impl->bytes = double(inner_->traffic().bytes_sent - sent);
    return Request(std::move(impl));
  }

  // The lowest lane no transfer in flight holds.
  int take_lane() {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < lanes_.size(); i++)
      if (!lanes_[i]) return lanes_[i] = true, int(i);
    lanes_.push_back(true);
    return int(lanes_.size()) - 1;
  }
  void free_lane(int lane) {
    std::lock_guard<std::mutex> lock(mu_);
    lanes_[size_t(lane)] = false;
  }

  std::unique_ptr<Communicator> inner_;
  Trace& trace_;
  std::string group_, track_;
  std::mutex mu_;
  std::vector<bool> lanes_;
};

}  // namespace

std::unique_ptr<Communicator> traced(std::unique_ptr<Communicator> inner, Trace& trace,
                                     const std::string& group) {
  return std::make_unique<TracedCommunicator>(std::move(inner), trace, group);
}

}  // namespace trainer
