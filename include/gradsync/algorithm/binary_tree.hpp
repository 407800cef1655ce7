#pragma once
/// \file The in-order binary tree the Tree algorithm runs on.

#include <array>

namespace gradsync::detail {

/// A binary tree over positions 0..p-1 whose in-order walk is 0, 1, ..., p-1.
/// In 1-based numbering a node's level is its least significant set bit: odd
/// positions are leaves, the root is the largest power of two <= p, and the
/// children of i are i -/+ least_set_bit(i)/2 (the right one moved inward
/// until it exists).
/// Every subtree covers a contiguous range of positions.
struct BinaryTree {
  int p = 1;

  /// The value of i's least significant set bit: its level in the tree.
  static constexpr int least_set_bit(int i) noexcept { return i & -i; }

  int root() const noexcept {
    int b = 1;
    while (b * 2 <= p) b *= 2;
    return b - 1;
  }

  /// Parent of position `pos`, or -1 for the root.
  int parent(int pos) const noexcept {
    int i = pos + 1;
    if (i - 1 == root()) return -1;
    // Climb past ancestors that lie beyond p: they are not nodes.
    for (;;) {
      const int level = least_set_bit(i);
      const int up = ((i / level) % 4 == 1) ? i + level : i - level;
      if (up <= p) return up - 1;
      i = up;
    }
  }

  /// Children of `pos`, -1 where absent; the left (smaller) position first.
  std::array<int, 2> children(int pos) const noexcept {
    const int i = pos + 1;
    int half = least_set_bit(i) / 2;
    if (half == 0) return {-1, -1};
    const int left = i - half;
    int right = -1;
    for (int h = half; h >= 1; h /= 2) {
      if (i + h <= p) {
        right = i + h;
        break;
      }
    }
    return {left - 1, right < 0 ? -1 : right - 1};
  }

  /// First and last position of the subtree under `pos`.
  std::array<int, 2> span(int pos) const noexcept {
    int first = pos;
    int last = pos;
    for (int c = children(pos)[0]; c >= 0; c = children(c)[0]) first = c;
    for (int c = children(pos)[1]; c >= 0; c = children(c)[1]) last = c;
    return {first, last};
  }
};

}  // namespace gradsync::detail
