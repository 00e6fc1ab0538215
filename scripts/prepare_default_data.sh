#!/usr/bin/env bash
# The embedded default data set: Jane Austen's six novels, from Debian's r-cran-janeaustenr
# package (downloaded and unpacked, not installed: no R needed), tokenized into
# data/austen/{train,val}.bin. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
out=data/austen
if [ -f "$out/train.bin" ] && [ -f "$out/val.bin" ]; then
  echo "prepare_default_data: $out already prepared"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod 777 "$work"  # apt-get download drops privileges to _apt
(cd "$work" && apt-get download r-cran-janeaustenr >/dev/null 2>&1) || {
  [ "$(id -u)" -eq 0 ] && apt-get update -qq
  (cd "$work" && apt-get download r-cran-janeaustenr >/dev/null)
}
dpkg-deb -x "$work"/r-cran-janeaustenr_*.deb "$work/pkg"
python3 scripts/austen_from_r.py "$work/pkg/usr/lib/R/site-library/janeaustenr/data" "$out/text"
build/trainer prepare --input "$out"/text/*.txt --out-dir "$out" --val-fraction 0.05
