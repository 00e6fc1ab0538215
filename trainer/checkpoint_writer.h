#pragma once
// Writes checkpoints in the background. The training thread only pays for copying its part of
// the state into host memory (take_snapshot); a writer thread then writes it with parallel HDF5
// on a communicator of its own while training goes on (or while the step waits for it, for a
// synchronous checkpoint: either way a hung write can be timed out). One write at a time: the
// next checkpoint first waits for the previous one. Where a second thread may not call MPI
// (several ranks without MPI_THREAD_MULTIPLE), writes run in the calling thread, watched by a
// thread that calls on_hang after the timeout.
#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "trainer/checkpoint.h"

namespace trainer {

class CheckpointWriter {
 public:
  // `comm`: every rank of the job, for the writer alone (null: a single process). `threaded`:
  // whether a writer thread may call MPI (a single process, or MPI_THREAD_MULTIPLE).
  // timeout_s (0: none) and on_hang: what ends the job when an unthreaded write hangs.
  CheckpointWriter(const ModelConfig& model, std::unique_ptr<Communicator> comm, std::string dir,
                   int keep_last, bool threaded, double timeout_s = 0,
                   std::function<void(int64_t step)> on_hang = nullptr);
  ~CheckpointWriter();  // waits for a write in flight
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // The buffer to fill for the next write; only valid to touch after wait().
  Snapshot& snapshot() { return snapshot_; }

  // A finished write, as every rank saw it.
  struct Result {
    int64_t step = 0;
    std::string dir;    // the checkpoint written; empty if it failed
    std::string error;  // why it failed
    double write_s = 0;
  };
  // Starts writing snapshot() on the writer thread (or writes it now, where there is none).
  void start();
  // Whether writes run on a thread of their own (else start() returns when it is written).
  bool threaded() const { return threaded_; }
  // Blocks until the write in flight (if any) is done; returns its result once.
  std::optional<Result> wait();
  // The result of a write that has finished, without blocking (none while one is running).
  std::optional<Result> poll();
  // Whether the write in flight (if any) finishes within `seconds` (<= 0: waits for it).
  bool finishes_within(double seconds);
  // The step of the write in flight (or of the last one).
  int64_t writing() const { return writing_; }
  // The newest checkpoint this run wrote ("" before the first).
  const std::string& last_written() const { return last_written_; }

 private:
  void write();

  ModelConfig model_;
  std::unique_ptr<Communicator> comm_;
  std::string dir_;
  int keep_last_;
  bool threaded_;
  int64_t writing_ = -1;
  double timeout_s_;
  std::function<void(int64_t step)> on_hang_;
  Snapshot snapshot_;
  std::thread thread_;
  std::atomic<bool> done_{false};
  std::optional<Result> result_;
  std::string last_written_;
};

}  // namespace trainer
