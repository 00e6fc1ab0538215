#!/usr/bin/env bash
# The data pipeline: `prepare` throughput with GPT-2 BPE against the npm tiktoken package (the
# original's WASM build) on the same text in the same run, and the loader's wait as a share of
# the W-S step with plain shards and with a three-source blend.
#
#   bench/data.sh [--steps N] [--mb M]
#
# The text is the six Austen novels (scripts/prepare_default_data.sh), repeated to M megabytes
# (default 20). Prints JSON lines:
#   {"bench": "prepare", "threads": 1|2, "mb_per_s", "cpu_s", "peak_rss_mb", ...}: trainer
#     prepare with GPT-2 BPE (wall-clock MB/s of text, CPU seconds, peak memory);
#   {"bench": "tiktoken", "mb_per_s", ...}: the npm tiktoken encoder on the same text, one
#     thread (the encode alone, file read and module load excluded), and that its tokens equal
#     ours ("same_tokens");
#   {"bench": "zstd_shard", ...}: the Austen train shard's size plain and zstd-compressed;
#   {"bench": "loader", "run": "plain"|"zstd_first"|"zstd_cached"|"blend3", "data_share",
#     "data_ms", "step_ms", "startup_s", ...}: N steps (default 8) of W-S after one warm-up, the
#     median share of each step spent waiting for data (target < 2%), and the time from start to
#     the first step (zstd_first decompresses into the cache, zstd_cached maps from it).
# Needs the GPT-2 tokenizer files and the npm package (scripts/fetch_tokenizers.sh).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD:-$ROOT/build}"
PYTHON="${PYTHON:-/usr/bin/python3}"
CACHE="${TRAINER_TOKENIZERS:-$HOME/.cache/trainer/tokenizers}"
steps=8
mb=20
while (($#)); do
  case "$1" in
    --steps) steps="$2"; shift ;;
    --mb) mb="$2"; shift ;;
    -h | --help) sed -n '2,20s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "data.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
[[ -f "$CACHE/gpt2/encoder.json" && -d "$CACHE/npm/tiktoken" ]] || {
  echo "data.sh: no GPT-2 tokenizer files in $CACHE: run scripts/fetch_tokenizers.sh" >&2
  exit 2
}
[[ -d "$ROOT/data/austen/text" ]] || {
  echo "data.sh: no Austen text in data/austen/text: run scripts/prepare_default_data.sh" >&2
  exit 2
}

# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
ws_setup "$ROOT" "$BUILD" "$((steps + 1))"

# The corpus: the novels, repeated to $mb MB, as one file (one document per novel copy).
corpus="$work/corpus.txt"
while (($(stat -c %s "$corpus" 2>/dev/null || echo 0) < mb * 1000000)); do
  cat "$ROOT"/data/austen/text/*.txt >>"$corpus"
done
size=$(stat -c %s "$corpus")

for threads in 1 2; do
  /usr/bin/time -f "%e %U %S %M" -o "$work/time" "$BUILD/trainer" prepare --input "$corpus" \
    --out-dir "$work/prep$threads" --tokenizer gpt2 --tokenizer-path "$CACHE/gpt2" \
    --threads "$threads" >"$work/prep$threads.log" 2>&1
  read -r wall user sys _ <"$work/time"
  # prepare's own peak (VmHWM): time's maxrss also counts the image before OpenBLAS's re-exec.
  rss=$(grep -o 'peak memory [0-9]* MB' "$work/prep$threads.log" | grep -o '[0-9]*')
  "$PYTHON" -c 'import json, sys
size, threads, wall, user, sys_, rss = sys.argv[1:]
size, wall, cpu = int(size), float(wall), float(user) + float(sys_)
print(json.dumps({"bench": "prepare", "tokenizer": "gpt2", "threads": int(threads),
                  "mb": round(size / 1e6, 1), "wall_s": wall, "mb_per_s": round(size / 1e6 / wall, 1),
                  "cpu_s": round(cpu, 2), "mb_per_cpu_s": round(size / 1e6 / cpu, 1),
                  "peak_rss_mb": int(rss)}))' "$size" "$threads" "$wall" "$user" "$sys" "$rss"
done

# The reference: npm tiktoken's GPT-2 encoder on the same text, timed around the encode alone;
# its tokens against ours (prepare's train + val shards hold every document's tokens, each
# document followed by <|endoftext|>: one document here).
node - "$CACHE" "$corpus" "$work/tiktoken.ids" <<'JS'
const fs = require("fs");
const [cache, file, out] = process.argv.slice(2);
const { get_encoding } = require(`${cache}/npm/tiktoken/tiktoken.cjs`);
const enc = get_encoding("gpt2");
const text = fs.readFileSync(file, "utf8");
const t0 = process.hrtime.bigint();
const ids = enc.encode_ordinary(text);
const s = Number(process.hrtime.bigint() - t0) / 1e9;
fs.writeFileSync(out, Buffer.from(new Uint32Array(ids).buffer));
console.log(JSON.stringify({bench: "tiktoken", encoder: "npm tiktoken (WASM) gpt2", threads: 1,
  mb: +(Buffer.byteLength(text) / 1e6).toFixed(1), encode_s: +s.toFixed(2),
  mb_per_s: +(Buffer.byteLength(text) / 1e6 / s).toFixed(1)}));
JS
"$PYTHON" - "$work/tiktoken.ids" "$work/prep1" <<'PY'
import glob, json, numpy as np, sys
ref = np.fromfile(sys.argv[1], dtype=np.uint32)
def tokens(path):
    raw = open(path, "rb").read()
    width, count = int.from_bytes(raw[12:16], "little"), int.from_bytes(raw[16:24], "little")
    return np.frombuffer(raw[64:64 + width * count], dtype=np.uint16 if width == 2 else np.uint32)
ours = np.concatenate([tokens(p) for p in sorted(glob.glob(sys.argv[2] + "/*.bin"))])
ours = ours[ours != 50256]  # the end-of-text token prepare appends to the document
# One document: train holds its first part and val its last (the small-corpus split), in order.
print(json.dumps({"bench": "tiktoken_parity", "tokens": int(ref.size),
                  "same_tokens": bool(ours.size == ref.size and (ours == ref).all())}))
PY

# The loader on W-S: plain shards, then a blend of three sources (the same shard three times,
# each through its own order).
train="$(bench_data "$ROOT" "$BUILD" "$work")/train.bin"
loader_run() {
  local name="$1"
  shift
  local t0
  t0=$(date +%s.%N)
  "$BUILD/trainer" train "$work/ws.toml" --set run.out_dir="$work/$name" "$@" \
    >"$work/$name.log" 2>&1 || { cat "$work/$name.log" >&2; exit 1; }
  "$PYTHON" - "$name" "$work/$name/metrics.jsonl" "$t0" <<'PY'
import json, statistics, sys
records = list(map(json.loads, open(sys.argv[2])))
steps = [r for r in records if "loss" in r]
# The first step ended at its "time" after taking "ms": the start-up is what came before.
startup = steps[0]["time"] - steps[0]["ms"] / 1e3 - float(sys.argv[3])
steps = steps[1:]
med = lambda f: statistics.median(f(r) for r in steps)
print(json.dumps({"bench": "loader", "run": sys.argv[1], "steps": len(steps),
                  "data_share": round(med(lambda r: r["data_ms"] / r["ms"]), 5),
                  "data_ms": round(med(lambda r: r["data_ms"]), 3),
                  "step_ms": round(med(lambda r: r["ms"]), 1),
                  "tokens_per_s": round(med(lambda r: r["tokens_per_s"])),
                  "startup_s": round(startup, 2)}))
PY
}
loader_run plain
# zstd shards of the same data through a cache directory: the first run decompresses them, the
# second maps them from the cache.
zdir="$work/zdata"
"$BUILD/trainer" prepare --input "$ROOT"/data/austen/text/*.txt --out-dir "$zdir" \
  --val-fraction 0.05 --compress >"$work/zprep.log" 2>&1 || { cat "$work/zprep.log" >&2; exit 1; }
"$PYTHON" -c 'import json, os, sys
plain, z = os.path.getsize(sys.argv[1]), os.path.getsize(sys.argv[2])
print(json.dumps({"bench": "zstd_shard", "plain_mb": round(plain / 1e6, 1),
                  "zstd_mb": round(z / 1e6, 1), "ratio": round(plain / z, 2)}))' \
  "$train" "$zdir/train.bin.zst"
for name in zstd_first zstd_cached; do
  loader_run "$name" --set data.train="\"$zdir/train.bin.zst\"" \
    --set data.cache_dir="\"$work/cache\""
done
sed -i '/^train = /d' "$work/ws.toml"
for w in 0.5 0.3 0.2; do
  printf '[[data.sources]]\npath = "%s"\nweight = %s\n' "$train" "$w" >>"$work/ws.toml"
done
loader_run blend3
