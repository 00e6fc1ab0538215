#!/usr/bin/env bash
# The planner's step-time estimates against measured step times, on the W-S workload (6 layers,
# 6 heads, 384 wide, T 256, GPT-2 vocab; 16 sequences a step) over its 2- and 4-rank layouts,
# with the real binary under mpirun, on this machine, in one run.
#
#   bench/planner.sh [--steps N] [--warmup N] [--repeats R]
#
# Every rank has one thread and the same configured peak (run.peak_tflops = 0.1 a rank), so that
# the estimates differ by layout alone; four ranks on a two-core machine share its cores, which
# the estimate knows (a node's oversubscription). Prints one JSON line per layout (its measured
# median step and the estimate the run logged as planned_step_s, with its parts) and a summary
# with Spearman's rank correlation of the two over the set (the issue's bar: >= 0.8). With
# --repeats R the set runs R times over, and each layout's measured step is its fastest run's
# median (this machine's neighbours slow a run down, never speed it up).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD:-$ROOT/build}"
PYTHON="${PYTHON:-/usr/bin/python3}"
steps=3
warmup=2
repeats=1
while (($#)); do
  case "$1" in
    --steps) steps="$2"; shift ;;
    --warmup) warmup="$2"; shift ;;
    --repeats) repeats="$2"; shift ;;
    -h | --help) sed -n '2,15s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "planner.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
[[ "$repeats" =~ ^[1-9][0-9]*$ ]] || { echo "planner.sh: --repeats must be 1 or more" >&2; exit 2; }

# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
ws_setup "$ROOT" "$BUILD" $((steps + warmup))

# run NAME RANKS --set ...: trains under mpirun, prints the run's JSON line with the estimate.
run() {
  local name="$1" ranks="$2" dir="$work/$1"
  shift 2
  rm -rf "$dir"  # the last repeat's
  echo "planner.sh: $name" >&2
  mpirun -q --oversubscribe --bind-to none -np "$ranks" "$BUILD/trainer" train "$work/ws.toml" \
    --set run.out_dir="\"$dir\"" --set run.threads=1 --set run.peak_tflops=0.1 \
    --set checkpoint.every_steps=0 "$@" >"$dir.log"
  summarize "$name" "$ranks" "$dir/metrics.jsonl" "$warmup" | "$PYTHON" -c '
import json, re, sys
r = json.loads(sys.stdin.read())
log = open(sys.argv[1]).read()
m = re.search(r"the planner.s estimate: ([0-9.e+-]+) s a step \(([^)]*)\)", log)
r["planned_step_s"] = float(m.group(1))
r["planned_parts"] = m.group(2)
print(json.dumps(r))' "$dir.log"
}

full=(--set memory.recompute='"full"')
results="$work/results.jsonl"
for ((repeat = 0; repeat < repeats; repeat++)); do
  run dp2 2 --set parallel.dp=2 --set train.grad_accum=2
  run dp2_zero2 2 --set parallel.dp=2 --set train.grad_accum=2 --set parallel.zero=2
  run dp2_full 2 --set parallel.dp=2 --set train.grad_accum=2 "${full[@]}"
  run tp2 2 --set parallel.tp=2 --set train.grad_accum=4
  run tp2_full 2 --set parallel.tp=2 --set train.grad_accum=4 "${full[@]}"
  run pp2_x4 2 --set parallel.pp=2 --set train.grad_accum=4
  run pp2_x2 2 --set parallel.pp=2 --set train.micro_batch=8 --set train.grad_accum=2
  run pp2_x8 2 --set parallel.pp=2 --set train.micro_batch=2 --set train.grad_accum=8
  run dp4 4 --set parallel.dp=4 --set train.grad_accum=1
  run dp4_full 4 --set parallel.dp=4 --set train.grad_accum=1 "${full[@]}"
  run dp2_tp2 4 --set parallel.dp=2 --set parallel.tp=2 --set train.grad_accum=2
  run dp2_pp2 4 --set parallel.dp=2 --set parallel.pp=2 --set train.grad_accum=2
  run tp2_pp2 4 --set parallel.tp=2 --set parallel.pp=2 --set train.grad_accum=4
  run pp4_x4 4 --set parallel.pp=4 --set train.grad_accum=4
done | tee "$results"

"$PYTHON" - "$results" <<'PY'
import json, sys
runs = {}
for line in open(sys.argv[1]):  # each layout's fastest run
    r = json.loads(line)
    if r["run"] not in runs or r["step_ms"] < runs[r["run"]]["step_ms"]:
        runs[r["run"]] = r
runs = list(runs.values())
def ranks(v):
    return [sum(w < x for w in v) + (sum(w == x for w in v) - 1) / 2 for x in v]
def spearman(x, y):
    a, b = ranks(x), ranks(y)
    m = (len(a) - 1) / 2
    num = sum((p - m) * (q - m) for p, q in zip(a, b))
    return num / (sum((p - m) ** 2 for p in a) * sum((q - m) ** 2 for q in b)) ** 0.5
planned = [r["planned_step_s"] for r in runs]
measured = [r["step_ms"] / 1e3 for r in runs]
two = [i for i, r in enumerate(runs) if r["ranks"] == 2]
print(json.dumps({
    "bench": "planner-summary",
    "pairs_s": {r["run"]: [round(p, 3), round(m, 3)] for r, p, m in zip(runs, planned, measured)},
    "spearman": round(spearman(planned, measured), 3),
    "spearman_2_ranks": round(spearman([planned[i] for i in two], [measured[i] for i in two]), 3),
}))
PY
