// bfloat16: conversion from float rounds to nearest, ties to even; NaN stays
// NaN; overflow goes to infinity; every bfloat16 round-trips through float;
// and reductions round back to bfloat16 after every step.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "gradsync/collectives.hpp"
#include "support/instances.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_bfloat16 {

namespace gs = gradsync;
using gs::bfloat16;

namespace {

float from_float_bits(std::uint32_t u) { return std::bit_cast<float>(u); }

std::uint16_t to_bf16_bits(std::uint32_t float_bits) { return bfloat16(from_float_bits(float_bits)).bits; }

/// Round-to-nearest-even computed the slow way: pick the nearer of the two
/// bfloat16 neighbours of f in double arithmetic (beyond the largest finite
/// value, the upper neighbour is 2^128, which is what rounds to infinity).
std::uint16_t reference_round(std::uint32_t u) {
  const double f = from_float_bits(u);
  const std::uint32_t lo_bits = u & 0xffff0000u;
  const double lo = from_float_bits(lo_bits);
  const std::uint32_t hi_bits = lo_bits + 0x10000u;
  const bool hi_is_inf = (hi_bits & 0x7f800000u) == 0x7f800000u;
  const double hi = hi_is_inf ? std::copysign(std::ldexp(1.0, 128), f) : static_cast<double>(from_float_bits(hi_bits));
  const double d_lo = std::fabs(f - lo);
  const double d_hi = std::fabs(hi - f);
  const auto lo16 = static_cast<std::uint16_t>(lo_bits >> 16);
  if (d_lo < d_hi) return lo16;
  if (d_hi < d_lo) return static_cast<std::uint16_t>(lo16 + 1);
  return (lo16 & 1u) ? static_cast<std::uint16_t>(lo16 + 1) : lo16;
}

bool is_nan_bits(std::uint32_t u) { return (u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0; }

}  // namespace

TEST_CASE("bfloat16 is two bytes, and conversion is constexpr") {
  static_assert(sizeof(bfloat16) == 2);
  static_assert(bfloat16(1.0f).bits == 0x3f80);
  static_assert(static_cast<float>(bfloat16::from_bits(0xc000)) == -2.0f);
  CHECK(bfloat16().bits == 0);
}

TEST_CASE("every bfloat16 value round-trips through float exactly") {
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const bfloat16 x = bfloat16::from_bits(static_cast<std::uint16_t>(b));
    const float f = static_cast<float>(x);
    CHECK(std::bit_cast<std::uint32_t>(f) == b << 16);
    if (is_nan_bits(b << 16)) {
      // Quiet NaNs keep their bits; a signalling one comes back quiet.
      const bfloat16 back(f);
      CHECK(std::isnan(static_cast<float>(back)));
      CHECK((back.bits & 0x8000u) == (b & 0x8000u));
      if (b & 0x0040u) CHECK(back.bits == b);
    } else {
      REQUIRE(bfloat16(f).bits == b);
    }
  }
}

TEST_CASE("conversion from float rounds to nearest, ties to even") {
  // 1 + 2^-8 is halfway between 1 (even) and 1 + 2^-7 (odd): down to 1.
  CHECK(to_bf16_bits(0x3f808000u) == 0x3f80);
  // Halfway between 0x3f81 (odd) and 0x3f82 (even): up to 0x3f82.
  CHECK(to_bf16_bits(0x3f818000u) == 0x3f82);
  // Either side of a tie goes to the nearer value.
  CHECK(to_bf16_bits(0x3f807fffu) == 0x3f80);
  CHECK(to_bf16_bits(0x3f808001u) == 0x3f81);
  CHECK(to_bf16_bits(0x3f81ffffu) == 0x3f82);
  // Negative numbers mirror the positive ones.
  CHECK(to_bf16_bits(0xbf808000u) == 0xbf80);
  CHECK(to_bf16_bits(0xbf818000u) == 0xbf82);
  CHECK(to_bf16_bits(0xbf808001u) == 0xbf81);
  // A tie that carries into the exponent.
  CHECK(to_bf16_bits(0x3fffc000u) == 0x4000);
  CHECK(to_bf16_bits(0x3fff8000u) == 0x4000);
  CHECK(bfloat16(1.0f).bits == 0x3f80);
  CHECK(bfloat16(-2.0f).bits == 0xc000);
  CHECK(bfloat16(0.0f).bits == 0x0000);
  CHECK(bfloat16(-0.0f).bits == 0x8000);
}

TEST_CASE("NaN stays NaN, infinities stay infinite, overflow rounds to infinity") {
  CHECK(std::isnan(static_cast<float>(bfloat16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload lies only in the low 16 bits would truncate to inf.
  for (std::uint32_t u : {0x7f800001u, 0x7f80ffffu, 0xff800001u, 0x7fc00000u, 0x7fffffffu, 0xffffffffu, 0xffc00001u}) {
    CAPTURE(u);
    const std::uint16_t b = to_bf16_bits(u);
    CHECK(std::isnan(static_cast<float>(bfloat16::from_bits(b))));
    CHECK((b & 0x8000u) == ((u >> 16) & 0x8000u));
  }
  CHECK(to_bf16_bits(0x7f800000u) == 0x7f80);
  CHECK(to_bf16_bits(0xff800000u) == 0xff80);
  CHECK(static_cast<float>(bfloat16(std::numeric_limits<float>::infinity())) == std::numeric_limits<float>::infinity());
  // FLT_MAX and the tie above the largest finite bfloat16 (0x7f7f, odd) round up to inf.
  CHECK(to_bf16_bits(0x7f7fffffu) == 0x7f80);
  CHECK(to_bf16_bits(0x7f7f8000u) == 0x7f80);
  CHECK(to_bf16_bits(0xff7fffffu) == 0xff80);
  // Just below that tie stays at the largest finite value.
  CHECK(to_bf16_bits(0x7f7f7fffu) == 0x7f7f);
  CHECK(to_bf16_bits(0xff7f7fffu) == 0xff7f);
}

TEST_CASE("denormals convert and round like any other value") {
  CHECK(to_bf16_bits(0x00010000u) == 0x0001);  // smallest bfloat16 denormal
  CHECK(to_bf16_bits(0x00008000u) == 0x0000);  // tie: down to even 0
  CHECK(to_bf16_bits(0x00018000u) == 0x0002);  // tie: up to even 2
  CHECK(to_bf16_bits(0x00008001u) == 0x0001);
  CHECK(to_bf16_bits(0x00000001u) == 0x0000);  // smallest float denormal underflows to +0
  CHECK(to_bf16_bits(0x80000001u) == 0x8000);  // ... and its negative to -0
  CHECK(to_bf16_bits(0x007fffffu) == 0x0080);  // largest float denormal rounds up to the smallest normal
  CHECK(to_bf16_bits(0x00800000u) == 0x0080);
  CHECK(static_cast<float>(bfloat16::from_bits(0x0001)) == std::ldexp(1.0f, -133));
}

TEST_CASE("conversion agrees with a slow round-to-nearest-even on random and near-tie floats") {
  std::uint64_t seed = std::random_device{}();
  if (const char* env = std::getenv("GRADSYNC_TEST_SEED")) seed = std::strtoull(env, nullptr, 0);
  CAPTURE(seed);
  std::mt19937_64 g(seed);
  std::uniform_int_distribution<std::uint32_t> any;
  std::uniform_int_distribution<std::uint32_t> near(0x7ffdu, 0x8002u);
  for (int i = 0; i < 200000; ++i) {
    std::uint32_t u = any(g);
    // Every other sample sits at or next to a tie.
    if (i % 2) u = (u & 0xffff0000u) | near(g);
    if (is_nan_bits(u)) continue;
    if (bfloat16(from_float_bits(u)).bits != reference_round(u)) {
      FAIL_CHECK("float bits " << u << " converted to " << bfloat16(from_float_bits(u)).bits << ", expected "
                               << reference_round(u));
      break;
    }
  }
}

TEST_CASE("ops widen bfloat16 to float for each step and round back") {
  const bfloat16 big(256.0f), one(1.0f);
  // 256 + 1 = 257 is a tie between 256 and 258: even 256. Twice over, still
  // 256; summing in float and rounding once would give 258.
  CHECK(gs::Sum::apply(big, one) == big);
  CHECK(gs::Sum::apply(gs::Sum::apply(big, one), one) == big);
  CHECK(gs::Sum::apply(gs::Sum::apply(one, one), big).bits == bfloat16(258.0f).bits);
  // (1 + 2^-7) squared = 1 + 2^-6 + 2^-14 rounds to 1 + 2^-6.
  const bfloat16 a = bfloat16::from_bits(0x3f81);
  CHECK(gs::Prod::apply(a, a).bits == 0x3f82);
  CHECK(gs::Min::apply(a, one) == one);
  CHECK(gs::Max::apply(a, one) == a);
  // Avg divides once at the end and rounds: 3 / 2 = 1.5 exactly; 1 / 3 rounds.
  CHECK(static_cast<float>(gs::Avg::finish(bfloat16(3.0f), 2)) == 1.5f);
  CHECK(gs::Avg::finish(one, 3).bits == bfloat16(1.0f / 3.0f).bits);
}

TEST_CASE("an all-reduce of bfloat16 rounds after each rank's contribution") {
  // Native folds rank 0, 1, 2 in order; so does any algorithm in deterministic mode.
  auto run = [](auto algo, gs::Options opt) {
    using Algo = typename decltype(algo)::type;
    std::vector<std::vector<bfloat16>> x(3);
    gs::run_threads(3, [&](gs::Communicator<gs::Threads>& comm) {
      auto& v = x[static_cast<std::size_t>(comm.rank())];
      v.assign(7, comm.rank() == 0 ? bfloat16(256.0f) : bfloat16(1.0f));
      gs::AllReduce<Algo>{opt}(comm, std::span<bfloat16>(v));
    });
    for (const auto& v : x)
      for (bfloat16 b : v) CHECK(static_cast<float>(b) == 256.0f);
  };
  run(std::type_identity<gs::Native>{}, {});
  run(std::type_identity<gs::Ring>{}, {.deterministic = true});
  run(std::type_identity<gs::Tree>{}, {.deterministic = true});
  run(std::type_identity<gs::RecursiveHalvingDoubling>{}, {.deterministic = true});
}

}  // namespace test_bfloat16
