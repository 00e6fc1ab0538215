#!/usr/bin/env bash
# The GPU check, in one script, within 8 minutes on an H100/H200:
#   1. the binaries: built here (build-gpu/; needs this project's Debian dependencies), or
#      unpacked from a bundle made by scripts/gpu_bundle.sh on a Debian machine (--bundle DIR:
#      for a bare GPU machine that has only the CUDA toolkit and pip's NCCL),
#   2. `trainer --version` and a 2-rank CPU training run under mpirun (the bundle's own mpirun),
#   3. the GPU tests (every CUDA kernel against the CPU backend in fp32, bf16 and fp16; the model's
#      loss and gradients; determinism; training with ranks sharing the GPU),
#   4. benchmarks W-S and W-M in fp32 and bf16: tokens/s, MFU against the data-sheet peak, peak
#      GPU memory.
#
#   scripts/gpu_check.sh [--skip-build] [--skip-tests]
#   scripts/gpu_check.sh --bundle DIR [--no-gpu] [--skip-tests]
#
# --no-gpu checks a bundle on a machine without a GPU: steps 1-3, where the GPU tests skip.
# Environment: OUT (logs go to $OUT/gpu_check, else to build-gpu/gpu_check or beside the unpacked
# bundle), CHECK_SECONDS (450: every step's timeout is cut to what is left of it), BUILD
# (build-gpu), CUDA_ARCH (native), NCCL_ROOT, WM_BATCH (16), WS_BATCH (32), STEPS (10).
# What is printed is a summary: failures in full, the rest in brief; summary.txt repeats it.
# Exit: 0 all passed, 1 a step failed, 2 bad arguments or a machine that cannot run the bundle.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD:-$ROOT/build-gpu}"
build=1 tests=1 gpu=1 bundle=""
while (($#)); do
  case "$1" in
    --skip-build) build=0 ;;
    --skip-tests) tests=0 ;;
    --no-gpu) gpu=0 ;;
    --bundle)
      (($# >= 2)) || { echo "gpu_check.sh: --bundle needs a directory" >&2; exit 2; }
      bundle="$2"
      shift
      ;;
    -h | --help) sed -n '2,21s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [[ -z $bundle ]] && ((!gpu)); then
  echo "gpu_check.sh: --no-gpu checks a bundle: use it with --bundle DIR" >&2
  exit 2
fi

start=$SECONDS
deadline=$((start + ${CHECK_SECONDS:-450}))
say() { printf '\n== %s\n' "$*"; }
unusable() { echo "gpu_check.sh: $*" >&2; exit 2; }
summary=()
note() { summary+=("$*"); echo "$*"; }
status=0
# A step's timeout: its own limit, or what is left of the whole check if that is less.
limit() {
  local left=$((deadline - SECONDS))
  echo $((left < $1 ? (left > 1 ? left : 1) : $1))
}

# ---------------------------------------------------------------------------------------------
# 1. The binaries.
if [[ -n $bundle ]]; then
  [[ -d $bundle ]] ||
    unusable "--bundle $bundle: no such directory (make one with scripts/gpu_bundle.sh and carry .gpu-bundle/)"
  bundle="$(cd "$bundle" && pwd)"
  [[ -f $bundle/MANIFEST ]] ||
    unusable "--bundle $bundle: no MANIFEST there: not a bundle made by scripts/gpu_bundle.sh"
  manifest() { sed -n "s/^$1=//p" "$bundle/MANIFEST"; }
  archive="$bundle/$(manifest archive)"
  [[ -f $archive ]] || unusable "--bundle $bundle: $(manifest archive) is missing"

  # The machine first, before anything is unpacked: C library, CPU, room, CUDA libraries.
  need=$(manifest glibc_min)
  have=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}') || true
  [[ -n $have ]] ||
    unusable "this machine has no GNU C library (getconf GNU_LIBC_VERSION); the bundle needs glibc $need or newer"
  [[ $(printf '%s\n%s\n' "$need" "$have" | sort -V | head -n 1) == "$need" ]] ||
    unusable "this machine's C library is glibc $have; the bundle needs glibc $need or newer$(built_on=$(manifest built_on); echo "${built_on:+ (built on $built_on)}"): make it on an older Debian, or build here"
  lacking=()
  for flag in $(manifest cpu_flags); do grep -qw "$flag" /proc/cpuinfo || lacking+=("$flag"); done
  ((${#lacking[@]} == 0)) ||
    unusable "this CPU lacks ${lacking[*]} (the bundle's host code is built for x86-64-v3)"
  tmp="${TMPDIR:-/tmp}"
  room_kb=$(df -Pk "$tmp" | awk 'NR == 2 {print $4}')
  ((room_kb > $(manifest unpacked_kb) + 102400)) ||
    unusable "$tmp has $((room_kb / 1024)) MB free; the bundle unpacks to $(($(manifest unpacked_kb) / 1024)) MB (set TMPDIR)"

  python_sites() {
    local py
    for py in python3 /opt/*/.venv/bin/python3; do
      if command -v "$py" >/dev/null 2>&1; then
        "$py" -c 'import site; print("\n".join(site.getsitepackages()))' 2>/dev/null || true
      fi
    done
    ls -d /usr/local/lib/python3*/dist-packages /usr/lib/python3/dist-packages 2>/dev/null || true
  }
  # Where a CUDA library is: LD_LIBRARY_PATH, the loader's cache, the CUDA toolkit, pip's
  # nvidia-* packages (nvidia/<name>/lib, or nvidia/cu13/lib for CUDA 13).
  find_machine_lib() {
    local name="$1" dir sub site file
    local IFS=:
    for dir in ${LD_LIBRARY_PATH:-}; do [[ -e $dir/$name ]] && { echo "$dir"; return 0; }; done
    IFS=$' \t\n'
    file=$(ldconfig -p 2>/dev/null | awk -v n="$name" '$1 == n {print $NF; exit}')
    [[ -n $file ]] && { dirname "$file"; return 0; }
    # (and the driver's: /usr/local/nvidia where containers mount it)
    for dir in ${CUDA_HOME:-} ${CUDA_PATH:-} /usr/local/cuda /usr/local/cuda-* /usr/local/nvidia; do
      for sub in lib64 lib targets/x86_64-linux/lib; do
        [[ -e $dir/$sub/$name ]] && { echo "$dir/$sub"; return 0; }
      done
    done
    while read -r site; do
      for file in "$site"/nvidia/*/lib/"$name"; do
        [[ -e $file ]] && { dirname "$file"; return 0; }
      done
    done < <(python_sites)
    return 1
  }
  machine_dirs=""
  # The driver (libcuda.so.1), which cudart loads at run time, where a GPU is expected.
  driver=()
  ((gpu)) && driver=(libcuda.so.1)
  for lib in $(manifest machine_libs) "${driver[@]}"; do
    dir=$(find_machine_lib "$lib") ||
      unusable "$lib not found (looked in LD_LIBRARY_PATH, ldconfig, /usr/local/cuda*, pip's nvidia packages): add its folder to LD_LIBRARY_PATH"
    echo "$lib: $dir"
    [[ ":$machine_dirs:" == *":$dir:"* ]] || machine_dirs="${machine_dirs:+$machine_dirs:}$dir"
  done

  say "unpacking $(basename "$archive") ($(manifest built_from), built $(manifest built_at))"
  unpacked=$(mktemp -d "$tmp/trainer-gpu.XXXXXX")
  zstd_cmd=(zstd)
  command -v zstd >/dev/null || zstd_cmd=(env LD_LIBRARY_PATH="$bundle/zstd/lib" "$bundle/zstd/zstd")
  timeout "$(limit 120)" "${zstd_cmd[@]}" -q -d -c --long=27 "$archive" | tar -C "$unpacked" -xf - ||
    unusable "could not unpack $archive into $unpacked"
  B="$unpacked/trainer-gpu"
  trap 'rm -rf "$B"; rmdir "$unpacked" 2>/dev/null || true' EXIT # the logs stay
  LOGS="${OUT:+$OUT/gpu_check}"
  LOGS="${LOGS:-$unpacked/logs}"
  mkdir -p "$LOGS"
  # Our binaries run with the bundle's libraries; the machine's own tools (grep, awk, nvidia-smi)
  # keep theirs, so the bundle's environment is only ever set in a subshell.
  ours() (
    export LD_LIBRARY_PATH="$machine_dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    # shellcheck source=/dev/null
    source "$B/env.sh"
    "$@"
  )
  if ours ldd -r "$B/bin/trainer" "$B/bin/cuda_tests" "$B/bin/trainer_bench" 2>&1 |
    grep -E "not found|undefined symbol"; then
    unusable "the bundle's binaries do not load here (above: a library or a symbol is missing)"
  fi
  TRAINER="$B/bin/trainer" CUDA_TESTS="$B/bin/cuda_tests" BENCH="$B/bin/trainer_bench"
  MPIRUN="$B/mpi/bin/mpirun" DATA="$B/src/tests/data"
  echo "unpacked with ${zstd_cmd[*]: -1} into $unpacked in $((SECONDS - start)) s"
else
  LOGS="${OUT:+$OUT/gpu_check}"
  LOGS="${LOGS:-$BUILD/gpu_check}"
  mkdir -p "$LOGS"
  ours() { "$@"; }
  export PATH="$PATH:/usr/local/cuda/bin"
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  if ((build)); then
    command -v nvcc >/dev/null || unusable "nvcc not found"
    say "build (CUDA architecture ${CUDA_ARCH:-native})"
    nccl=()
    if [[ -n ${NCCL_ROOT:-} ]]; then
      nccl=(-DNCCL_ROOT="$NCCL_ROOT")
    elif ! ls /usr/local/cuda/lib*/libnccl.so* /usr/lib/x86_64-linux-gnu/libnccl.so* >/dev/null 2>&1; then
      # pip's nvidia-nccl-cu13 (as in PyTorch images): headers and libnccl.so.2 under site-packages.
      pip_nccl=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)
      if [[ -n $pip_nccl && -f $pip_nccl/lib/libnccl.so.2 ]]; then
        nccl=(-DNCCL_INCLUDE_DIR="$pip_nccl/include" -DNCCL_LIBRARY="$pip_nccl/lib/libnccl.so.2")
        export LD_LIBRARY_PATH="$pip_nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        echo "NCCL from $pip_nccl"
      fi
    fi
    if ! cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DTRAINER_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-native}" "${nccl[@]}" >"$LOGS/configure.log" 2>&1; then
      grep -E -i -B2 -A4 "error|not found|missing" "$LOGS/configure.log" | head -n 60 || true
      echo "gpu_check.sh: configure failed (above; $LOGS/configure.log). A bare GPU machine lacks" \
        "this project's libraries: make a bundle with scripts/gpu_bundle.sh and use --bundle"
      exit 1
    fi
    grep -A2 "CMake Warning" "$LOGS/configure.log" || true
    if ! cmake --build "$BUILD" -j"$(nproc)" --target trainer cuda_tests trainer_bench \
      >"$LOGS/build.log" 2>&1; then
      grep -E -i -A3 "error" "$LOGS/build.log" | head -n 80 || true
      echo "gpu_check.sh: build failed ($LOGS/build.log)"
      exit 1
    fi
    echo "built in $((SECONDS - start)) s"
  fi
  TRAINER="$BUILD/trainer" CUDA_TESTS="$BUILD/tests/cuda_tests" BENCH="$BUILD/bench/trainer_bench"
  MPIRUN="$(command -v mpirun || echo mpirun)" DATA="$ROOT/tests/data"
fi

if ((gpu)); then
  say "GPU"
  PATH="$PATH:/usr/local/nvidia/bin"
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv,noheader ||
    note "nvidia-smi did not answer (the tests and benchmarks below say whether CUDA sees a GPU)"
fi

# ---------------------------------------------------------------------------------------------
# 2. The trainer runs: its version, and 2 ranks training on the CPU under mpirun.
say "trainer"
if version=$(ours timeout "$(limit 30)" "$TRAINER" --version 2>&1); then
  note "$version"
else
  note "trainer --version failed: $version"
  exit 1
fi
smoke="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_smoke.XXXXXX")"
cat >"$smoke/run.toml" <<EOF
[run]
out_dir = "$smoke/out"
threads = 1
peak_tflops = 1.0
[model]
seq_len = 32
n_layer = 2
n_head = 2
d_model = 32
[data]
train = "$smoke/data/train.bin"
val = "$smoke/data/val.bin"
[train]
micro_batch = 4
steps = 20
val_every = 10
sample_every = 0
EOF
t0=$SECONDS
if ours timeout "$(limit 30)" "$TRAINER" prepare --input "$DATA/pride_and_prejudice_opening.txt" \
  --out-dir "$smoke/data" >"$LOGS/smoke.log" 2>&1 &&
  ours timeout "$(limit 120)" "$MPIRUN" -q --allow-run-as-root --oversubscribe -np 2 \
    "$TRAINER" train "$smoke/run.toml" >>"$LOGS/smoke.log" 2>&1 &&
  losses=$(grep -o '"loss":[-0-9.eE+]*' "$smoke/out/metrics.jsonl" | sed 's/.*://') &&
  [[ $(wc -l <<<"$losses") == 20 ]]; then
  note "2-rank CPU training under $MPIRUN: 20 steps," \
    "$(printf 'loss %.3f -> %.3f' "$(head -n 1 <<<"$losses")" "$(tail -n 1 <<<"$losses")") in $((SECONDS - t0)) s"
else
  note "2-rank CPU training under mpirun FAILED:"
  tail -n 30 "$LOGS/smoke.log"
  status=1
fi
rm -rf "$smoke"

# ---------------------------------------------------------------------------------------------
# 3. The GPU tests, run directly (one process, one timeout) and summarised from gtest's output.
if ((tests)); then
  say "GPU tests"
  rc=0
  ours timeout -k 5 "$(limit 300)" "$CUDA_TESTS" --gtest_color=no >"$LOGS/tests.log" 2>&1 || rc=$?
  # Ranks a killed test started run in their own process groups: none may hold the GPU now.
  if command -v pkill >/dev/null; then pkill -KILL -f "^$TRAINER " || true; fi
  count() { grep -cE "^\[ *$1 *\] .*\([0-9]+ ms\)$" "$LOGS/tests.log" || true; }
  passed=$(count OK) failed=$(count FAILED) skipped=$(count SKIPPED)
  note "GPU tests: $passed passed, $failed failed, $skipped skipped (exit $rc)"
  if ((gpu && (passed == 0 || skipped > 0))); then
    note "GPU tests skipped: CUDA saw no GPU ($(grep -m 1 -o 'no CUDA device visible[^"]*' "$LOGS/tests.log" || echo 'see tests.log'))"
    status=1
  fi
  # Each failing test's output in full, from its RUN line to its FAILED line.
  { grep -E "^\[  FAILED  \] .*\([0-9]+ ms\)$" "$LOGS/tests.log" || true; } |
    sed -E 's/^\[  FAILED  \] ([^ ,]*).*/\1/' | while read -r name; do
      awk -v n="$name" '$0 == "[ RUN      ] " n {on = 1} on && ++lines <= 200 {print}
        on && index($0, "[  FAILED  ] " n) == 1 {exit}' "$LOGS/tests.log"
    done
  if ((rc != 0)); then
    status=1
    if ((rc == 124)); then
      note "GPU tests timed out in $(grep '^\[ RUN' "$LOGS/tests.log" | tail -n 1 | cut -c 14-)"
    elif ((failed == 0)); then
      note "GPU tests ended with exit $rc in $(grep '^\[ RUN' "$LOGS/tests.log" | tail -n 1 | cut -c 14-):"
      tail -n 30 "$LOGS/tests.log"
    fi
  fi
fi

# ---------------------------------------------------------------------------------------------
# 4. Benchmarks.
if ((gpu)); then
  say "benchmarks (tokens/s, MFU, peak GPU memory)"
  for workload in W-S W-M; do
    batch=$([[ $workload == W-S ]] && echo "${WS_BATCH:-32}" || echo "${WM_BATCH:-16}")
    for dtype in fp32 bf16; do
      if ((deadline - SECONDS < 10)); then
        note "$workload $dtype: skipped, out of time"
        status=1
        continue
      fi
      echo "-- $workload $dtype batch $batch" >>"$LOGS/bench.log"
      if out=$(ours timeout "$(limit 120)" "$BENCH" --workload "$workload" --device cuda \
        --dtype "$dtype" --batch "$batch" --warmup 3 --steps "${STEPS:-10}" 2>>"$LOGS/bench.log"); then
        echo "$out" >>"$LOGS/bench.log"
        # A field's value: a quoted string whole (the device's name has commas), else a number.
        field() { sed -E -e "s/.*\"$1\":\"([^\"]*)\".*/\1/;t" -e "s/.*\"$1\":([^,}]*).*/\1/" <<<"$out"; }
        note "$(printf '%s %s batch %s: %.0f tokens/s, %.1f ms/step, MFU %.3f, peak GPU memory %.0f MB on %s' \
          "$workload" "$dtype" "$batch" "$(field tokens_per_s)" "$(field ms_per_step)" \
          "$(field mfu)" "$(field peak_gpu_mb)" "$(field device)")"
      else
        note "$workload $dtype: trainer_bench failed (exit $?)"
        tail -n 20 "$LOGS/bench.log"
        status=1
      fi
    done
  done
fi

say "summary (done in $((SECONDS - start)) s, status $status; logs in $LOGS)"
printf '%s\n' "${summary[@]}" | tee "$LOGS/summary.txt"
exit "$status"
