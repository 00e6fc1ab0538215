#include "io/bpe.h"

#include <fmt/format.h>

#include <algorithm>
#include <queue>
#include <stdexcept>

#include "io/errors.h"

namespace trainer {

BpeRanks::BpeRanks(const std::vector<RankedToken>& tokens) {
  ranks_.reserve(tokens.size());
  for (const RankedToken& t : tokens) {
    ranks_.emplace(t.bytes, t.rank);
    max_rank_ = std::max(max_rank_, t.rank);
  }
}

void BpeRanks::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.size() <= kLinearMax) {
    encode_piece_linear(piece, out);
  } else {
    encode_piece_heap(piece, out);
  }
}

// tiktoken's _byte_pair_merge: parts[i] = (start of part i, rank of part i joined with part i+1).
void BpeRanks::encode_piece_linear(std::string_view piece, std::vector<int32_t>& out) const {
  const size_t n = piece.size();
  if (n == 0) return;
  if (n == 1) {
    out.push_back(rank(piece));
    return;
  }
  struct Part {
    size_t start;
    int32_t rank;
  };
  std::vector<Part> parts;
  parts.reserve(n + 1);
  int32_t min_rank = kNoRank;
  size_t min_i = 0;
  for (size_t i = 0; i + 1 < n; i++) {
    const int32_t r = rank(piece.substr(i, 2));
    if (r < min_rank) min_rank = r, min_i = i;
    parts.push_back({i, r});
  }
  parts.push_back({n - 1, kNoRank});
  parts.push_back({n, kNoRank});
  // The rank of parts i and i+1 joined once part i+1 is gone: bytes from parts[i] to parts[i+3].
  auto rank_after = [&](size_t i) {
    if (i + 3 >= parts.size()) return kNoRank;
    return rank(piece.substr(parts[i].start, parts[i + 3].start - parts[i].start));
  };
  while (min_rank != kNoRank) {
    const size_t i = min_i;
    if (i > 0) parts[i - 1].rank = rank_after(i - 1);
    parts[i].rank = rank_after(i);
    parts.erase(parts.begin() + i + 1);
    min_rank = kNoRank;
    for (size_t j = 0; j + 1 < parts.size(); j++) {
      if (parts[j].rank < min_rank) min_rank = parts[j].rank, min_i = j;
    }
  }
  for (size_t i = 0; i + 1 < parts.size(); i++) {
    out.push_back(rank(piece.substr(parts[i].start, parts[i + 1].start - parts[i].start)));
  }
}

// The same merges through a linked list of parts and a heap of (rank, start) candidates: the
// lowest rank first and, among equal ranks, the leftmost, as the linear scan picks. A candidate
// whose part has merged since it was pushed is stale and skipped (its version no longer matches).
void BpeRanks::encode_piece_heap(std::string_view piece, std::vector<int32_t>& out) const {
  const size_t n = piece.size();
  if (n == 0) return;
  std::vector<size_t> next(n + 1), prev(n + 1);
  std::vector<uint32_t> version(n + 1, 0);
  std::vector<bool> alive(n + 1, true);
  for (size_t i = 0; i <= n; i++) next[i] = i + 1, prev[i] = i - 1;  // part n: the end
  struct Candidate {
    int32_t rank;
    size_t start;
    uint32_t version;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : start > o.start;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  // Part i joined with the part after it, if there is one.
  auto pair_rank = [&](size_t i) {
    if (next[i] >= n) return kNoRank;
    return rank(piece.substr(i, next[next[i]] - i));
  };
  auto push = [&](size_t i) {
    version[i]++;
    const int32_t r = pair_rank(i);
    if (r != kNoRank) heap.push({r, i, version[i]});
  };
  for (size_t i = 0; i + 1 < n; i++) push(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    const size_t i = c.start;
    if (!alive[i] || c.version != version[i]) continue;
    const size_t j = next[i];
    alive[j] = false;
    next[i] = next[j];
    prev[next[j]] = i;
    push(i);
    if (i > 0) push(prev[i]);
  }
  for (size_t i = 0; i < n; i = next[i]) out.push_back(rank(piece.substr(i, next[i] - i)));
}

BpeTokenizer::BpeTokenizer(const TokenizerSpec& spec, const std::vector<RankedToken>& tokens)
    : Tokenizer(spec.kind, spec.specials, serialize_spec(spec)),
      ranks_(tokens),
      pre_(spec.pattern, spec.files.empty() ? spec.kind : spec.files.front().origin) {
  int32_t max_id = ranks_.max_rank();
  for (const auto& [name, id] : spec.specials) max_id = std::max(max_id, id);
  decoder_.resize(max_id + 1);
  has_id_.assign(max_id + 1, false);
  for (const RankedToken& t : tokens) {
    decoder_[t.rank] = t.bytes;
    has_id_[t.rank] = true;
  }
  for (const auto& [name, id] : spec.specials) {
    if (has_id_[id]) {
      throw ConfigError(fmt::format("{}: special token {} has id {}, which the ranks give to {}",
                                    spec.files.empty() ? spec.kind : spec.files.front().origin,
                                    name, id, quote_bytes(decoder_[id])));
    }
    decoder_[id] = name;
    has_id_[id] = true;
  }
}

std::vector<int32_t> BpeTokenizer::encode_ordinary(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 16);
  // Recent pieces that took more than one token; text repeats its words, and a lookup is much
  // cheaper than a merge. Keys view `text`, which outlives the call.
  std::unordered_map<std::string_view, std::vector<int32_t>> cache;
  constexpr size_t kCacheMax = 1 << 16;
  pre_.split(text, [&](std::string_view piece) {
    const int32_t whole = ranks_.rank(piece);
    if (whole != BpeRanks::kNoRank) {
      out.push_back(whole);
      return;
    }
    auto it = cache.find(piece);
    if (it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
    const size_t before = out.size();
    ranks_.encode_piece(piece, out);
    if (cache.size() >= kCacheMax) cache.clear();
    cache.emplace(piece, std::vector<int32_t>(out.begin() + before, out.end()));
  });
  return out;
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& tokens) const {
  std::string out;
  for (int32_t t : tokens) {
    if (t < 0 || t >= static_cast<int32_t>(decoder_.size()) || !has_id_[t]) {
      throw std::out_of_range(
          fmt::format("{} tokenizer: token id {} is not in the vocabulary", kind(), t));
    }
    out += decoder_[t];
  }
  return out;
}

}  // namespace trainer
