// Encodes a file with one of our tokenizers and prints the token ids, one line, space-separated;
// with --bench, prints the encode speed instead (single-threaded, best of 3 runs).
//   tokenize_tool KIND PATH [--pattern NAME] [--bench] FILE
#include <fmt/format.h>

#include <chrono>
#include <fstream>
#include <sstream>

#include "io/errors.h"
#include "io/tokenizer.h"

int main(int argc, char** argv) {
  std::string pattern, file;
  bool bench = false;
  std::vector<std::string> pos;
  for (int i = 1; i < argc; i++) {
    const std::string a = argv[i];
    if (a == "--pattern" && i + 1 < argc) {
      pattern = argv[++i];
    } else if (a == "--bench") {
      bench = true;
    } else {
      pos.push_back(a);
    }
  }
  if (pos.size() != 3) {
    fmt::print(stderr, "usage: tokenize_tool KIND PATH [--pattern NAME] [--bench] FILE\n");
    return 2;
  }
  try {
    auto tok = trainer::load_tokenizer(pos[0], pos[1], {pattern});
    std::ifstream f(pos[2], std::ios::binary);
    std::ostringstream s;
    s << f.rdbuf();
    const std::string text = s.str();
    if (!bench) {
      fmt::print("{}\n", trainer::ids_text(tok->encode_ordinary(text)));
      return 0;
    }
    double best = 1e30;
    size_t n = 0;
    for (int rep = 0; rep < 3; rep++) {
      const auto t0 = std::chrono::steady_clock::now();
      n = tok->encode_ordinary(text).size();
      best = std::min(best,
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    fmt::print("{} {}: {} bytes -> {} tokens in {:.3f} s: {:.1f} MB/s\n", pos[0], pattern,
               text.size(), n, best, text.size() / best / 1e6);
  } catch (const trainer::InputError& e) {
    fmt::print(stderr, "{}\n", e.what());
    return 2;
  }
  return 0;
}
