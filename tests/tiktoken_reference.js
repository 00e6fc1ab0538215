// The reference encoder for the parity tests: the npm tiktoken package (OpenAI's tiktoken built to
// WASM) under node. Prints the token ids of a UTF-8 file, one line, space-separated.
//
//   node tiktoken_reference.js CACHE_DIR ENCODING FILE [all]
//     ENCODING: a name the package knows (gpt2, cl100k_base), its own data
//   node tiktoken_reference.js CACHE_DIR RANKS_FILE FILE [all] --pattern PAT --specials JSON
//     a .tiktoken rank file with a pattern and special tokens, as `new Tiktoken` takes them
// With "all", every special token is recognised (allowed_special = "all"); else none is
// (encode_ordinary).
"use strict";
const fs = require("fs");

const args = process.argv.slice(2);
const flag = (name) => {
  const i = args.indexOf(name);
  if (i < 0) return null;
  const v = args[i + 1];
  args.splice(i, 2);
  return v;
};
const pattern = flag("--pattern");
const specials = flag("--specials");
const [cache, encoding, file, all] = args;
const { Tiktoken, get_encoding } = require(`${cache}/npm/tiktoken/tiktoken.cjs`);
const enc = pattern === null
  ? get_encoding(encoding)
  : new Tiktoken(fs.readFileSync(encoding, "utf8"), JSON.parse(specials), pattern);
const text = fs.readFileSync(file, "utf8");
const ids = all === "all" ? enc.encode(text, "all") : enc.encode_ordinary(text);
process.stdout.write(Array.from(ids).join(" ") + "\n");
enc.free();
