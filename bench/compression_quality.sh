#!/usr/bin/env bash
# What communication-saving methods cost in model quality: tiny.toml (the embedded default,
# Austen, byte-level GPT-2) at dp = 4 as two simulated nodes of 2 ranks (parallel.ranks_per_node
# = 2, the hierarchical groups), the same global batch (4 ranks x micro-batches of 4 = tiny's 16
# sequences), the same seed, for every gradient-compression method (compressing what crosses
# nodes: the node's sum of its part of each bucket) and for DiLoCo outer steps ([comm.outer]),
# against the uncompressed hierarchical all-reduce. One run, this machine, real mpirun.
#
#   bench/compression_quality.sh [--steps N] [--only NAME,NAME...] [--ranks-per-node K]
#
# --ranks-per-node 1 makes the four ranks four nodes (int8's and onebit's messages then cross in
# two phases, comm/compression.h).
#
# Prints one JSON line per method: bytes rank 0 sent per step between nodes (inter) and inside
# its node (intra), averaged over the run; the final validation loss and its change from the
# uncompressed run's; the inter-node traffic saved; the median step time (the CPU compresses, so
# its cost is in the step; 4 ranks share 2 cores). Then a summary: the methods with >= 90% less
# inter-node traffic whose validation loss is within 1% of the uncompressed run's.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD:-$ROOT/build}"
PYTHON="${PYTHON:-/usr/bin/python3}"
steps=1000
only=""
per_node=2
while (($#)); do
  case "$1" in
    --steps) steps="$2"; shift ;;
    --only) only=",$2,"; shift ;;
    --ranks-per-node) per_node="$2"; shift ;;
    -h | --help) sed -n '2,18s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "compression_quality.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
if [[ ! -f "$ROOT/data/austen/train.bin" ]]; then
  echo "compression_quality.sh: no data/austen: run scripts/prepare_default_data.sh" >&2
  exit 2
fi
cmake --build "$BUILD" --target trainer -j2 >&2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# run NAME --set ...: one method; prints its JSON line.
run() {
  local name="$1" dir="$work/$1"
  shift
  [[ -z "$only" || "$only" == *",$name,"* || "$name" == none ]] || return 0
  echo "compression_quality.sh: $name" >&2
  (cd "$ROOT" && mpirun -q --oversubscribe --bind-to none -np 4 "$BUILD/trainer" train \
    configs/tiny.toml --set run.out_dir="\"$dir\"" --set run.threads=1 \
    --set train.steps="$steps" --set train.micro_batch=4 --set parallel.dp=4 \
    --set parallel.allreduce='"hierarchical"' --set parallel.ranks_per_node="$per_node" \
    --set train.val_every="$steps" --set train.sample_every=0 --set train.log_every=100 \
    "$@" >"$dir.log")
  "$PYTHON" - "$name" "$dir/metrics.jsonl" <<'PY'
import json, statistics, sys
name, path = sys.argv[1], sys.argv[2]
records = [json.loads(line) for line in open(path)]
steps = [r for r in records if "loss" in r]
val = [r["val_loss"] for r in records if "val_loss" in r][-1]
group = lambda r, g: r.get("bytes_sent_groups", {}).get(g, 0)
mean = lambda key: sum(key(r) for r in steps) / len(steps)
print(json.dumps({"bench": "compression_quality", "method": name, "steps": len(steps),
                  "inter_mb_per_step": round(mean(lambda r: group(r, "inter")) / 1e6, 4),
                  "intra_mb_per_step": round(mean(lambda r: group(r, "intra")) / 1e6, 4),
                  "val_loss": round(val, 4),
                  "step_ms": round(statistics.median(r["ms"] for r in steps), 1)}))
PY
}

results="$work/results.jsonl"
outer=(--set comm.outer.quantize='"int8"')
{
  run none
  for method in fp16 int8 onebit; do
    run "$method" --set comm.compression.method="\"$method\""
  done
  run topk_1pct --set comm.compression.method='"topk"' --set comm.compression.topk_ratio=0.01
  for rank in 1 2 4 8; do
    run "powersgd_r$rank" --set comm.compression.method='"powersgd"' \
      --set comm.compression.powersgd_rank="$rank"
  done
  # 1-bit Adam: v frozen after 25, 50 or 100 steps; the warm-up uncompressed, or in int8.
  for freeze in 25 50 100; do
    run "onebit_adam_f$freeze" --set optim.name='"onebit_adam"' --set optim.freeze_step="$freeze"
  done
  for freeze in 50 100; do
    run "onebit_adam_f${freeze}_int8" --set optim.name='"onebit_adam"' \
      --set optim.freeze_step="$freeze" --set comm.compression.method='"int8"'
  done
  # PowerSGD with a rank per matrix: its factors about 5% of its values.
  run powersgd_b05 --set comm.compression.method='"powersgd"' \
    --set comm.compression.powersgd_budget=0.05
  # DGC on AdamW: v frozen after 50 steps, then each rank's momentum accumulated and its top 1%
  # sent (25% at the freeze, falling to 1% over 50 steps), with momentum factor masking and
  # without; 2% and 5% without masking.
  dgc=(--set optim.name='"dgc_adam"' --set optim.freeze_step=50 --set optim.dgc_warmup_steps=50)
  run dgc_1pct "${dgc[@]}" --set optim.dgc_ratio=0.01
  run dgc_1pct_nomask "${dgc[@]}" --set optim.dgc_ratio=0.01 --set optim.dgc_masking=false
  run dgc_2pct_nomask "${dgc[@]}" --set optim.dgc_ratio=0.02 --set optim.dgc_masking=false
  run dgc_5pct_nomask "${dgc[@]}" --set optim.dgc_ratio=0.05 --set optim.dgc_masking=false
  run diloco_h10 --set comm.outer.every_steps=10
  run diloco_h10_int8 --set comm.outer.every_steps=10 "${outer[@]}"
  run diloco_h25_int8 --set comm.outer.every_steps=25 "${outer[@]}"
  run diloco_h50_int8 --set comm.outer.every_steps=50 "${outer[@]}"
} | tee "$results"

"$PYTHON" - "$results" <<'PY'
import json, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
base = next(r for r in runs if r["method"] == "none")
good = []
for r in runs:
    r["inter_saved"] = 1 - r["inter_mb_per_step"] / base["inter_mb_per_step"]
    r["val_change"] = r["val_loss"] / base["val_loss"] - 1
    if r["inter_saved"] >= 0.9 and r["val_change"] <= 0.01:
        good.append(r["method"])
print(json.dumps({"bench": "compression_quality", "summary": True,
                  "baseline_val_loss": base["val_loss"],
                  "rows": [{k: (round(v, 4) if isinstance(v, float) else v)
                            for k, v in r.items() if k != "bench"} for r in runs],
                  "meets_90pct_within_1pct": good}))
PY
