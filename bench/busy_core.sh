#!/usr/bin/env bash
# How much of its speed the trainer keeps when another process takes half of one of its CPUs
# (a neighbour on a shared node, a noisy daemon, a hypervisor's other guest): trainer_bench on
# each workload, once alone and once beside a busy loop pinned to the last CPU it may use, its
# OpenMP threads bound one to each of those CPUs (OMP_PROC_BIND, OMP_PLACES), alternated.
#
#   bench/busy_core.sh [W-S] [W-M] [W-L] [--repeats R] [--steps N]
#
# Prints a JSON line per run (trainer_bench's, with "busy_core": true or false), then one per
# workload with the medians and "kept": tokens/s beside the busy loop over tokens/s alone.
# With T threads on T CPUs, one of them at half speed, a product whose threads each take a
# fixed share keeps 1/2 of its speed (all wait for the slow thread) and one that hands its work
# out a piece at a time (kernels/cpu/panel_gemm.h) keeps (T - 1/2) / T: 3/4 on two CPUs.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD:-$ROOT/build}"
PYTHON="${PYTHON:-/usr/bin/python3}"

workloads=()
repeats=2
steps=()
while (($#)); do
  case "$1" in
    W-S | W-M | W-L) workloads+=("$1") ;;
    --repeats) repeats="$2"; shift ;;
    --steps) steps=(--steps "$2"); shift ;;
    -h | --help) sed -n '2,13s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "busy_core.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
((${#workloads[@]})) || workloads=(W-S)

[[ $repeats =~ ^[1-9][0-9]*$ ]] || { echo "busy_core.sh: --repeats must be 1 or more" >&2; exit 2; }
command -v taskset >/dev/null || { echo "busy_core.sh: taskset (util-linux) not found" >&2; exit 1; }
# The CPUs this process may run on (not 0..nproc-1: a cgroup or taskset may allow others).
mapfile -t cpus < <("$PYTHON" -c 'import os; print(*sorted(os.sched_getaffinity(0)), sep="\n")')
((${#cpus[@]} >= 2)) || { echo "busy_core.sh: needs two CPUs or more, found ${#cpus[@]}" >&2; exit 1; }
threads=${#cpus[@]}
cmake --build "$BUILD" --target trainer_bench -j"$threads" >&2
# One thread on each CPU (a hardware thread, where cores have several), the last shared with the
# busy loop.
export OMP_NUM_THREADS="$threads" OMP_PROC_BIND=true
OMP_PLACES="$(printf '{%s},' "${cpus[@]}")"
export OMP_PLACES="${OMP_PLACES%,}"

busy=""
stop_busy() {
  if [[ -n $busy ]]; then kill "$busy" 2>/dev/null || true; wait "$busy" 2>/dev/null || true; fi
  busy=""
}
trap stop_busy EXIT

lines=()
for w in "${workloads[@]}"; do
  for ((r = 1; r <= repeats; r++)); do
    for mode in alone busy; do
      echo "busy_core.sh: $w $mode (repeat $r/$repeats)" >&2
      if [[ $mode == busy ]]; then
        taskset -c "${cpus[-1]}" bash -c 'while :; do :; done' &
        busy=$!
        sleep 0.2
        kill -0 "$busy" 2>/dev/null || { echo "busy_core.sh: the busy loop did not start" >&2; exit 1; }
      fi
      line=$("$BUILD/bench/trainer_bench" --workload "$w" --threads "$threads" ${steps[@]+"${steps[@]}"} |
        "$PYTHON" -c 'import json, sys
r = json.loads(sys.stdin.read()); r["busy_core"] = sys.argv[1] == "busy"; print(json.dumps(r))' "$mode")
      stop_busy
      echo "$line"
      lines+=("$line")
    done
  done
done

printf '%s\n' "${lines[@]}" | "$PYTHON" -c '
import json, statistics, sys
runs = [json.loads(line) for line in sys.stdin]
for w in dict.fromkeys(r["workload"] for r in runs):
    def median(key, busy):
        return statistics.median(r[key] for r in runs if r["workload"] == w and r["busy_core"] == busy)
    alone, busy = median("tokens_per_s", False), median("tokens_per_s", True)
    print(json.dumps({"workload": w, "tokens_per_s_alone": alone, "tokens_per_s_busy_core": busy,
                      "kept": busy / alone,
                      "matmul_gflops_alone": median("matmul_gflops", False),
                      "matmul_gflops_busy_core": median("matmul_gflops", True)}))
'
