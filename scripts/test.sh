#!/usr/bin/env bash
# The second README command: installs what is missing, builds, and runs the whole test suite
# (unit tests, end-to-end CLI tests, the PyTorch reference check). Fails when a test fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
# The embedded default's data (Austen): the quality tests train on it.
bash scripts/prepare_default_data.sh
# Serial on purpose: each test already uses every core through OpenMP.
ctest --test-dir build --output-on-failure
