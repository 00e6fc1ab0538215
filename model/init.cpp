#include "model/init.h"

#include <cmath>
#include <numbers>

namespace trainer {

uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t hash_name(std::string_view name) {  // FNV-1a
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : name) h = (h ^ uint8_t(c)) * 0x100000001b3ull;
  return h;
}

double normal_at(uint64_t seed, uint64_t stream, uint64_t index) {
  const uint64_t key = mix64(seed ^ mix64(stream));
  // Two uniforms in (0, 1] from 53 random bits each, then Box-Muller.
  const double u1 = double((mix64(key + 2 * index) >> 11) + 1) * 0x1.0p-53;
  const double u2 = double(mix64(key + 2 * index + 1) >> 11) * 0x1.0p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

}  // namespace trainer
