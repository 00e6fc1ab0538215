#!/usr/bin/env bash
# The GPU bundle (scripts/gpu_bundle.sh, scripts/gpu_check.sh --bundle), proved without a GPU:
#   1. gpu_check.sh --bundle refuses, in one line with exit 2, a missing or foreign directory, a
#      missing archive, a C library older than the bundle needs and a CPU without its features;
#   2. the bundle is made and stays under 48 MB; gpu_bundle.sh refuses one over its size limit and
#      one whose closure lacks a library;
#   3. in a chroot of a minimal Debian 12 made by debootstrap (cached between runs), holding only
#      the bundle and the CUDA toolkit's libraries (as the GPU machine has them), gpu_check.sh
#      --bundle --no-gpu unpacks it, runs trainer --version, the GPU test executable (its tests
#      skip without a GPU, but for the one that loads cuBLASLt, which the machine brings) and 2
#      ranks training on the CPU under the bundle's own mpirun. Nothing
#      of this machine's installed packages is visible there, so nothing can silently come from it.
#
#   tests/test_gpu_bundle.sh SOURCE_DIR WORK_DIR
# Exit 77 (skipped, as CTest reports it) only where the tools are missing: nvcc, debootstrap, or
# the root rights that chroot and mount need. TRAINER_ROOTFS_CACHE names the rootfs cache
# (default ~/.cache/trainer/debian12-minbase.tar).
set -euo pipefail

SRC="$(cd "$1" && pwd)"
mkdir -p "$2"
WORK="$(cd "$2" && pwd)"
CHECK="$SRC/scripts/gpu_check.sh"
MAKE="$SRC/scripts/gpu_bundle.sh"
failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}
skip() {
  echo "SKIPPED: $*"
  exit 77
}
# expect NAME CODE PATTERN -- COMMAND...: the command exits CODE and its last line, the only one
# unless it is gpu_bundle.sh (which reports progress first), matches PATTERN.
expect() {
  local name="$1" code="$2" pattern="$3" out rc=0 lines=1
  shift 4
  [[ $* == *gpu_bundle.sh* ]] && lines=1000
  out=$("$@" 2>&1) || rc=$?
  if ((rc != code)) || ! tail -n 1 <<<"$out" | grep -qE -- "$pattern" ||
    (($(wc -l <<<"$out") > lines)); then
    fail "$name: expected exit $code and a last line matching '$pattern', got exit $rc:"
    printf '%s\n' "$out" | head -n 20
  else
    echo "ok: $name: $(tail -n 1 <<<"$out")"
  fi
}

echo "== 1. gpu_check.sh --bundle: arguments and machine checks"
fake="$WORK/fake"
rm -rf "$fake" && mkdir -p "$fake/empty" "$fake/bundle"
expect "no directory" 2 "needs a directory" -- bash "$CHECK" --bundle
expect "missing bundle" 2 "no such directory" -- bash "$CHECK" --bundle "$fake/none"
expect "not a bundle" 2 "no MANIFEST there" -- bash "$CHECK" --bundle "$fake/empty"
expect "--no-gpu alone" 2 "use it with --bundle" -- bash "$CHECK" --no-gpu
manifest() { # glibc_min cpu_flags
  printf 'archive=trainer-gpu.tar.zst\nunpacked_kb=1000\nglibc_min=%s\ncpu_flags=%s\n' "$1" "$2" \
    >"$fake/bundle/MANIFEST"
}
manifest 2.17 "avx"
expect "missing archive" 2 "trainer-gpu.tar.zst is missing" -- bash "$CHECK" --bundle "$fake/bundle"
touch "$fake/bundle/trainer-gpu.tar.zst"
have=$(getconf GNU_LIBC_VERSION | awk '{print $2}')
manifest 2.99 "avx"
expect "old C library" 2 "C library is glibc $have; the bundle needs glibc 2.99 or newer" -- \
  bash "$CHECK" --bundle "$fake/bundle"
manifest 2.17 "avx no_such_feature"
expect "CPU features" 2 "this CPU lacks no_such_feature" -- bash "$CHECK" --bundle "$fake/bundle"

echo "== 2. making the bundle"
export PATH="$PATH:/usr/local/cuda/bin"
command -v nvcc >/dev/null || skip "nvcc not found: the GPU bundle needs the CUDA toolkit to build"
bundle="$WORK/bundle"
if ! bash "$MAKE" --build-dir "$WORK/build" --out "$bundle"; then
  fail "gpu_bundle.sh failed"
  exit 1
fi
size_kb=$(du -sk "$bundle" | cut -f1)
((size_kb < 48 * 1024)) || fail "the bundle is $((size_kb / 1024)) MB, over 48"
echo "bundle: $((size_kb / 1024)) MB"
# (zstd's fastest level: the refusal is the same code, and level 19 costs a minute here)
expect "size limit" 1 "over the limit of 1 MB: refusing" -- \
  bash "$MAKE" --skip-build --build-dir "$WORK/build" --out "$WORK/small" --max-mb 1 --level 1
[[ ! -e $WORK/small/trainer-gpu.tar.zst ]] || fail "a refused bundle was left in $WORK/small"
# A binary whose library is gone: the closure cannot be complete.
extra="$WORK/extra"
rm -rf "$extra" && mkdir -p "$extra"
echo 'int extra(void) { return 7; }' >"$extra/extra.c"
echo 'int extra(void); int main(void) { return extra(); }' >"$extra/main.c"
gcc -shared -fPIC -Wl,-soname,libextra.so.1 -o "$extra/libextra.so.1" "$extra/extra.c"
gcc -o "$extra/needs_extra" "$extra/main.c" "$extra/libextra.so.1"
rm "$extra/libextra.so.1"
expect "missing library" 1 "libextra.so.1 \(needed by trainer-gpu/bin/needs_extra\)" -- \
  bash "$MAKE" --skip-build --build-dir "$WORK/build" --out "$WORK/bad" --add "$extra/needs_extra"

echo "== 3. the bundle alone in a bare Debian 12"
((failures == 0)) || { echo "$failures check(s) failed"; exit 1; }
(($(id -u) == 0)) || skip "not root: chroot and mount need root"
command -v debootstrap >/dev/null || skip "debootstrap not found (apt-get install debootstrap)"
root="$WORK/root"
# Unmounts whatever is mounted below the root (also what a killed earlier run left), then
# removes it, never while anything is still mounted there (the CUDA toolkit is bound in).
mounted_below() { findmnt -l -n -o TARGET | awk -v r="$root/" 'index($0, r) == 1' | sort -r; }
cleanup() {
  local m
  [[ -d $root ]] || return 0
  for m in $(mounted_below); do umount -l "$m" || true; done
  if [[ -n $(mounted_below) ]]; then
    echo "FAIL: still mounted below $root (not removed): $(mounted_below | tr '\n' ' ')"
    return 1
  fi
  rm -rf --one-file-system "$root"
}
trap 'cleanup || exit 1' EXIT
mkdir -p "$WORK/probe"
umount -l "$WORK/probe" 2>/dev/null || true
mount -t tmpfs none "$WORK/probe" 2>/dev/null || skip "cannot mount here (a container without CAP_SYS_ADMIN)"
umount "$WORK/probe"
cleanup

cache="${TRAINER_ROOTFS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/trainer/debian12-minbase.tar}"
if [[ ! -f $cache ]]; then
  # The mirror this machine's apt uses for bookworm.
  # shellcheck disable=SC2016 # apt's own $(FIELD) syntax
  mirror=$(apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 2>/dev/null |
    awk '$2 == "bookworm" {print $1; exit}')
  echo "debootstrap --variant=minbase bookworm ${mirror:-(its default mirror)} -> $cache"
  rm -rf "$WORK/debootstrap" && mkdir -p "$WORK/debootstrap" "$(dirname "$cache")"
  if ! debootstrap --variant=minbase bookworm "$WORK/debootstrap" ${mirror:+"$mirror"} \
    >"$WORK/debootstrap.log" 2>&1; then
    tail -n 20 "$WORK/debootstrap.log"
    fail "debootstrap failed ($WORK/debootstrap.log)"
    exit 1
  fi
  tar -C "$WORK/debootstrap" -cf "$cache.tmp" . && mv "$cache.tmp" "$cache"
  rm -rf "$WORK/debootstrap"
fi
mkdir -p "$root"
tar -C "$root" -xf "$cache"
cp -r "$bundle" "$root/bundle"
cp "$CHECK" "$root/gpu_check.sh"
mkdir -p "$root/out"
mount -t proc proc "$root/proc"
mount --bind /sys "$root/sys"
mount -o remount,bind,ro "$root/sys"
mount -t tmpfs tmpfs "$root/dev/shm"
in_root() {
  timeout 600 chroot "$root" /usr/bin/env -i HOME=/root TMPDIR=/tmp OUT=/out \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"
}
# The chroot is bare: none of this project's dependencies, no CUDA.
for f in /usr/lib/x86_64-linux-gnu/libmpi.so.40 /usr/lib/x86_64-linux-gnu/libhdf5_openmpi.so.103 \
  /usr/lib/x86_64-linux-gnu/libopenblas.so.0 /usr/bin/mpirun /usr/local/cuda; do
  [[ ! -e $root$f ]] || fail "the chroot has $f"
done
expect "no CUDA libraries" 2 "libcublasLt.so.13 not found" -- \
  in_root bash /gpu_check.sh --bundle /bundle --no-gpu
# The CUDA toolkit, read-only, as the GPU machine has it (and nothing else of this machine).
cuda="$(realpath /usr/local/cuda)"
mkdir -p "$root$cuda"
mount --bind "$cuda" "$root$cuda"
mount -o remount,bind,ro "$root$cuda"
ln -s "$cuda" "$root/usr/local/cuda"

rc=0
out=$(in_root bash /gpu_check.sh --bundle /bundle --no-gpu 2>&1) || rc=$?
printf '%s\n' "$out"
((rc == 0)) || fail "gpu_check.sh --bundle --no-gpu in the chroot exited $rc"
for want in "backends: cpu, cuda \(cuBLASLt, NCCL\)" \
  "2-rank CPU training under /tmp/trainer-gpu\.[^ ]*/mpi/bin/mpirun: 20 steps" \
  "GPU tests: 1 passed, 0 failed, [1-9][0-9]* skipped \(exit 0\)"; do
  grep -qE "$want" <<<"$out" || fail "the chroot run did not print '$want'"
done
[[ -f $root/out/gpu_check/summary.txt ]] || fail "no summary.txt in \$OUT/gpu_check"
((failures == 0)) || { echo "$failures check(s) failed"; exit 1; }
echo "all GPU-bundle checks passed"
