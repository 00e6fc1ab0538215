#include "kernels/cuda/op_timer.h"

#include "kernels/cuda/cuda_check.h"

namespace trainer::cuda {

OpTimer::~OpTimer() {
  for (const Pending& p : pending_) {
    cudaEventDestroy(p.start);
    cudaEventDestroy(p.end);
  }
  for (cudaEvent_t e : free_) cudaEventDestroy(e);
  if (anchor_) cudaEventDestroy(anchor_);
}

void OpTimer::set_observer(Kernels::OpObserver observer) {
  for (const Pending& p : pending_) free_.insert(free_.end(), {p.start, p.end});
  pending_.clear();
  observer_ = std::move(observer);
  if (!observer_) return;
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  anchor();
}

cudaEvent_t OpTimer::take() {
  if (free_.empty()) {
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreate(&e));  // with timing
    return e;
  }
  cudaEvent_t e = free_.back();
  free_.pop_back();
  return e;
}

void OpTimer::record(cudaEvent_t e) {
  CUDA_CHECK(cudaEventRecord(e, stream_));
}

void OpTimer::anchor() {
  if (!anchor_) CUDA_CHECK(cudaEventCreate(&anchor_));
  CUDA_CHECK(cudaEventRecord(anchor_, stream_));
  CUDA_CHECK(cudaEventSynchronize(anchor_));
  anchor_time_ = std::chrono::steady_clock::now();
}

void OpTimer::deliver(bool all) {
  using Ms = std::chrono::duration<double, std::milli>;
  while (!pending_.empty()) {
    const Pending p = pending_.front();
    if (!all) {
      const cudaError_t done = cudaEventQuery(p.end);
      if (done == cudaErrorNotReady) return;
      CUDA_CHECK(done);
    }
    float start_ms = 0, end_ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&start_ms, anchor_, p.start));
    CUDA_CHECK(cudaEventElapsedTime(&end_ms, anchor_, p.end));
    pending_.pop_front();
    free_.insert(free_.end(), {p.start, p.end});
    const auto at = [&](float ms) {
      return anchor_time_ +
             std::chrono::duration_cast<std::chrono::steady_clock::duration>(Ms(double(ms)));
    };
    observer_(p.op, p.flops, at(start_ms), at(end_ms));
  }
}

void OpTimer::synchronized() {
  if (!observer_) return;
  deliver(true);
  anchor();
}

}  // namespace trainer::cuda
