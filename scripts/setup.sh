#!/usr/bin/env bash
# The first README command: installs the dependencies from Debian's packages, builds, prepares
# the embedded default data set (Jane Austen's novels) and trains configs/tiny.toml on it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
bash scripts/prepare_default_data.sh
# Run again, setup trains the default afresh: the earlier run in runs/tiny is replaced (a fresh
# run into another run's directory is otherwise refused).
build/trainer train configs/tiny.toml --set run.overwrite=true "$@"
echo
echo "setup: done. Sample from the trained model with:"
echo "  build/trainer generate --checkpoint runs/tiny --prompt \"It is a truth\" --tokens 300"
