#pragma once
// Gradient units and windows: ZeRO-2's protocol between the stage executor, which writes
// gradients, and the data-parallel reducer, which reduce-scatters them; and ZeRO-3's, by which
// the executor borrows each unit's parameters, gathered, just before it runs.
//
// A backward finishes the gradients of one unit at a time: the final norm and head after the
// blocks first, then each block from the last to the first, then the embeddings ahead of them.
// The units partition the flat gradient offsets of a shard's parameter table. Under ZeRO-2 the
// executor keeps no flat gradient buffer: it asks for a window (a zeroed buffer for one unit)
// just before the unit's backward and hands it back when it ends; the reducer reduce-scatters
// the window, adds this rank's piece into its gradient shard and lends the window out again. So
// a rank holds a few units' worth of gradients instead of all of them, for every micro-batch's
// backward (DeepSpeed's ZeRO-2 reduces each micro-batch too). The one exception is a unit
// `held` for the whole step: the embeddings when the head is tied to the token embedding, whose
// gradient the head writes first and the embedding last, and which pipeline stages sum across
// them before the data-parallel reduction; it is reduced once, at the end of the step.
#include <cstdint>
#include <vector>

#include "kernels/dtype.h"
#include "model/param_table.h"

namespace trainer {

struct GradUnit {
  int64_t begin = 0, end = 0;  // flat offsets [begin, end)
  bool held = false;
  int64_t elems() const { return end - begin; }
};

// The units of a table, in offset order: the parameters ahead of the first block (held when
// one of them is a tied embedding), each block, and the parameters after the blocks; empty ones
// left out. Their boundaries are those the table's unit_multiple aligns.
std::vector<GradUnit> grad_units(const ParamTable& table);
// Where the held units end (they come first): the flat gradients a windowed shard keeps.
int64_t held_end(const std::vector<GradUnit>& units);
// The largest unit not held: the size of a window (of gradients under ZeRO-2, of parameters
// under ZeRO-3).
int64_t largest_lent_unit(const std::vector<GradUnit>& units);

// What the executor asks of whoever lends windows (the reducer).
class GradientWindows {
 public:
  virtual ~GradientWindows() = default;
  // A zeroed buffer of units[u].elems() gradient elements for this backward of unit u.
  virtual DPtr open(int u) = 0;
  // Unit u's gradients of this backward are final in the buffer open(u) gave; `layers_left`:
  // how many of the stage's blocks have not started their backward yet.
  virtual void close(int u, int layers_left) = 0;
};

// What the executor asks of whoever gathers ZeRO-3's parameters. Each rank keeps only its
// pieces of the parameters; a unit's are all-gathered into a window just before the unit runs
// (forward, recomputation, backward, inference) and the window may be reused once it is closed.
// The held units' parameters stay whole for the whole step, as their gradients do.
class ParamWindows {
 public:
  virtual ~ParamWindows() = default;
  // Unit u's parameters, whole (units[u].elems() elements), until close(u): waited for here if
  // their gathering has not finished.
  virtual DPtr open(int u) = 0;
  virtual void close(int u) = 0;
  // Unit u is the next to be opened: start gathering it now if a window is free, so that it
  // arrives while the current unit computes.
  virtual void prefetch(int u) = 0;
  // Drives the gathers in flight (between kernels: a non-blocking collective progresses only
  // inside calls of the communication library).
  virtual void progress() = 0;
};

}  // namespace trainer
