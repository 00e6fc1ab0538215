#pragma once
#include <cstdint>
#include <string_view>

namespace trainer {

// Counter-based random numbers: the value at (seed, stream, index) is a pure function of its
// arguments, so any slice of any tensor can be generated independently, in any order.
uint64_t hash_name(std::string_view name);
double normal_at(uint64_t seed, uint64_t stream, uint64_t index);
uint64_t mix64(uint64_t x);

}  // namespace trainer
