#!/usr/bin/env bash
# The GPU check, in one script, on a machine with an NVIDIA GPU (H100/H200: about 5 minutes):
#   1. builds the trainer with CUDA for this GPU's architecture (build-gpu/),
#   2. runs the gpu-labelled tests (every CUDA kernel against the CPU backend in fp32, bf16 and
#      fp16; the model's loss and gradients; determinism; training with ranks sharing the GPU),
#   3. benchmarks W-S and W-M in fp32 and bf16: tokens/s, MFU against the GPU's peak, peak memory.
#
#   scripts/gpu_check.sh [--skip-build] [--skip-tests]
# Environment: BUILD (build-gpu), CUDA_ARCH (native), WM_BATCH (16), WS_BATCH (32), STEPS (10),
# NCCL_ROOT (found beside the toolkit, else pip's nvidia-nccl package, else built without NCCL).
# Full logs go to $OUT/gpu_check (the device tool's output folder) or $BUILD/gpu_check; what is
# printed is their summary: failures in full, the rest in brief.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD:-$ROOT/build-gpu}"
build=1 tests=1
for arg in "$@"; do
  case "$arg" in
    --skip-build) build=0 ;;
    --skip-tests) tests=0 ;;
    -h | --help) sed -n '2,9s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done

say() { printf '\n== %s\n' "$*"; }
LOGS="${OUT:-$BUILD}/gpu_check"
mkdir -p "$LOGS"
# Prints a failed step's log: its error lines, then its end.
show_failure() {
  grep -E -i "error|failure|failed|expected|which is|element|not found" "$1" | head -n 80 || true
  echo "-- last lines of $1:"
  tail -n 30 "$1"
}
export PATH="$PATH:/usr/local/cuda/bin"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
start=$SECONDS

say "GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv,noheader ||
  { echo "gpu_check.sh: nvidia-smi found no GPU" >&2; exit 1; }
command -v nvcc >/dev/null || { echo "gpu_check.sh: nvcc not found" >&2; exit 1; }
nvcc --version | tail -n 2

if ((build)); then
  say "build (CUDA architecture ${CUDA_ARCH:-native})"
  nccl=()
  if [[ -n "${NCCL_ROOT:-}" ]]; then
    nccl=(-DNCCL_ROOT="$NCCL_ROOT")
  elif ! ls /usr/local/cuda/lib*/libnccl.so* /usr/lib/x86_64-linux-gnu/libnccl.so* >/dev/null 2>&1; then
    # pip's nvidia-nccl-cu13 (as in PyTorch images): headers and libnccl.so.2 under site-packages.
    pip_nccl=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)
    if [[ -n "$pip_nccl" && -f "$pip_nccl/lib/libnccl.so.2" ]]; then
      nccl=(-DNCCL_INCLUDE_DIR="$pip_nccl/include" -DNCCL_LIBRARY="$pip_nccl/lib/libnccl.so.2")
      export LD_LIBRARY_PATH="$pip_nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      echo "NCCL from $pip_nccl"
    fi
  fi
  if ! cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DTRAINER_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-native}" "${nccl[@]}" >"$LOGS/configure.log" 2>&1; then
    echo "gpu_check.sh: configure failed (a missing library is named below)"
    show_failure "$LOGS/configure.log"
    exit 1
  fi
  grep -A2 "CMake Warning" "$LOGS/configure.log" || true
  if ! cmake --build "$BUILD" -j"$(nproc)" --target trainer cuda_tests trainer_bench \
    >"$LOGS/build.log" 2>&1; then
    echo "gpu_check.sh: build failed"
    show_failure "$LOGS/build.log"
    exit 1
  fi
  "$BUILD/trainer" --version || true
  echo "built in $((SECONDS - start)) s"
fi

status=0
if ((tests)); then
  say "gpu-labelled tests"
  if ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 300 >"$LOGS/ctest.log" 2>&1
  then
    grep -E "tests passed|Total Test time" "$LOGS/ctest.log" || true
  else
    status=1
    show_failure "$LOGS/ctest.log"
  fi
fi

say "benchmarks (tokens/s, MFU, peak GPU memory)"
STEPS="${STEPS:-10}"
for workload in W-S W-M; do
  batch=$([[ $workload == W-S ]] && echo "${WS_BATCH:-32}" || echo "${WM_BATCH:-16}")
  for dtype in fp32 bf16; do
    log="$LOGS/bench_${workload}_${dtype}.log"
    if out=$(timeout 180 "$BUILD/bench/trainer_bench" --workload "$workload" --device cuda \
      --dtype "$dtype" --batch "$batch" --warmup 3 --steps "$STEPS" 2>"$log"); then
      echo "$out"
      # shellcheck disable=SC2016
      printf '%s\n' "$out" | sed -E 's/.*"workload":"([^"]*)".*"tokens_per_s":([0-9.e+]*).*"ms_per_step":([0-9.e+]*).*"device":"([^"]*)","dtype":"([^"]*)","mfu":([0-9.e+-]*).*"peak_gpu_mb":([0-9.e+]*).*/\1 \5 batch '"$batch"': \2 tokens\/s, \3 ms\/step, MFU \6, peak GPU memory \7 MB on \4/'
    else
      echo "$workload $dtype: trainer_bench failed (exit $?)"
      echo "$out"
      tail -n 20 "$log"
      status=1
    fi
  done
done
say "done in $((SECONDS - start)) s, status $status"
exit "$status"
