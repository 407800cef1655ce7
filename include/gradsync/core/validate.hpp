#pragma once
/// \file Argument checks every primitive makes before communicating.

#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <string_view>

#include "gradsync/core/error.hpp"

namespace gradsync::detail {

/// `who`: the rank as errors name it (detail::who(comm)), built only on
/// this path, never for a call whose arguments are fine.
[[noreturn]] inline void invalid(std::string_view collective, const std::string& who, const std::string& what) {
  throw InvalidArgument("gradsync: " + std::string(collective) + " on " + who + ": " + what);
}

/// Spans that share at least one element. std::less, because `<` on
/// pointers into different arrays is unspecified.
template <class T>
bool any_overlap(std::span<const T> a, std::span<const T> b) noexcept {
  if (a.empty() || b.empty()) return false;
  std::less<const T*> lt;
  return lt(a.data(), b.data() + b.size()) && lt(b.data(), a.data() + a.size());
}

/// Spans that share memory without being the same span.
template <class T>
bool partially_overlap(std::span<const T> a, std::span<const T> b) noexcept {
  if (a.data() == b.data() && a.size() == b.size()) return false;
  return any_overlap(a, b);
}

}  // namespace gradsync::detail
