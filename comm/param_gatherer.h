#pragma once
// ZeRO-3's parameter gathering (FSDP's "unshard"): each data-parallel rank keeps only its
// pieces of the compute parameters, in the same shard layout as its gradients and optimizer
// state (comm/grad_reducer.h): unit u's piece at shard offset units[u].begin / dp. Just before a
// unit runs, the stage executor borrows a window holding the unit's parameters whole
// (model/grad_units.h, ParamWindows): they are all-gathered into it, flat or hierarchically
// (across nodes between the ranks that hold the same part, then inside the node), and the next
// unit the executor will need is gathered ahead (prefetch) while this one computes. A window
// keeps its unit until it is needed for another, so the units a forward ends with are still
// there when the backward starts. The held units (a tied embedding) are gathered whole after
// each update, as ZeRO-1 gathers everything.
//
// Gathers run on communicators of their own (duplicates of the data-parallel group's), so that
// they are ordered independently of the gradient reductions; among themselves each chain step
// kind is issued in the order the gathers were started, the same on every rank (every rank of a
// data-parallel group runs the same schedule, so opens and prefetches come in one order).
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "kernels/kernels.h"
#include "model/grad_units.h"

namespace trainer {

class ParamGatherer : public ParamWindows {
 public:
  // Windows: the unit computing, the next one arriving, and the one before, which a backward
  // needs again right after the forward ends.
  static constexpr int kWindows = 3;
  // held: the executor's buffer of the held units' parameters (null when none is held); units:
  // the shard's gradient units, aligned to 16 x dp; dtype: the compute dtype. intra and inter:
  // the data-parallel group split by node (both or neither).
  ParamGatherer(Kernels& k, DPtr held, DType dtype, const std::vector<GradUnit>& units,
                Communicator& dp, Communicator* intra, Communicator* inter, int windows = kWindows);
  ~ParamGatherer() override;
  ParamGatherer(const ParamGatherer&) = delete;
  ParamGatherer& operator=(const ParamGatherer&) = delete;

  // This rank's pieces of the compute parameters (shard_elems(), the gradient shard's layout):
  // what the optimizer updates (or rounds its fp32 master weights into).
  DPtr shard() const { return shard_; }
  int64_t shard_elems() const { return shard_elems_; }
  // After the shard changed (an update, a restore): the windows' contents are stale, and the
  // held units are gathered whole again. No window may be open.
  void refresh();

  DPtr open(int u) override;
  void close(int u) override;
  void prefetch(int u) override;
  void progress() override;

  int windows() const { return int(windows_.size()); }
  int64_t window_elems() const { return window_elems_; }
  // What the windows hold, in parameter elements (the plan's): `windows` of the largest unit
  // not held.
  static int64_t window_buffer_elems(const std::vector<GradUnit>& units, int windows);
  // Since the last take_stats(): gathers started, the opens that found their unit gathered or
  // on its way without waiting to start it (prefetched or kept), and the opens that had to
  // start it themselves.
  struct Stats {
    int64_t gathers = 0, ready = 0, waited = 0;
  };
  Stats take_stats();
  // The communicators the gathers use, for the traffic report.
  std::vector<Communicator*> communicators() const;

 private:
  struct Window {
    DPtr at;
    int unit = -1;         // whose parameters it holds or receives; -1: none
    bool ready = false;    // the gather has finished
    int open = 0;          // opens not yet closed
    int64_t last_use = 0;  // when last started or opened: the least recently used is reused
  };
  struct Flight {
    int window;
    size_t next = 0;  // chain steps started
    Request pending;
  };
  using Step = std::function<Request(DPtr into)>;
  std::vector<Step> make_chain(int u) const;  // unit u's gather into a buffer of its size
  int find(int u) const;                      // the window holding (or receiving) unit u, or -1
  int free_window() const;                    // the least recently used window not open, or -1
  void finish_gather(int w);                  // waits until window w's gather (if any) is done
  void start(int u, int w);
  void retire_front();

  Kernels& k_;
  std::vector<GradUnit> units_;
  DPtr held_, shard_;
  int64_t shard_elems_ = 0, window_elems_ = 0;
  int P_ = 1, L_ = 1;
  std::unique_ptr<Communicator> flat_, intra_, inter_;
  std::vector<std::vector<Step>> chains_;  // by unit
  std::vector<Window> windows_;
  std::deque<Flight> flights_;  // oldest first
  int64_t clock_ = 0;
  Stats stats_;
};

}  // namespace trainer
