#pragma once
// A number that must fill its whole command-line word, for the examples'
// options (cli.hpp) and bench/'s lists of integers. No gradsync: bench
// tools that link only Eigen include it too.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace example {

/// `text` read as an int, a std::uint64_t or a double (std::stoi, stoull,
/// stod): nothing where it holds no number, more than one, or one out of
/// range. stoull takes "-1" as 2^64 - 1; a caller wanting no sign checks.
template <class T>
std::optional<T> parse_whole(const std::string& text) {
  static_assert(std::is_same_v<T, int> || std::is_same_v<T, std::uint64_t> || std::is_same_v<T, double>);
  std::size_t used = 0;
  T value{};
  try {
    if constexpr (std::is_same_v<T, int>) value = std::stoi(text, &used);
    else if constexpr (std::is_same_v<T, std::uint64_t>) value = std::stoull(text, &used);
    else value = std::stod(text, &used);
  } catch (const std::logic_error&) {
    return std::nullopt;
  }
  if (used != text.size()) return std::nullopt;
  return value;
}

}  // namespace example
