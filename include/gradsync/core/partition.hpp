#pragma once
/// \file Splitting a count into nearly equal contiguous blocks.

#include <cstddef>

namespace gradsync::detail {

/// [begin, end) of a piece of a range.
struct Range {
  std::size_t begin = 0;
  std::size_t end = 0;
  constexpr std::size_t size() const noexcept { return end - begin; }
};

/// Block i of `count` elements split into `parts` pieces whose sizes differ by
/// at most one; the larger pieces come first. Works for count < parts too.
constexpr Range block(std::size_t count, std::size_t parts, std::size_t i) noexcept {
  const std::size_t q = count / parts;
  const std::size_t r = count % parts;
  const std::size_t begin = i * q + (i < r ? i : r);
  return {begin, begin + q + (i < r ? 1 : 0)};
}

/// Block q of an N-block reduce-scatter input whose blocks all hold `m`
/// elements: [q·m, q·m + m).
struct EqualBlocks {
  std::size_t m = 0;
  constexpr Range operator()(int q) const noexcept {
    const std::size_t begin = m * static_cast<std::size_t>(q);
    return {begin, begin + m};
  }
};

/// Piece k of `pieces` of the range `whole`.
constexpr Range sub(Range whole, std::size_t pieces, std::size_t k) noexcept {
  const Range b = block(whole.size(), pieces, k);
  return {whole.begin + b.begin, whole.begin + b.end};
}

/// How many pieces of at most `max_elems` cover `elems` (at least one).
constexpr std::size_t pieces_for(std::size_t elems, std::size_t max_elems) noexcept {
  if (max_elems == 0) max_elems = 1;
  const std::size_t k = (elems + max_elems - 1) / max_elems;
  return k ? k : 1;
}

}  // namespace gradsync::detail
