#pragma once
/// \file The *_perf tools' test data: inputs every type holds exactly, and
/// the exact reduced values, written from the ops' definitions rather than
/// with the library's code.

#include <gradsync/collectives.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

namespace bench {

/// Small integers in [-3, 3], varying with rank and index (hashed, so a block
/// landing at the wrong offset shows), such that sums over a few ranks are
/// exact in every type, bfloat16 included (|sum| <= 3N <= 256 for N <= 85).
inline int pattern(int rank, std::size_t i) {
  const auto h = static_cast<std::uint32_t>(i) * 2654435761u;
  return static_cast<int>(((h >> 13) + 3u * static_cast<std::uint32_t>(rank)) % 7u) - 3;
}

/// Rank `rank`'s input at index i; products stay exact with inputs of +-1.
template <class Op>
int input_value(int rank, std::size_t i) {
  const int v = pattern(rank, i);
  if constexpr (std::is_same_v<Op, gradsync::Prod>) return v < 0 ? -1 : 1;
  return v;
}

/// 16-bit floats: stored as such, computed in float.
template <class T>
constexpr bool is_half = std::is_same_v<T, gradsync::bfloat16> || std::is_same_v<T, gradsync::float16>;

template <class T>
T from_int(long long v) {
  if constexpr (is_half<T>) return T(static_cast<float>(v));
  else return static_cast<T>(v);
}

/// What an output element holds before the call: no input is ever 101, so
/// an element the collective did not write shows as wrong.
template <class T>
T unwritten() {
  return from_int<T>(101);
}

/// The exact result at index i, written from the ops' definitions rather than
/// with the library's code. Avg is the sum divided by N in T's arithmetic
/// (truncating for integers; for 16-bit floats in float, then rounded).
template <class T, class Op>
T expected_value(int ranks, std::size_t i) {
  long long acc = input_value<Op>(0, i);
  for (int r = 1; r < ranks; ++r) {
    const long long v = input_value<Op>(r, i);
    if constexpr (std::is_same_v<Op, gradsync::Min>) acc = std::min(acc, v);
    else if constexpr (std::is_same_v<Op, gradsync::Max>) acc = std::max(acc, v);
    else if constexpr (std::is_same_v<Op, gradsync::Prod>) acc *= v;
    else acc += v;
  }
  if constexpr (std::is_same_v<Op, gradsync::Avg>) {
    if constexpr (is_half<T>) {
      return T(static_cast<float>(acc) / static_cast<float>(ranks));
    } else {
      return static_cast<T>(from_int<T>(acc) / static_cast<T>(ranks));
    }
  }
  return from_int<T>(acc);
}

/// A reducing collective's exact output: element i is the reduced value at
/// index first + i of the inputs (first = 0 for all-reduce, this rank's
/// block for reduce-scatter).
template <class T, class Op>
void fill_expected(int ranks, std::size_t first, std::span<T> out) {
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = expected_value<T, Op>(ranks, first + i);
}

template <class T>
long long count_differences(std::span<const T> got, std::span<const T> want) {
  long long n = 0;
  for (std::size_t i = 0; i < got.size(); ++i) n += !(got[i] == want[i]);
  return n;
}

/// One rank's buffers, allocated once at the largest size and reused for
/// every size: the first touch of fresh memory is far slower than the
/// collective itself. value-initialisation touches every page up front.
template <class T>
struct Buffers {
  explicit Buffers(std::size_t max_count) : send(max_count), recv(max_count), expected(max_count) {}
  std::vector<T> send, recv, expected;
};

/// One call's shape, as a descriptor sees it.
struct Shape {
  int rank = 0;
  int ranks = 1;
  std::size_t count = 0;  ///< the count column: per-rank elements (see each descriptor)
  int root = -1;          ///< rooted collectives; -1 otherwise
};

}  // namespace bench
