#!/usr/bin/env bash
# The GPU check, in one script, on a machine with an NVIDIA GPU (H100/H200: about 5 minutes):
#   1. builds the trainer with CUDA for this GPU's architecture (build-gpu/),
#   2. runs the gpu-labelled tests (every CUDA kernel against the CPU backend in fp32, bf16 and
#      fp16; the model's loss and gradients; determinism; training with ranks sharing the GPU),
#   3. benchmarks W-S and W-M in fp32 and bf16: tokens/s, MFU against the GPU's peak, peak memory.
#
#   scripts/gpu_check.sh [--skip-build] [--skip-tests]
# Environment: BUILD (build-gpu), CUDA_ARCH (native), WM_BATCH (16), WS_BATCH (32), STEPS (10).
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
export PATH="$PATH:/usr/local/cuda/bin"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
start=$SECONDS

say "GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader ||
  { echo "gpu_check.sh: nvidia-smi found no GPU" >&2; exit 1; }
command -v nvcc >/dev/null || { echo "gpu_check.sh: nvcc not found" >&2; exit 1; }
nvcc --version | tail -n 2

if ((build)); then
  say "build (CUDA architecture ${CUDA_ARCH:-native})"
  cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DTRAINER_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-native}" >/dev/null
  cmake --build "$BUILD" -j"$(nproc)" --target trainer cuda_tests trainer_bench 2>&1 | tail -n 3
  echo "built in $((SECONDS - start)) s"
fi

status=0
if ((tests)); then
  say "gpu-labelled tests"
  ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 300 2>&1 | tail -n 25 || status=1
fi

say "benchmarks (tokens/s, MFU, peak GPU memory)"
STEPS="${STEPS:-10}"
for workload in W-S W-M; do
  batch=$([[ $workload == W-S ]] && echo "${WS_BATCH:-32}" || echo "${WM_BATCH:-16}")
  for dtype in fp32 bf16; do
    if out=$(timeout 180 "$BUILD/bench/trainer_bench" --workload "$workload" --device cuda \
      --dtype "$dtype" --batch "$batch" --warmup 3 --steps "$STEPS"); then
      echo "$out"
      # shellcheck disable=SC2016
      printf '%s\n' "$out" | sed -E 's/.*"workload":"([^"]*)".*"tokens_per_s":([0-9.e+]*).*"ms_per_step":([0-9.e+]*).*"device":"([^"]*)","dtype":"([^"]*)","mfu":([0-9.e+-]*).*"peak_gpu_mb":([0-9.e+]*).*/\1 \5 batch '"$batch"': \2 tokens\/s, \3 ms\/step, MFU \6, peak GPU memory \7 MB on \4/'
    else
      echo "$workload $dtype: trainer_bench failed (exit $?)"
      status=1
    fi
  done
done
say "done in $((SECONDS - start)) s, status $status"
exit "$status"
