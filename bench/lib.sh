# Shared by the benchmark scripts that run the trainer binary on the W-S workload.
# shellcheck shell=bash

# ws_setup ROOT BUILD STEPS: builds the trainer, makes the scratch directory $work (removed on
# exit) and writes the W-S config $work/ws.toml for STEPS steps.
ws_setup() {
  cmake --build "$2" --target trainer -j2 >&2
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  work="$(mktemp -d)"
  # shellcheck disable=SC2064  # the directory is known now
  trap "rm -rf '$work'" EXIT
  ws_config "$work/ws.toml" "$(bench_data "$1" "$2" "$work")" "$3"
}

# gpt2_config FILE DATA_DIR STEPS SEQ_LEN LAYERS WIDTH MICRO_BATCH: a GPT-2-vocabulary model
# (one head per 64 channels) for STEPS steps, without validation or samples.
gpt2_config() {
  cat >"$1" <<CONFIG
[run]
name = "bench"
peak_tflops = 0.2
[model]
vocab_size = 50257
seq_len = $4
n_layer = $5
n_head = $(($6 / 64))
d_model = $6
[data]
train = "$2/train.bin"
val = "$2/val.bin"
[train]
micro_batch = $7
steps = $3
val_every = 0
sample_every = 0
CONFIG
}

# ws_config FILE DATA_DIR STEPS: the W-S workload (6 layers, 6 heads, 384 wide, T 256,
# micro-batches of 4).
ws_config() { gpt2_config "$1" "$2" "$3" 256 6 384 4; }

# wm_config FILE DATA_DIR STEPS: the W-M workload (GPT-2 124M: 12 layers, 12 heads, 768 wide,
# T 1024, micro-batches of 1).
wm_config() { gpt2_config "$1" "$2" "$3" 1024 12 768 1; }

# bench_data ROOT BUILD WORK: prints a directory with train.bin and val.bin (the prepared Austen
# set if there is one, else the excerpt in tests/data).
bench_data() {
  if [[ -f "$1/data/austen/train.bin" ]]; then
    echo "$1/data/austen"
  else
    "$2/trainer" prepare --input "$1/tests/data/pride_and_prejudice_opening.txt" \
      --out-dir "$3/data" >&2
    echo "$3/data"
  fi
}

# summarize NAME RANKS METRICS_JSONL WARMUP: one JSON line with the medians over the steps
# after warm-up.
summarize() {
  "${PYTHON:-/usr/bin/python3}" - "$@" <<'PY'
import json, statistics, sys
name, ranks, path, warmup = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
records = [json.loads(line) for line in open(path)]
steps = [r for r in records if "loss" in r][warmup:]
peak = next((r for r in records if "peak_rss_mb_max" in r), {})
med = lambda key: statistics.median(r[key] for r in steps)
print(json.dumps({"bench": "trainer", "run": name, "ranks": ranks,
                  "step_ms": round(med("ms"), 1), "tokens_per_s": round(med("tokens_per_s")),
                  "comm_exposed_ms": round(med("comm_exposed_ms"), 1),
                  "pipe_wait_ms": round(med("pipe_wait_ms"), 1),
                  "mb_sent_per_step_rank0": round(med("bytes_sent") / 1e6, 1),
                  "final_loss": steps[-1]["loss"] if steps else None,
                  "peak_rss_mb_rank0": peak.get("peak_rss_mb_rank0"),
                  "peak_rss_mb_max": peak.get("peak_rss_mb_max")}))
PY
}
