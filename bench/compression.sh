#!/usr/bin/env bash
# Gradient compression and mixed precision on the W-S workload at dp = 2 (two ranks, one thread
# each, this machine), in one run: bytes on the wire per step, tokens/s, the loss after the same
# steps and peak memory, for every compression method against none (fp32), and for bf16 and
# fp16 (16-bit weights, activations and gradients; fp32 master weights) against fp32.
#
#   bench/compression.sh [--steps N] [--warmup N]
#
# On the CPU backend the 16-bit formats are real storage computed in fp32 (every kernel widens
# its inputs and rounds its outputs): the precision rows measure that overhead and the memory,
# not 16-bit arithmetic. Compression runs on the CPU as well, so its time is part of the step.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD:-$ROOT/build}"
steps=3
warmup=2
while (($#)); do
  case "$1" in
    --steps) steps="$2"; shift ;;
    --warmup) warmup="$2"; shift ;;
    -h | --help) sed -n '2,12s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "compression.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done

# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
ws_setup "$ROOT" "$BUILD" $((steps + warmup))

run() {
  local name="$1"
  shift
  echo "compression.sh: $name" >&2
  mpirun -q --oversubscribe --bind-to none -np 2 "$BUILD/trainer" train "$work/ws.toml" \
    --set run.out_dir="\"$work/$name\"" --set run.threads=1 --set parallel.dp=2 \
    --set train.grad_accum=2 "$@" >"$work/$name.log"
  summarize "$name" 2 "$work/$name/metrics.jsonl" "$warmup"
}

for method in none fp16 bf16 int8 onebit topk powersgd; do
  run "$method" --set comm.compression.method="$method"
done
for compute in bf16 fp16; do
  run "precision_$compute" --set precision.compute="$compute" --set precision.grads=compute
done
