#pragma once
#include "io/config.h"

namespace trainer {

// Trains the model `cfg` describes; writes config.toml, metrics.jsonl and checkpoints to
// cfg.run.out_dir. Returns the process exit code.
int train(const Config& cfg);

}  // namespace trainer
