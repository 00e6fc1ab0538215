#pragma once
// What a run prints before its first step, on rank 0: the start-up report (the device, model,
// data, layout, memory plan and precision, every rank's place) and --dry-run's plan (each
// pipeline stage's memory, the largest rank, a step at the MFU peak).
#include "trainer/run.h"

namespace trainer {

// Returns the planner's estimate of a step it printed (0 s: none).
double print_start(const Run& run);
void print_dry_run(const Run& run);

// The planner's estimate of a step of this run's layout (trainer/planner.h), on its ranks: their
// MFU peak (on the CPU, what a rank gets of its node's cores) and the bandwidths (inside a node
// on the CPU: the one measured at start-up, Run::node.gbps). None (0 s) when the peak is unknown;
// cluster (optional): the cluster the estimate was made for.
struct Candidate;
struct Cluster;
Candidate planned_step(const Run& run, Cluster* cluster = nullptr);

}  // namespace trainer
