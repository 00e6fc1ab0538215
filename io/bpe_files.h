#pragma once
// The files byte-level BPE comes in, parsed into one rank table (id = rank): GPT-2's encoder.json
// + vocab.bpe, and tiktoken rank files. Bad files throw ConfigError with one line naming the file,
// the line or byte offset, what was expected and what was found.
#include <string>
#include <string_view>
#include <vector>

#include "io/bpe.h"
#include "io/tokenizer.h"

namespace trainer {

// ".tiktoken": one "BASE64-TOKEN RANK" a line, every single byte ranked.
std::vector<RankedToken> parse_tiktoken_ranks(std::string_view bytes, const std::string& origin);

struct Gpt2Vocab {
  std::vector<RankedToken> tokens;
  SpecialTokens specials;  // <|endoftext|>, with the id encoder.json gives it
};
// encoder.json maps GPT-2's printable spelling of each token's bytes (encoder.py's
// bytes_to_unicode) to its id; vocab.bpe lists the merges, merge k making the token with id 256 +
// k. Both must agree, as tiktoken's data_gym_to_mergeable_bpe_ranks checks.
Gpt2Vocab parse_gpt2_files(std::string_view encoder_json, const std::string& encoder_origin,
                           std::string_view vocab_bpe, const std::string& vocab_origin);

// GPT-2's printable spelling of bytes (encoder.py's bytes_to_unicode), in UTF-8: how byte-level
// BPE vocabularies (encoder.json, transformers' tokenizer.json) write their tokens.
std::string byte_level_spelling(std::string_view bytes);

// The merge that makes each token of more than one byte, in rank order: the two parts byte-level
// BPE leaves of the token's bytes when only lower ranks may merge (what transformers' conversion
// of tiktoken files computes). A token BPE cannot build from two parts is a ConfigError.
std::vector<std::pair<std::string, std::string>> bpe_merges(std::vector<RankedToken> tokens);

// The special tokens that go with a named pattern over `n_ranks` ranks: gpt2 <|endoftext|> 50256;
// cl100k OpenAI's five; llama3 Meta's 256 (Llama 3's list), numbered from n_ranks.
SpecialTokens pattern_specials(std::string_view pattern_name, size_t n_ranks);

}  // namespace trainer
