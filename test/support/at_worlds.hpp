#pragma once
// A test body run at several world sizes with one seeded generator.

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "common.hpp"
#include "sanitizers.hpp"
#include "world.hpp"

namespace test {

/// The world sizes of `sizes` that a run visits. Every one, except in a
/// sanitizer build, where a world's cost grows with its ranks and the
/// sanitizer multiplies it: there every size up to 5 (one and two ranks,
/// odd and even, a power of two and not) and two of the larger ones, drawn
/// from the run's seed, so that successive runs cover them all and a
/// failing run replays with its seed. The plain build visits every size.
inline std::vector<int> visited_worlds(std::string_view salt, std::initializer_list<int> sizes) {
  std::vector<int> all(sizes), kept;
  if (!sanitized) return all;
  std::vector<int> larger;
  for (int n : all) (n <= 5 ? kept : larger).push_back(n);
  auto g = rng_for(std::string(salt) + "/worlds");
  std::shuffle(larger.begin(), larger.end(), g);
  larger.resize(std::min<std::size_t>(larger.size(), 2));
  kept.insert(kept.end(), larger.begin(), larger.end());
  std::sort(kept.begin(), kept.end());
  return kept;
}

/// Runs check(g, n) for each world size in `sizes` this build runs (every
/// one on Threads, a seeded sample of the larger ones under a sanitizer; the
/// job's own under mpirun), all with the generator of `salt`; the seed is
/// printed on failure.
template <class Check>
void at_worlds(std::string_view salt, std::initializer_list<int> sizes, Check check) {
  const std::uint64_t seed = test_seed();
  CAPTURE(seed);
  auto g = rng_for(salt);
  for (int n : visited_worlds(salt, sizes))
    if (world_has(n)) check(g, n);
}

}  // namespace test
