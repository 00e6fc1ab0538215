#!/usr/bin/env bash
# Memory against speed, in one run: W-M and W-L (one process, fp32, 2 threads) under each
# activation recomputation mode; and W-M at dp = 4 (four ranks under mpirun, one thread each)
# under ZeRO 0, 1, 2 and 3; W-M at tp = 2 (two ranks) without and with sequence parallelism; and
# W-M at T = 4096 with context parallelism cp = 1 (one process, 2 threads), 2 and 4 (ranks of one
# thread).
#
#   bench/memory.sh [W-M] [W-L] [zero] [sp] [cp] [--steps N]
#
# Prints a JSON line per run, then a table each: tokens/s, the planned memory against the
# measured peak RSS, and their ratio. Recomputation: trainer_bench's plan (the model's weights,
# gradients and activations from the executor's plan, plus AdamW's state). ZeRO: the trainer's
# start-up plan for rank 0 (also its gradient shard and windows, MPI's reduction temporaries and
# the checkpoint's host copy) against rank 0's peak. The RSS also holds what no plan counts: the
# process's libraries (the CUDA-enabled binary maps ~150 MB of them), OpenBLAS's and MPI's
# buffers and the benchmark's own host copies.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD:-$ROOT/build}"
PYTHON="${PYTHON:-/usr/bin/python3}"

workloads=()
steps=2
while (($#)); do
  case "$1" in
    W-M | W-L | zero | sp | cp) workloads+=("$1") ;;
    --steps) steps="$2"; shift ;;
    -h | --help) sed -n '2,13s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "memory.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
((${#workloads[@]})) || workloads=(W-M W-L zero sp cp)

cmake --build "$BUILD" --target trainer_bench -j2 >&2
export OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2

lines=()
zero_lines=()
for w in "${workloads[@]}"; do
  if [[ "$w" == zero || "$w" == sp || "$w" == cp ]]; then
    # shellcheck source=bench/lib.sh
    source "$ROOT/bench/lib.sh"
    cmake --build "$BUILD" --target trainer -j2 >&2
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    if [[ -z "${work:-}" ]]; then  # once for both parts
      work="$(mktemp -d)"
      # shellcheck disable=SC2064  # the directory is known now
      trap "rm -rf '$work'" EXIT
      data="$(bench_data "$ROOT" "$BUILD" "$work")"
      wm_config "$work/wm.toml" "$data" $((steps + 1))
      gpt2_config "$work/wm4k.toml" "$data" $((steps + 1)) 4096 12 768 1
    fi
    config="$work/wm.toml"
    if [[ "$w" == zero ]]; then
      runs=("zero0 4 --set parallel.dp=4 --set parallel.zero=0"
        "zero1 4 --set parallel.dp=4 --set parallel.zero=1"
        "zero2 4 --set parallel.dp=4 --set parallel.zero=2"
        "zero3 4 --set parallel.dp=4 --set parallel.zero=3")
    elif [[ "$w" == sp ]]; then
      runs=("tp2 2 --set parallel.tp=2 --set parallel.sequence_parallel=false"
        "tp2_sp 2 --set parallel.tp=2 --set parallel.sequence_parallel=true")
    else
      config="$work/wm4k.toml"
      runs=("T4096_cp1 1 --set parallel.cp=1 --set run.threads=2"
        "T4096_cp2 2 --set parallel.cp=2"
        "T4096_cp4 4 --set parallel.cp=4")
    fi
    for run in "${runs[@]}"; do
      read -r name ranks settings <<<"$run"
      echo "memory.sh: W-M $name" >&2
      dir="$work/$name"
      # shellcheck disable=SC2086  # the settings are words
      mpirun -q --oversubscribe --bind-to none -np "$ranks" "$BUILD/trainer" train \
        "$config" --set run.out_dir="\"$dir\"" --set run.threads=1 $settings >"$dir.log"
      line="$(summarize "$name" "$ranks" "$dir/metrics.jsonl" 1 | "$PYTHON" -c '
import json, re, sys
d = json.loads(sys.stdin.read())
log = open(sys.argv[1]).read()
d["planned_mb_rank0"] = float(re.search(r"rank 0 expects ([0-9.]+) MB", log).group(1))
# The peak is taken at the end of training, before the final checkpoint allocates its copy.
d["checkpoint_copy_mb"] = float(re.search(r"checkpoint copy ([0-9.]+)", log).group(1))
d["plan"] = re.search(r"^memory: (.*)$", log, re.M).group(1)
print(json.dumps(d))' "$dir.log")"
      echo "$line"
      zero_lines+=("$line")
    done
    continue
  fi
  for mode in none selective full; do
    echo "memory.sh: $w recompute $mode" >&2
    line="$("$BUILD/bench/trainer_bench" --workload "$w" --threads 2 --steps "$steps" \
      --warmup 1 --recompute "$mode")"
    echo "$line"
    lines+=("$line")
  done
done

if ((${#lines[@]})); then
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
fi
if ((${#zero_lines[@]})); then
  printf '%s\n' "${zero_lines[@]}" | "$PYTHON" -c '
import json, sys
print()
print("| W-M | tokens/s (all ranks) | MB sent per step (rank 0) | planned MB rank 0 | of which checkpoint copy | peak RSS MB rank 0 (training) | RSS / planned without the copy |")
print("|---|---|---|---|---|---|---|")
for line in sys.stdin:
    d = json.loads(line)
    training = d["planned_mb_rank0"] - d["checkpoint_copy_mb"]
    row = (d["run"], d["tokens_per_s"], d["mb_sent_per_step_rank0"], d["planned_mb_rank0"],
           d["checkpoint_copy_mb"], d["peak_rss_mb_rank0"], d["peak_rss_mb_rank0"] / training)
    print("| %s | %.0f | %.0f | %.0f | %.0f | %.0f | %.2f |" % row)
'
fi
