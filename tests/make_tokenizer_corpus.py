#!/usr/bin/env python3
"""Writes the tokenizer parity corpus: what trips pre-tokenisers and byte-level BPE up, mixed.

    make_tokenizer_corpus.py SOURCE_DIR OUT_DIR

OUT_DIR/corpus.bin   the raw corpus, invalid UTF-8 included (our round trip runs on it)
OUT_DIR/corpus.txt   the same decoded with U+FFFD for each invalid sequence: valid UTF-8, the text
                     a reference that takes strings (tiktoken under node, python3-sentencepiece)
                     can be given; both sides encode exactly these bytes
Deterministic: the same files on every run and machine.
"""
import random
import sys
from pathlib import Path

src, out = Path(sys.argv[1]), Path(sys.argv[2])
rng = random.Random(20)

prose = (src / "tests/data/pride_and_prejudice_opening.txt").read_bytes()
readme = (src / "README.md").read_bytes()
code = b"".join((src / p).read_bytes() for p in sorted(
    ["io/tokenizer.cpp", "io/bpe.cpp", "io/config.cpp", "scripts/fetch_tokenizers.sh"]))

# Unicode that differs between regex engines or splits oddly: scripts, emoji (ZWJ sequences, skin
# tones, flags, keycaps), combining marks, exotic whitespace (NEL U+0085, U+180E, which PCRE2's \s
# matches and Unicode's White_Space does not, NBSP, ideographic space, line/paragraph separators),
# the long s that (?i) folds to 's', contractions in both cases, and the special tokens' text.
samples = [
    "Hello, world! It's 2024; we'll see. THEY'RE HERE. I'D've. 'S 'ſ 'ſt",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "مرحبا بالعالم، هذه جملة عربية. ١٢٣٤٥",
    "नमस्ते दुनिया, यह देवनागरी है। क्षत्रिय",
    "e\u0301 a\u0308 n\u0303 Z\u0351\u0352\u0353\u0354 A\u030a\u0327 \u0915\u094d\u0937",
    "👩‍👩‍👧‍👦 👨🏽‍💻 🏳️‍🌈 🇫🇷🇯🇵 1️⃣ #️⃣ ❤️ 🧑🏿‍🤝‍🧑🏻 😀😃😄",
    "tab\there\t\tand\n\nnewlines\r\nCRLF\r\n\r\n\n\n   \n\t \n",
    "nel\u0085next mvs\u180enext nbsp\u00a0x ideo\u3000x ls\u2028ps\u2029 thin\u2009x\u200bzw",
    "a \u180e b \u180e\u180e c\u180e \u180e\n d \u0085 e\u0085\u0085 \u0085\n \u00a0\u00a0x \u3000 y",
    "x \u180ea \u180e! \u180e\n1 \u180e\u180ea\n\u180e a  \u180e!",
    "12345678901234567890 3.14159 1,000,000 0x7fffffff 1e-9 ١٢٣ ४५६ ⅷ ½",
    "<|endoftext|> text <|fim_prefix|><|fim_middle|><|fim_suffix|> <|endofprompt|>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|> hi<|eot_id|>",
    "a" * 300 + " " + "ab" * 200 + " " + "😀" * 100,
    " " * 10000 + "x" + "\n" * 700 + "\t" * 300 + "y",
    "ΑΒΓ αβγ Ωμέγα Привет мир ёЁ İstanbul ß ẞ ǅ ﬁ ﬀ",
]

parts = [prose, readme, code] + [s.encode("utf-8") for s in samples]
# Invalid UTF-8: lone continuation bytes, truncated sequences, overlongs, surrogates, 0xFF.
invalid = [b"\x80", b"\xbf\xbf", b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98", b"\xc0\xaf",
           b"\xed\xa0\x80", b"\xff\xfe", b"\xf8\x88\x80\x80\x80", b"\xf4\x90\x80\x80"]
mixed = []
for _ in range(400):
    piece = rng.choice(parts)
    start = rng.randrange(max(1, len(piece) - 200))
    mixed.append(piece[start:start + rng.randrange(1, 200)])
    if rng.random() < 0.3:
        mixed.append(rng.choice(invalid))
corpus = b"".join(parts) + b"".join(mixed) + b"".join(invalid)

out.mkdir(parents=True, exist_ok=True)
(out / "corpus.bin").write_bytes(corpus)
(out / "corpus.txt").write_bytes(corpus.decode("utf-8", "replace").encode("utf-8"))
