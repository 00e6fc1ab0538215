#!/usr/bin/env bash
# Weights in and out on the W-M model (GPT-2 124M, T 1024): `trainer export` to safetensors,
# the transformers layout and llm.c's format, in fp32 and bf16, and a warm start from each.
#
#   bench/interop.sh
#
# Trains one step (micro-batch 1) for a checkpoint, then prints one JSON line per export
# (seconds, the exporter's peak memory, the bytes written) and per warm start ([init] from the
# checkpoint or an export, one step: the seconds to the first step's record and the run's peak
# memory; the checkpoint's row is the baseline).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD:-$ROOT/build}"
PYTHON="${PYTHON:-/usr/bin/python3}"
while (($#)); do
  case "$1" in
    -h | --help) sed -n '2,11s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "interop.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done

# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
ws_setup "$ROOT" "$BUILD" 1
wm_config "$work/wm.toml" "$(bench_data "$ROOT" "$BUILD" "$work")" 1
"$BUILD/trainer" train "$work/wm.toml" --set run.out_dir="\"$work/source\"" >"$work/source.log" 2>&1 ||
  { cat "$work/source.log" >&2; exit 1; }
state="$work/source/checkpoints/step_00000001/state.h5"

for format in safetensors hf llmc; do
  for dtype in fp32 bf16; do
    out="$work/export.$format.$dtype"
    /usr/bin/time -f "%e %M" -o "$work/time" "$BUILD/trainer" export --format "$format" \
      --dtype "$dtype" --checkpoint "$work/source" --out "$out" >"$work/export.log" 2>&1 ||
      { cat "$work/export.log" >&2; exit 1; }
    read -r seconds rss_kb <"$work/time"
    bytes=$(du -sb "$out" | cut -f1)
    "$PYTHON" -c 'import json, sys
f, d, s, rss, b = sys.argv[1:]
print(json.dumps({"bench": "export", "format": f, "dtype": d, "seconds": float(s),
                  "peak_rss_mb": round(int(rss) / 1024), "mb": round(int(b) / 2**20, 1)}))' \
      "$format" "$dtype" "$seconds" "$rss_kb" "$bytes"
  done
done

for from in "$state" "$work/export.safetensors.fp32" "$work/export.hf.fp32" \
  "$work/export.llmc.fp32" "$work/export.hf.bf16"; do
  name=$(basename "$from")
  /usr/bin/time -f "%e %M" -o "$work/time" "$BUILD/trainer" train "$work/wm.toml" \
    --set run.out_dir="\"$work/warm.$name\"" --set init.from="\"$from\"" >"$work/warm.log" 2>&1 ||
    { cat "$work/warm.log" >&2; exit 1; }
  read -r seconds rss_kb <"$work/time"
  "$PYTHON" - "$name" "$seconds" "$rss_kb" "$work/warm.$name/metrics.jsonl" "$work/warm.log" <<'PY'
import json, sys
name, seconds, rss_kb, metrics, log = sys.argv[1:]
steps = [json.loads(l) for l in open(metrics) if '"loss"' in l]
print(json.dumps({"bench": "warm_start", "from": name, "seconds": float(seconds),
                  "peak_rss_mb": round(int(rss_kb) / 1024), "first_step_ms": round(steps[0]["ms"]),
                  "loss": round(steps[0]["loss"], 4)}))
PY
done
