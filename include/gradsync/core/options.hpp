#pragma once
/// \file Per-call options shared by every primitive.

#include <chrono>
#include <cstddef>

#include "gradsync/core/call_label.hpp"

namespace gradsync {

/// Options a primitive carries: `AllReduce<Ring>{{.deterministic = true}}`.
struct Options {
  /// Reduce each element in rank order 0, 1, ..., N-1, so AllReduce and
  /// ReduceScatter give bitwise-identical results across runs and across
  /// algorithms at a fixed world size. Ring, Tree and RecursiveHalvingDoubling
  /// then do their reduction as a rank-ordered reduce-scatter (each block's
  /// owner folds the N contributions in order) and keep their own pattern for
  /// distributing the result; Native is rank-ordered already.
  bool deterministic = false;

  /// Largest piece a pipelined algorithm sends at once. 0 picks the default.
  std::size_t chunk_bytes = 0;

  /// What this call moves (CallLabel): ranks that pass different labels get
  /// InvalidArgument on every rank, as for different counts. Empty: none.
  CallLabel label{};
};

namespace detail {
inline constexpr std::size_t default_chunk_bytes = std::size_t{1} << 19;
/// The deadline of every wait unless a communicator is told otherwise:
/// long enough for any real collective, short enough that a lost rank ends
/// the job rather than the job's allocation.
inline constexpr std::chrono::seconds default_timeout{300};
inline std::size_t chunk_bytes(const Options& o) noexcept {
  return o.chunk_bytes ? o.chunk_bytes : default_chunk_bytes;
}
}  // namespace detail

}  // namespace gradsync
