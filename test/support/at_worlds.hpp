#pragma once
// A test body run at several world sizes with one seeded generator.

#include <doctest/doctest.h>

#include <cstdint>
#include <initializer_list>
#include <random>
#include <string_view>

#include "common.hpp"
#include "world.hpp"

namespace test {

/// Runs check(g, n) for each world size in `sizes` this build runs (every
/// one on Threads; the job's own under mpirun), all with the generator of
/// `salt`; the seed is printed on failure.
template <class Check>
void at_worlds(std::string_view salt, std::initializer_list<int> sizes, Check check) {
  const std::uint64_t seed = test_seed();
  CAPTURE(seed);
  auto g = rng_for(salt);
  for (int n : sizes)
    if (world_has(n)) check(g, n);
}

}  // namespace test
