#pragma once
// Writes checkpoints in the background. The training thread only pays for copying its part of
// the state into host memory (take_snapshot); a writer thread then writes it with parallel HDF5
// on a communicator of its own while training goes on. One write at a time: the next checkpoint
// first waits for the previous one.
#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "trainer/checkpoint.h"

namespace trainer {

class CheckpointWriter {
 public:
  // `comm`: every rank of the job, for the writer alone (null: a single process). `async`
  // false writes in the calling thread.
  CheckpointWriter(const GPTConfig& model, std::unique_ptr<Communicator> comm, std::string dir,
                   int keep_last, bool async);
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
  // Starts writing snapshot() (or writes it now, when synchronous or `sync`).
  void start(bool sync = false);
  // Blocks until the write in flight (if any) is done; returns its result once.
  std::optional<Result> wait();
  // The result of a write that has finished, without blocking (none while one is running).
  std::optional<Result> poll();
  // Whether the write in flight (if any) finishes within `seconds` (<= 0: waits for it).
  bool finishes_within(double seconds);
  // The newest checkpoint this run wrote ("" before the first).
  const std::string& last_written() const { return last_written_; }

 private:
  void write();

  GPTConfig model_;
  std::unique_ptr<Communicator> comm_;
  std::string dir_;
  int keep_last_;
  bool async_;
  Snapshot snapshot_;
  std::thread thread_;
  std::atomic<bool> done_{false};
  std::optional<Result> result_;
  std::string last_written_;
};

}  // namespace trainer
