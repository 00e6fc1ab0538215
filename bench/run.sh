#!/usr/bin/env bash
# Trainer vs PyTorch on the W-S, W-M and W-L (Llama) workloads, on the same machine, in one run.
#
#   bench/run.sh [W-S] [W-M] [W-L] [--steps N] [--warmup N] [--repeats R] [--threads N]
#
# Prints one JSON line per (framework, workload, repeat) and a final line with the trainer /
# PyTorch tokens/s ratio per workload and the trainer's MFU, counted as the trainer executes it
# (causal attention, `mfu`) and as PaLM counts it (attention's full square, `mfu_palm`), medians
# over repeats. Progress goes to stderr.
# Frameworks alternate within a workload so that slow drift of a shared machine hits both.
#
# Fairness: Debian's PyTorch calls whatever libblas.so.3 is loaded, so it runs with the OpenMP
# OpenBLAS (the one the trainer links), with the same OpenBLAS kernels (OPENBLAS_CORETYPE as the
# trainer picks it; where the trainer is built with AVX-512 its float GEMMs are its own,
# kernels/cpu/panel_gemm.h, so pin nothing narrower there to compare GEMM with GEMM), with
# jemalloc told to keep freed pages (by default it returns them to the OS, and page faults made
# PyTorch's W-S step ~25% slower: measured), on the same number of OpenMP threads. Each run
# reports other_cpu_cores, the CPU used by other processes (and hypervisor steal) while it was
# timed; a run disturbed by more than 0.25 cores is repeated (twice at most).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD:-$ROOT/build}"
PYTHON="${PYTHON:-/usr/bin/python3}"
OPENBLAS_DIR=/usr/lib/x86_64-linux-gnu/openblas-openmp
JEMALLOC=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2

workloads=()
common=()
repeats=1
threads=2
while (($#)); do
  case "$1" in
    W-S | W-M | W-L) workloads+=("$1") ;;
    --steps | --warmup) common+=("$1" "$2"); shift ;;
    --repeats) repeats="$2"; shift ;;
    --threads) threads="$2"; shift ;;
    -h | --help) sed -n '2,9s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
((${#workloads[@]})) || workloads=(W-S W-M)

for f in "$OPENBLAS_DIR/libblas.so.3" "$JEMALLOC"; do
  [[ -e "$f" ]] || { echo "run.sh: $f missing (libopenblas0-openmp, libjemalloc2)" >&2; exit 1; }
done

log() { echo "run.sh: $*" >&2; }

# Builds trainer_bench (a no-op when it is up to date).
cmake --build "$BUILD" --target trainer_bench -j2 >&2

# Field `key` of the JSON object on stdin.
field() { "$PYTHON" -c 'import json, sys; print(json.loads(sys.stdin.read())[sys.argv[1]])' "$1"; }

# Waits (at most 120 s) until other processes use less than 0.2 cores: these are 2-core machines
# and a concurrent compile makes OpenMP runs several times slower.
wait_idle() {
  # shellcheck disable=SC2016  # awk fields, not shell expansions
  local busy='/^cpu /{print $2+$3+$4+$7+$8+$9}' a b
  for _ in $(seq 40); do
    a=$(awk "$busy" /proc/stat); sleep 3; b=$(awk "$busy" /proc/stat)
    ((b - a < 60)) && return 0
  done
  log "warning: the machine is busy; timings will be noisy"
}

export OMP_NUM_THREADS="$threads"
export OPENBLAS_NUM_THREADS="$threads"

run_trainer() {
  "$BUILD/bench/trainer_bench" --workload "$1" --threads "$threads" ${common[@]+"${common[@]}"}
}

run_torch() {  # workload, peak GFLOP/s for the MFU, OpenBLAS core type
  env OPENBLAS_CORETYPE="$3" MALLOC_CONF="${MALLOC_CONF:-dirty_decay_ms:-1,muzzy_decay_ms:-1}" \
    LD_LIBRARY_PATH="$OPENBLAS_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    LD_PRELOAD="$JEMALLOC${LD_PRELOAD:+ $LD_PRELOAD}" \
    "$PYTHON" "$ROOT/bench/torch_bench.py" --workload "$1" --threads "$threads" \
    --peak-gflops "$2" ${common[@]+"${common[@]}"}
}

# Runs "$@" after waiting for an idle machine; reruns it while others disturbed the timing.
run_quiet() {
  local out
  for try in 1 2 3; do
    wait_idle
    out=$("$@")
    "$PYTHON" -c 'import json, sys; sys.exit(json.loads(sys.argv[1])["other_cpu_cores"] > 0.25)' \
      "$out" && break
    ((try < 3)) && log "other processes disturbed the run; running it again"
  done
  echo "$out"
}

results=()
for w in "${workloads[@]}"; do
  for ((r = 1; r <= repeats; r++)); do
    log "$w trainer (repeat $r/$repeats)"
    t=$(run_quiet run_trainer "$w")
    echo "$t"
    core=$(field blas_core <<<"$t")
    # A user's OPENBLAS_CORETYPE reaches both; otherwise PyTorch gets the trainer's choice.
    core="${OPENBLAS_CORETYPE:-$core}"
    log "$w pytorch (repeat $r/$repeats, OpenBLAS $core)"
    p=$(run_quiet run_torch "$w" "$(field peak_gflops <<<"$t")" "$core")
    echo "$p"
    lib=$(field blas_lib <<<"$p")
    got=$(field blas_core <<<"$p")
    if [[ "$lib" != "$OPENBLAS_DIR/"* || "$got" != "$core" ]]; then
      log "error: PyTorch ran with BLAS $lib ($got kernels), not $OPENBLAS_DIR ($core)"
      exit 1
    fi
    results+=("$t" "$p")
  done
done

printf '%s\n' "${results[@]}" | "$PYTHON" -c '
import json, statistics, sys
runs = [json.loads(line) for line in sys.stdin]
tps, mfu = {}, {}
for r in runs:
    tps.setdefault(r["workload"], {}).setdefault(r["framework"], []).append(r["tokens_per_s"])
    if r["framework"] == "trainer":
        mfu.setdefault(r["workload"], {"mfu": [], "mfu_palm": []})
        for k in ("mfu", "mfu_palm"):
            mfu[r["workload"]][k].append(r[k])
ratio = {w: statistics.median(f["trainer"]) / statistics.median(f["pytorch"])
         for w, f in tps.items()}
print(json.dumps({"ratio_trainer_over_pytorch_tokens_per_s": ratio,
                  "trainer_mfu": {w: statistics.median(m["mfu"]) for w, m in mfu.items()},
                  "trainer_mfu_palm": {w: statistics.median(m["mfu_palm"]) for w, m in mfu.items()},
                  "max_other_cpu_cores": max(r["other_cpu_cores"] for r in runs)}))
'
