#include "comm/param_gatherer.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace trainer {

int64_t ParamGatherer::window_buffer_elems(const std::vector<GradUnit>& units, int windows) {
  return windows * largest_lent_unit(units);
}

ParamGatherer::ParamGatherer(Kernels& k, DPtr held, DType dtype, const std::vector<GradUnit>& units,
                             Communicator& dp, Communicator* intra, Communicator* inter,
                             int windows)
    : k_(k), units_(units), held_(held), P_(dp.size()) {
  const bool hier = intra && inter;
  if (hier && intra->size() * inter->size() != P_)
    throw std::invalid_argument("ParamGatherer: intra x inter must be the data-parallel group");
  if (units.empty()) throw std::invalid_argument("ParamGatherer: no units");
  for (const GradUnit& u : units)
    if (u.begin % (16 * P_) || u.end % (16 * P_))
      throw std::invalid_argument("ParamGatherer: units must be aligned to 16 dp");
  // This rank's piece of every unit is where the gradient reducer cuts it: the piece index
  // intra rank x nodes + inter rank hierarchically (the chains below put it there), else the dp
  // rank.
  if (hier) {
    L_ = intra->size();
    intra_ = intra->dup();
    inter_ = inter->dup();
  } else {
    flat_ = dp.dup();
  }
  shard_elems_ = units.back().end / P_;
  shard_ = k.alloc(shard_elems_, dtype);
  window_elems_ = largest_lent_unit(units);
  for (int w = 0; w < (window_elems_ > 0 ? windows : 0); w++)
    windows_.push_back({k.alloc(window_elems_, dtype)});
  for (size_t u = 0; u < units.size(); u++) chains_.push_back(make_chain(int(u)));
}

ParamGatherer::~ParamGatherer() {
  while (!flights_.empty()) retire_front();  // every chain to its end, as on the other ranks
  for (Window& w : windows_) k_.free(w.at);
  k_.free(shard_);
}

std::vector<ParamGatherer::Step> ParamGatherer::make_chain(int u) const {
  const int64_t n = units_[u].elems(), piece = n / P_;
  const DPtr mine = shard_ + units_[u].begin / P_;
  if (flat_) {
    Communicator* dp = flat_.get();
    return {[=](DPtr into) { return dp->iall_gather(mine, into, piece); }};
  }
  // Across nodes into this node's part (the ranks holding the same part), then inside the node.
  Communicator *intra = intra_.get(), *inter = inter_.get();
  const int64_t part = n / L_, at = intra->rank() * part;
  return {[=](DPtr into) { return inter->iall_gather(mine, into + at, piece); },
          [=](DPtr into) { return intra->iall_gather(into + at, into, part); }};
}

int ParamGatherer::find(int u) const {
  for (size_t w = 0; w < windows_.size(); w++)
    if (windows_[w].unit == u) return int(w);
  return -1;
}

// The least recently used window not open (started or opened), whether its gather has finished
// or not: a choice that depends on the order of calls alone, which every rank shares, never on
// when a collective completed.
int ParamGatherer::free_window() const {
  int best = -1;
  for (size_t w = 0; w < windows_.size(); w++) {
    const Window& x = windows_[w];
    if (x.open) continue;
    if (best < 0 || x.last_use < windows_[best].last_use) best = int(w);
  }
  return best;
}

void ParamGatherer::finish_gather(int w) {
  while (windows_[w].unit >= 0 && !windows_[w].ready) retire_front();
}

void ParamGatherer::start(int u, int w) {
  if (units_.at(u).held) throw std::logic_error("ParamGatherer: a held unit has no window");
  finish_gather(w);  // a window still receiving finishes first
  windows_[w].unit = u;
  windows_[w].ready = false;
  windows_[w].last_use = ++clock_;
  Flight& f = flights_.emplace_back();
  f.window = w;
  f.next = 1;
  f.pending = chains_[u][0](windows_[w].at);
  stats_.gathers++;
}

void ParamGatherer::progress() {
  size_t issued_before = SIZE_MAX;  // steps the previous flight has started
  for (Flight& f : flights_) {
    const std::vector<Step>& steps = chains_[windows_[f.window].unit];
    while (f.next < steps.size() && f.next < issued_before && f.pending.test())
      f.pending = steps[f.next++](windows_[f.window].at);
    issued_before = f.next;
  }
  while (!flights_.empty() &&
         flights_.front().next == chains_[windows_[flights_.front().window].unit].size() &&
         flights_.front().pending.test())
    retire_front();
}

void ParamGatherer::retire_front() {
  Flight& f = flights_.front();
  Window& w = windows_[f.window];
  const std::vector<Step>& steps = chains_[w.unit];
  f.pending.wait();
  for (; f.next < steps.size(); f.next++) {
    f.pending = steps[f.next](w.at);
    f.pending.wait();
  }
  w.ready = true;
  flights_.pop_front();
}

DPtr ParamGatherer::open(int u) {
  int w = find(u);
  if (w >= 0) {
    stats_.ready++;
  } else {
    stats_.waited++;
    if ((w = free_window()) < 0) throw std::logic_error("ParamGatherer: every window is open");
    start(u, w);
  }
  finish_gather(w);
  windows_[w].open++;
  windows_[w].last_use = ++clock_;
  return windows_[w].at;
}

void ParamGatherer::close(int u) {
  const int w = find(u);
  if (w < 0 || !windows_[w].open) throw std::logic_error("ParamGatherer: close() without open()");
  windows_[w].open--;
}

void ParamGatherer::prefetch(int u) {
  if (find(u) >= 0) return;
  const int w = free_window();
  if (w >= 0) start(u, w);
}

void ParamGatherer::refresh() {
  while (!flights_.empty()) retire_front();
  for (Window& w : windows_) {
    if (w.open) throw std::logic_error("ParamGatherer: refresh() with a window open");
    w.unit = -1;
    w.ready = false;
  }
  for (size_t u = 0; u < units_.size(); u++) {
    if (!units_[u].held) continue;
    const DPtr into = held_ + units_[u].begin;
    for (const Step& step : chains_[u]) step(into).wait();
  }
}

ParamGatherer::Stats ParamGatherer::take_stats() {
  return std::exchange(stats_, {});
}

std::vector<Communicator*> ParamGatherer::communicators() const {
  if (flat_) return {flat_.get()};
  return {intra_.get(), inter_.get()};
}

}  // namespace trainer
