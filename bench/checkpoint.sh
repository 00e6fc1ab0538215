#!/usr/bin/env bash
# Checkpoint cost on the W-M workload (GPT-2 124M, T 1024, micro-batch 1): one process and four
# ranks (dp 4 with ZeRO-1, each rank writing a quarter of the moments and weights with parallel
# HDF5), each with the asynchronous writer and synchronously.
#
#   bench/checkpoint.sh [--steps N]
#
# Each run trains N steps (default 5) with a checkpoint every 2 steps and the final one. Prints
# one JSON line per run: the training stall of the periodic checkpoints (what the step was
# blocked for: a copy of the rank's state into host memory when asynchronous, the whole write
# when synchronous), their write time (start to `latest` moved, on the writer's clock), the
# median step time without a checkpoint and with one being written in the background, and the
# size of one checkpoint on disk.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD:-$ROOT/build}"
PYTHON="${PYTHON:-/usr/bin/python3}"
steps=5
while (($#)); do
  case "$1" in
    --steps) steps="$2"; shift ;;
    -h | --help) sed -n '2,13s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "checkpoint.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done

# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
ws_setup "$ROOT" "$BUILD" "$steps"
wm_config "$work/wm.toml" "$(bench_data "$ROOT" "$BUILD" "$work")" "$steps"
cat >>"$work/wm.toml" <<CONFIG
[checkpoint]
every_steps = 2
CONFIG

# run NAME RANKS ASYNC [--set ...]: trains, prints the run's JSON line, removes its files.
run() {
  local name="$1" ranks="$2" async="$3"
  shift 3
  local out="$work/$name"
  mpirun -q --oversubscribe --bind-to none -np "$ranks" "$BUILD/trainer" train "$work/wm.toml" \
    --set run.out_dir="$out" --set checkpoint.async="$async" "$@" >"$work/$name.log" 2>&1 ||
    { cat "$work/$name.log" >&2; exit 1; }
  "$PYTHON" - "$name" "$ranks" "$async" "$out" <<'PY'
import json, os, statistics, sys
name, ranks, async_, out = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "true", sys.argv[4]
records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
last = max(r["step"] for r in records if "loss" in r) + 1
stalls = [r["checkpoint_stall_ms"] for r in records if "checkpoint_stall_ms" in r and r["step"] < last]
writes = [r["write_ms"] for r in records if "write_ms" in r and r["step"] < last]
ckpt_steps = {r["step"] for r in records if "checkpoint_stall_ms" in r}
steps = [r for r in records if "loss" in r and r["step"] > 0]
plain = [r["ms"] for r in steps if r["step"] not in ckpt_steps]
during = [r["ms"] for r in steps if r["step"] in ckpt_steps]  # the step after a checkpoint starts
step_dir = os.path.join(out, "checkpoints", "step_%08d" % last)
size = sum(os.path.getsize(os.path.join(step_dir, f)) for f in os.listdir(step_dir))
print(json.dumps({"bench": "checkpoint", "run": name, "ranks": ranks, "async": async_,
                  "stall_ms": [round(s) for s in stalls], "write_ms": [round(w) for w in writes],
                  "step_ms": round(statistics.median(plain)) if plain else None,
                  "step_ms_while_writing": round(statistics.median(during)) if during else None,
                  "size_mb": round(size / 2**20, 1)}))
PY
  rm -rf "$out"
}

run wm_1_async 1 true
run wm_1_sync 1 false
run wm_4_async 4 true --set parallel.dp=4 --set parallel.zero=1 --set run.threads=1
run wm_4_sync 4 false --set parallel.dp=4 --set parallel.zero=1 --set run.threads=1
