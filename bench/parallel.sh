#!/usr/bin/env bash
# Parallel layouts on the W-S workload (6 layers, 6 heads, 384 wide, T 256, GPT-2 vocab), with
# the real binary under mpirun, on this machine, in one run.
#
#   bench/parallel.sh [--steps N] [--warmup N] [--repeats R]
#
# Prints one JSON line per run (medians over the steps after warm-up) and a final summary:
#  - overlap efficiency of the bucketed data-parallel all-reduce at dp = 2: the part of the
#    communication cost that overlap hides, (t_no_overlap - t_overlap) / (t_no_overlap -
#    t_no_comm), where t_no_comm is two single-process trainers with the same per-rank work
#    running side by side on the same cores (the same contention, no communication at all);
#    the three alternate, R times, and their medians are compared;
#  - throughput of each layout with the same global batch (16 sequences of 256 tokens);
#  - peak memory per rank for dp = 2 with zero = 0 and zero = 1.
# Two ranks share this machine's two cores (one thread each); the single-process run uses both.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD:-$ROOT/build}"
PYTHON="${PYTHON:-/usr/bin/python3}"
steps=5
warmup=2
repeats=3
while (($#)); do
  case "$1" in
    --steps) steps="$2"; shift ;;
    --warmup) warmup="$2"; shift ;;
    --repeats) repeats="$2"; shift ;;
    -h | --help) sed -n '2,15s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "parallel.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done

# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
ws_setup "$ROOT" "$BUILD" $((steps + warmup))

# run NAME RANKS THREADS --set ...: trains under mpirun (unbound: a rank's threads may use any
# core), prints the run's JSON line.
run() {
  local name="$1" ranks="$2" threads="$3" dir="$work/${1/\#/_}"
  shift 3
  echo "parallel.sh: $name" >&2
  mpirun -q --oversubscribe --bind-to none -np "$ranks" "$BUILD/trainer" train "$work/ws.toml" \
    --set run.out_dir="\"$dir\"" --set run.threads="$threads" "$@" >"$dir.log"
  summarize "$name" "$ranks" "$dir/metrics.jsonl" "$warmup"
}

# Two independent single-process trainers, each with one dp = 2 rank's work.
no_comm() {
  local name="$1" dir="$work/${1/\#/_}"
  echo "parallel.sh: $name (2 independent processes)" >&2
  for i in 0 1; do
    "$BUILD/trainer" train "$work/ws.toml" --set run.out_dir="\"${dir}_$i\"" \
      --set run.threads=1 --set train.grad_accum=2 >"${dir}_$i.log" &
  done
  wait
  summarize "$name" 2 "${dir}_0/metrics.jsonl" "$warmup"
}

results="$work/results.jsonl"
dp2=(--set parallel.dp=2 --set train.grad_accum=2)
{
  run serial 1 2 --set train.grad_accum=4
  for r in $(seq "$repeats"); do
    run "dp2#$r" 2 1 "${dp2[@]}"
    run "dp2_no_overlap#$r" 2 1 "${dp2[@]}" --set parallel.overlap=false
    no_comm "no_comm#$r"
  done
  run dp2_zero1 2 1 "${dp2[@]}" --set parallel.zero=1
  run tp2 2 1 --set parallel.tp=2 --set train.grad_accum=4
  run pp2 2 1 --set parallel.pp=2 --set parallel.micro_batches=4
} | tee "$results"

"$PYTHON" - "$results" <<'EOF'
import json, statistics, sys
runs = {r["run"]: r for r in map(json.loads, open(sys.argv[1]))}
def median(kind, key="step_ms"):
    return statistics.median(r[key] for name, r in runs.items() if name.split("#")[0] == kind)
on, off, none = (median(k) for k in ("dp2", "dp2_no_overlap", "no_comm"))
print(json.dumps({
    "bench": "parallel-summary",
    "overlap_efficiency": round((off - on) / (off - none), 3) if off > none else None,
    "dp2_step_ms": {"overlap": on, "no_overlap": off, "no_comm": none},
    "dp2_comm_exposed_ms": {"overlap": median("dp2", "comm_exposed_ms"),
                            "no_overlap": median("dp2_no_overlap", "comm_exposed_ms")},
    "tokens_per_s": {"serial": runs["serial"]["tokens_per_s"], "dp2": median("dp2", "tokens_per_s"),
                     "dp2_zero1": runs["dp2_zero1"]["tokens_per_s"],
                     "tp2": runs["tp2"]["tokens_per_s"], "pp2": runs["pp2"]["tokens_per_s"]},
    "peak_rss_mb_per_rank_dp2": {"zero0": runs["dp2#1"]["peak_rss_mb_max"],
                                 "zero1": runs["dp2_zero1"]["peak_rss_mb_max"]},
}))
EOF
