#!/usr/bin/env bash
# Memory against speed: W-M and W-L (one process, fp32, 2 threads) under each activation
# recomputation mode, in one run.
#
#   bench/memory.sh [W-M] [W-L] [--steps N]
#
# Prints trainer_bench's JSON line per (workload, mode), then a table: tokens/s, the planned
# memory (the model's weights, gradients and activations from the executor's plan, plus AdamW's
# state) against the measured peak RSS, and their ratio. The RSS also holds what no plan counts:
# the process's libraries (the CUDA-enabled binary maps ~150 MB of them), OpenBLAS's buffers and
# the benchmark's own host copies.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD:-$ROOT/build}"
PYTHON="${PYTHON:-/usr/bin/python3}"

workloads=()
steps=2
while (($#)); do
  case "$1" in
    W-M | W-L) workloads+=("$1") ;;
    --steps) steps="$2"; shift ;;
    -h | --help) sed -n '2,7s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "memory.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
((${#workloads[@]})) || workloads=(W-M W-L)

cmake --build "$BUILD" --target trainer_bench -j2 >&2
export OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2

lines=()
for w in "${workloads[@]}"; do
  for mode in none selective full; do
    echo "memory.sh: $w recompute $mode" >&2
    line="$("$BUILD/bench/trainer_bench" --workload "$w" --threads 2 --steps "$steps" \
      --warmup 1 --recompute "$mode")"
    echo "$line"
    lines+=("$line")
  done
done

printf '%s\n' "${lines[@]}" | "$PYTHON" -c '
import json, sys
print("| workload | recompute | tokens/s | planned activations MB | planned MB | peak RSS MB | RSS / planned |")
print("|---|---|---|---|---|---|---|")
for line in sys.stdin:
    d = json.loads(line)
    row = (d["workload"], d["recompute"], d["tokens_per_s"], d["planned_activations_mb"],
           d["planned_mb"], d["peak_rss_mb"], d["peak_rss_mb"] / d["planned_mb"])
    print("| %s | %s | %.0f | %.0f | %.0f | %.0f | %.2f |" % row)
'
