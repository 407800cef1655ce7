#pragma once
/// \file AlgorithmId: which algorithm, as a value.

#include <cstdint>
#include <optional>
#include <string_view>

namespace gradsync {

/// Which algorithm: what Auto picks, what the cost model prices, and the
/// row of Auto's dispatch table. Each algorithm tag carries its own (`Ring::id`).
enum class AlgorithmId : std::uint8_t { ring, tree, rhd, native, automatic };

/// Names as they appear in diagnostics and benchmark columns.
constexpr std::string_view name(AlgorithmId a) noexcept {
  switch (a) {
    case AlgorithmId::ring: return "ring";
    case AlgorithmId::tree: return "tree";
    case AlgorithmId::rhd: return "rhd";
    case AlgorithmId::native: return "native";
    case AlgorithmId::automatic: return "auto";
  }
  return "?";
}

/// The algorithm named `n` (as name() spells it), or nothing.
constexpr std::optional<AlgorithmId> algorithm_id(std::string_view n) noexcept {
  for (auto a : {AlgorithmId::ring, AlgorithmId::tree, AlgorithmId::rhd, AlgorithmId::native, AlgorithmId::automatic})
    if (name(a) == n) return a;
  return std::nullopt;
}

}  // namespace gradsync
