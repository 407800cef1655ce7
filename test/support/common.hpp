#pragma once
// Helpers every test file shares: one seed per run, type lists, and a way
// to print any element type.

#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <random>
#include <string>
#include <string_view>
#include <type_traits>

// Only what these helpers name: a test that runs collectives includes them
// itself, and the checkpoint file layer's tests parse none.
#include "gradsync/algorithm/tags.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/types.hpp"

namespace test {

/// One seed per process, printed by every case (CAPTURE) so that a failure can
/// be replayed with GRADSYNC_TEST_SEED=<seed>.
inline std::uint64_t test_seed() {
  static const std::uint64_t seed = []() -> std::uint64_t {
    if (const char* env = std::getenv("GRADSYNC_TEST_SEED")) return std::strtoull(env, nullptr, 0);
    std::random_device rd;
    return (std::uint64_t{rd()} << 32) ^ std::uint64_t{rd()};
  }();
  return seed;
}

/// A generator of its own per case, so one case replays alone under -tc.
inline std::mt19937_64 rng_for(std::string_view salt) {
  std::seed_seq seq{static_cast<std::uint32_t>(test_seed()), static_cast<std::uint32_t>(test_seed() >> 32),
                    static_cast<std::uint32_t>(std::hash<std::string_view>{}(salt))};
  return std::mt19937_64(seq);
}

/// The class of `e` by name, the most derived of gradsync's ("InvalidArgument",
/// "Timeout", "Aborted", then "Error"), or "other": for tests that record how
/// each rank's call ended and check it by name.
inline std::string error_kind(const std::exception& e) {
  if (dynamic_cast<const gradsync::InvalidArgument*>(&e) != nullptr) return "InvalidArgument";
  if (dynamic_cast<const gradsync::Timeout*>(&e) != nullptr) return "Timeout";
  if (dynamic_cast<const gradsync::Aborted*>(&e) != nullptr) return "Aborted";
  return dynamic_cast<const gradsync::Error*>(&e) != nullptr ? "Error" : "other";
}

template <class... Ts>
struct List {};
template <class... Ts, class F>
void for_each_type(List<Ts...>, F&& f) {
  (f(std::type_identity<Ts>{}), ...);
}
using Algorithms = List<gradsync::Ring, gradsync::Tree, gradsync::RecursiveHalvingDoubling, gradsync::Native, gradsync::Auto>;

template <class T>
std::string type_name() {
  return std::string(gradsync::name(gradsync::data_type_v<T>));
}

/// 16-bit storage types (bfloat16, float16) convert through float.
template <class T>
constexpr bool is_half_v = gradsync::detail::is_half_storage_v<T>;

template <class T>
double to_double(T x) {
  if constexpr (is_half_v<T>) {
    return static_cast<double>(static_cast<float>(x));
  } else {
    return static_cast<double>(x);
  }
}

}  // namespace test
