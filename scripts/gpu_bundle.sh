#!/usr/bin/env bash
# Makes the GPU bundle: the CUDA-enabled trainer, trainer_bench and the GPU test executable, built
# here for sm_80 and sm_90 (A100, H100/H200), with everything they need that a bare GPU machine
# lacks, packed to be carried there and run with `scripts/gpu_check.sh --bundle DIR`.
#
#   scripts/gpu_bundle.sh [--out DIR] [--build-dir DIR] [--skip-build] [--add FILE]... [--max-mb N]
#                         [--level L]
#
# In the bundle: the binaries (host code for x86-64-v3, not for this CPU); the shared libraries of
# their dependency closure except the C runtime (glibc) and what the GPU machine brings (the CUDA
# runtime, cuBLAS/cuBLASLt, NCCL, the driver); Open MPI's runtime (mpirun, its components, help
# files and settings, relocated through OPAL_PREFIX) and PMIx's components; the test data; env.sh,
# which points a shell at all of it. DIR (default .gpu-bundle/) receives:
#   trainer-gpu.tar.zst   the bundle (zstd), unpacked by gpu_check.sh into /tmp
#   MANIFEST              what the machine must provide: glibc version, CPU features, CUDA libraries
#   zstd/                 a zstd and its libraries, for machines without one
# --add FILE bundles another executable with its closure; --skip-build reuses --build-dir;
# --level sets zstd's level (default 19: the smallest archive; lower is faster and larger).
# Exit 1 when a library of the closure cannot be found or the archive is over --max-mb (48).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="$ROOT/.gpu-bundle"
BUILD="$ROOT/build-bundle"
build=1 max_mb=48 level=19 extra=()
while (($#)); do
  case "$1" in
    --out) OUT_DIR="$2"; shift ;;
    --build-dir) BUILD="$2"; shift ;;
    --skip-build) build=0 ;;
    --add) extra+=("$(realpath "$2")"); shift ;;
    --max-mb) max_mb="$2"; shift ;;
    --level) level="$2"; shift ;;
    -h | --help) sed -n '2,19s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "gpu_bundle.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
die() { echo "gpu_bundle.sh: $*" >&2; exit 1; }
[[ $level =~ ^([1-9]|1[0-9])$ ]] || { echo "gpu_bundle.sh: --level must be 1 to 19, not '$level'" >&2; exit 2; }
OUT_DIR="$(mkdir -p "$OUT_DIR" && cd "$OUT_DIR" && pwd)"
BUILD="$(mkdir -p "$BUILD" && cd "$BUILD" && pwd)"
MARCH=x86-64-v3
# x86-64-v3's features as /proc/cpuinfo names them (lzcnt, which virtual machines may not list
# there, comes with all of them): gpu_check.sh checks them before running.
CPU_FLAGS="avx avx2 bmi1 bmi2 f16c fma movbe xsave"

# Libraries the bundle leaves to the machine: the C runtime, which must match its own loader, and
# the CUDA libraries, which must match its driver and come with its toolkit or pip packages.
GLIBC_RE='^(linux-vdso|ld-linux-x86-64|libc|libm|libmvec|libpthread|libdl|librt|libresolv|libutil|libanl|libBrokenLocale|libc_malloc_debug|libthread_db|libnss_[a-z]+)\.so'
MACHINE_RE='^(libcuda|libcudart|libcublas|libcublasLt|libnccl|libcudnn[a-z_]*|libnvidia-[a-z-]+|libnvrtc|libnvJitLink)\.so'

export PATH="$PATH:/usr/local/cuda/bin"
if ((build)); then
  command -v nvcc >/dev/null || die "nvcc not found: the bundle needs the CUDA toolkit to build"
  echo "== building for sm_80 and sm_90, host code for $MARCH, in $BUILD"
  cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DTRAINER_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="80;90" -DTRAINER_MARCH="$MARCH" >"$BUILD/configure.log" 2>&1 ||
    { cat "$BUILD/configure.log" >&2; die "configure failed"; }
  cmake --build "$BUILD" -j"$(nproc)" --target trainer trainer_bench cuda_tests \
    >"$BUILD/build.log" 2>&1 || { tail -n 40 "$BUILD/build.log" >&2; die "build failed"; }
fi
for f in "$BUILD/trainer" "$BUILD/bench/trainer_bench" "$BUILD/tests/cuda_tests"; do
  [[ -x $f ]] || die "$f is missing: build first (without --skip-build)"
done
version=$("$BUILD/trainer" --version)
[[ $version == *"cuda (cuBLASLt, NCCL)"* ]] ||
  die "the build has no CUDA backend with NCCL ('$version'): the bundle is for GPUs"
grep -q "TRAINER_MARCH:STRING=$MARCH" "$BUILD/CMakeCache.txt" ||
  die "$BUILD was not configured with -DTRAINER_MARCH=$MARCH: its binaries may not run elsewhere"

STAGE="$BUILD/stage"
B="$STAGE/trainer-gpu"
rm -rf "$STAGE"
mkdir -p "$B"/{bin,lib,src/tests/data,mpi/bin,mpi/lib,mpi/share,mpi/etc,mpi/pmix/lib/pmix,mpi/pmix/share}
cp "$BUILD/trainer" "$BUILD/bench/trainer_bench" "$BUILD/tests/cuda_tests" "$B/bin/"
for f in "${extra[@]}"; do cp "$f" "$B/bin/"; done
cp "$ROOT"/tests/data/* "$B/src/tests/data/"
cp -r "$ROOT/configs" "$B/src/"

# Open MPI (Debian's layout: prefix /usr, components in pkglibdir, help in pkgdatadir) and PMIx.
ompi_pkglib=$(ompi_info --path pkglibdir --parsable | sed 's/.*:pkglibdir://')
ompi_pkgdata=$(ompi_info --path pkgdatadir --parsable | sed 's/.*:pkgdatadir://')
cp "$(realpath "$(command -v orterun)")" "$B/mpi/bin/mpirun"
cp "$(realpath "$(command -v orted)")" "$B/mpi/bin/orted"
cp "$ompi_pkglib"/*.so "$B/mpi/lib/"
cp -r "$ompi_pkgdata" "$B/mpi/share/openmpi"
pmix_component=$(dpkg -L libpmix2 | grep -m1 '/lib/pmix/.*\.so$') ||
  die "PMIx's components not found (Debian's libpmix2)"
pmix_prefix=$(dirname "$(dirname "$(dirname "$pmix_component")")")
cp "$pmix_prefix"/lib/pmix/*.so "$B/mpi/pmix/lib/pmix/"
cp -r "$pmix_prefix/share/pmix" "$B/mpi/pmix/share/"
# Debian's settings, then what a lone GPU machine (a VM or container) needs: launching on this node
# only (the rsh launcher refuses to start without ssh), no single-copy (CMA needs ptrace rights),
# no binding (the trainer sizes its OpenMP pool itself), no complaints about oversubscription.
{
  grep -v '^#' /etc/openmpi/openmpi-mca-params.conf | grep . || true
  echo "plm = isolated"
  echo "btl_vader_single_copy_mechanism = none"
  echo "hwloc_base_binding_policy = none"
  echo "rmaps_base_oversubscribe = true"
} >"$B/mpi/etc/openmpi-mca-params.conf"

cat >"$B/env.sh" <<'EOF'
# Points this shell at the unpacked bundle: its libraries, its mpirun (relocated Open MPI and
# PMIx) and, for the tests, the trainer and the test data. The CUDA libraries (cudart, cuBLASLt,
# NCCL) must be on LD_LIBRARY_PATH already: scripts/gpu_check.sh --bundle finds them.
TRAINER_BUNDLE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
_b="$TRAINER_BUNDLE"
export TRAINER_BUNDLE LD_LIBRARY_PATH="$_b/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$_b/bin:$_b/mpi/bin:$PATH"
export OPAL_PREFIX="$_b/mpi" OPAL_BINDIR="$_b/mpi/bin" OPAL_LIBDIR="$_b/lib"
export OPAL_PKGLIBDIR="$_b/mpi/lib" OPAL_PKGDATADIR="$_b/mpi/share/openmpi"
export OPAL_SYSCONFDIR="$_b/mpi/etc"
export PMIX_INSTALL_PREFIX="$_b/mpi/pmix" PMIX_MCA_mca_base_component_path="$_b/mpi/pmix/lib/pmix"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export TRAINER_BIN="$_b/bin/trainer" TRAINER_MPIEXEC="$_b/mpi/bin/mpirun" TRAINER_SOURCE_DIR="$_b/src"
unset _b
EOF

# (Read by bash itself: a process or three per file cost ~15 s over a bundle's files.)
is_elf() {
  local LC_ALL=C magic=""
  read -r -N 4 magic <"$1" 2>/dev/null || true
  [[ $magic == $'\177ELF' ]]
}
# Copies into $1 the libraries that ELF file $2 loads (ldd lists the whole closure), except the
# C runtime and the machine's CUDA libraries (recorded in `machine`).
declare -A machine=()
missing=()
gather() {
  local into="$1" file="$2" name arrow path rest
  local listing
  listing=$(ldd "$file" 2>&1) || die "ldd $file failed: $listing"
  while read -r name arrow path rest; do
    [[ $arrow == "=>" ]] || continue
    if [[ $path == not ]]; then
      missing+=("$name (needed by ${file#"$STAGE"/})")
    elif [[ $name =~ $MACHINE_RE ]]; then
      machine[$name]=1
    elif ! [[ $name =~ $GLIBC_RE ]]; then
      [[ -e $into/$name ]] || cp -L "$path" "$into/$name"
    fi
  done <<<"$listing"
}
elves=()
while IFS= read -r -d '' f; do is_elf "$f" && elves+=("$f"); done < <(find "$B" -type f -print0)
for f in "${elves[@]}"; do gather "$B/lib" "$f"; done
((${#missing[@]} == 0)) || die "libraries not found on this machine: ${missing[*]}"

# The closure is complete when every library any bundled file names (DT_NEEDED) is in the bundle
# or left to the machine on purpose: nothing may come from this machine's installed packages.
needed_of() { readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
while IFS= read -r -d '' f; do is_elf "$f" && elves+=("$f"); done < <(find "$B/lib" -type f -print0)
for f in "${elves[@]}"; do
  for lib in $(needed_of "$f"); do
    [[ -e $B/lib/$lib || $lib =~ $GLIBC_RE || $lib =~ $MACHINE_RE ]] ||
      die "${f#"$STAGE"/} needs $lib, which is not in the bundle"
    [[ $lib =~ $MACHINE_RE ]] && machine[$lib]=1
  done
done

# cuBLASLt is not linked but loaded when the CUDA backend makes its first GEMM (dlopen, by the
# CUDA major version's soname, kernels/cuda/gemm.cpp): the machine brings it too.
# Its soname's number is the CUDA major version, that of the runtime the binaries link.
cuda_major=""
for lib in "${!machine[@]}"; do
  [[ $lib =~ ^libcudart\.so\.([0-9]+)$ ]] && cuda_major=${BASH_REMATCH[1]}
done
[[ -n $cuda_major ]] || die "no libcudart.so.N among the binaries' libraries: is this a CUDA build?"
machine[libcublasLt.so.$cuda_major]=1

# zstd to unpack with, for machines without one (beside the archive, not in it).
rm -rf "$OUT_DIR/zstd" "$OUT_DIR/trainer-gpu.tar.zst" "$OUT_DIR/MANIFEST"
mkdir -p "$OUT_DIR/zstd/lib"
cp "$(command -v zstd)" "$OUT_DIR/zstd/"
gather "$OUT_DIR/zstd/lib" "$OUT_DIR/zstd/zstd"

# The newest glibc symbol version anything here uses is the oldest C library that runs it.
glibc_min=$({ objdump -T "${elves[@]}" "$OUT_DIR/zstd/zstd" "$OUT_DIR"/zstd/lib/* 2>/dev/null || true; } |
  { grep -o 'GLIBC_[0-9][0-9.]*' || true; } | sed 's/GLIBC_//' | sort -uV | tail -n 1)
unpacked_kb=$(du -sk "$B" | cut -f1)

echo "== packing $(find "$B" -type f | wc -l) files, $((unpacked_kb / 1024)) MB"
tar -C "$STAGE" -cf - trainer-gpu | zstd -q -"$level" --long=27 -T0 -o "$OUT_DIR/trainer-gpu.tar.zst"
bytes=$(stat -c %s "$OUT_DIR/trainer-gpu.tar.zst")
total_kb=$(du -sk "$OUT_DIR" | cut -f1)
if ((total_kb > max_mb * 1024)); then
  rm -f "$OUT_DIR/trainer-gpu.tar.zst"
  die "the bundle would be $((total_kb / 1024)) MB, over the limit of $max_mb MB: refusing"
fi
cat >"$OUT_DIR/MANIFEST" <<EOF
# scripts/gpu_bundle.sh: what gpu_check.sh --bundle checks before unpacking
archive=trainer-gpu.tar.zst
archive_bytes=$bytes
unpacked_kb=$unpacked_kb
built_from=$(git -C "$ROOT" describe --always --dirty 2>/dev/null || echo unknown)
built_on=$(. /etc/os-release && echo "$PRETTY_NAME")
built_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)
version=$version
cuda=$(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), sm_80 and sm_90
glibc_min=$glibc_min
cpu_flags=$CPU_FLAGS
machine_libs=$(printf '%s\n' "${!machine[@]}" | sort | tr '\n' ' ' | sed 's/ $//')
EOF
echo "== $OUT_DIR: $((total_kb / 1024)) MB (archive $((bytes / 1024 / 1024)) MB, unpacks to" \
  "$((unpacked_kb / 1024)) MB); needs glibc >= $glibc_min and ${!machine[*]} on the machine"
