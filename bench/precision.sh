#!/usr/bin/env bash
# Mixed precision on the W-S workload, one process, 2 threads: tokens/s, peak memory and the
# loss after the same steps for fp32, bf16 and fp16 (16-bit weights, activations and gradients;
# fp32 master weights and AdamW state), in one run.
#
#   bench/precision.sh [--steps N] [--warmup N]
#
# On the CPU backend the 16-bit formats are real storage, computed in fp32: every kernel widens
# its inputs and rounds its outputs, so this measures that overhead and the memory saved, not
# the speed of 16-bit arithmetic (the CUDA backend computes in them natively).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD:-$ROOT/build}"
PYTHON="${PYTHON:-/usr/bin/python3}"
steps=4
warmup=2
while (($#)); do
  case "$1" in
    --steps) steps="$2"; shift ;;
    --warmup) warmup="$2"; shift ;;
    -h | --help) sed -n '2,10s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "precision.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done

cmake --build "$BUILD" --target trainer -j2 >&2
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
data="$(bench_data "$ROOT" "$BUILD" "$work")"
ws_config "$work/ws.toml" "$data" $((steps + warmup))

for compute in fp32 bf16 fp16; do
  echo "precision.sh: $compute" >&2
  "$BUILD/trainer" train "$work/ws.toml" --set run.out_dir="\"$work/$compute\"" \
    --set run.threads=2 --set precision.compute="\"$compute\"" \
    --set precision.grads="\"compute\"" >"$work/$compute.log"
  summarize "$compute" 1 "$work/$compute/metrics.jsonl" "$warmup"
done
