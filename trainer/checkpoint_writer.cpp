#include "trainer/checkpoint_writer.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <utility>

namespace trainer {

constexpr int kWriterNice = 10;

CheckpointWriter::CheckpointWriter(const ModelConfig& model, std::unique_ptr<Communicator> comm,
                                   std::string dir, int keep_last, bool threaded, double timeout_s,
                                   std::function<void(int64_t step)> on_hang)
    : model_(model),
      comm_(std::move(comm)),
      dir_(std::move(dir)),
      keep_last_(keep_last),
      threaded_(threaded),
      timeout_s_(timeout_s),
      on_hang_(std::move(on_hang)) {}

CheckpointWriter::~CheckpointWriter() {
  if (thread_.joinable()) thread_.join();
}

void CheckpointWriter::write() {
  const auto t0 = std::chrono::steady_clock::now();
  Result r;
  r.step = snapshot_.state.step;
  try {
    r.dir = write_checkpoint(snapshot_, model_, comm_.get(), dir_, keep_last_);
  } catch (const std::exception& e) {
    r.error = e.what();
  }
  r.write_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  result_ = std::move(r);
  done_ = true;
}

void CheckpointWriter::start() {
  if (thread_.joinable() || result_)
    throw std::logic_error("CheckpointWriter::start: wait() for the previous write first");
  done_ = false;
  writing_ = snapshot_.state.step;
  if (threaded_) {
    thread_ = std::thread([this] {
      // Below the training threads: on a node without spare cores the write should take
      // their idle time, not slow the step down (Linux: per-thread niceness).
      setpriority(PRIO_PROCESS, pid_t(syscall(SYS_gettid)), kWriterNice);
      write();
    });
    return;
  }
  // In this thread, watched: past the timeout, on_hang ends the job.
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  std::thread watchdog;
  if (timeout_s_ > 0 && on_hang_)
    watchdog = std::thread([&] {
      std::unique_lock lock(mu);
      if (!cv.wait_for(lock, std::chrono::duration<double>(timeout_s_), [&] { return finished; }))
        on_hang_(writing_);
    });
  write();
  {
    std::lock_guard lock(mu);
    finished = true;
  }
  cv.notify_all();
  if (watchdog.joinable()) watchdog.join();
}

std::optional<CheckpointWriter::Result> CheckpointWriter::wait() {
  if (thread_.joinable()) thread_.join();
  if (result_ && !result_->dir.empty()) last_written_ = result_->dir;
  return std::exchange(result_, std::nullopt);
}

bool CheckpointWriter::finishes_within(double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (seconds > 0 && thread_.joinable() && !done_) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

std::optional<CheckpointWriter::Result> CheckpointWriter::poll() {
  if (!done_) return std::nullopt;
  return wait();
}

}  // namespace trainer
