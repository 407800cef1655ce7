#pragma once
/// \file The algorithm policies a primitive is templated on.

#include <string_view>

#include "gradsync/core/algorithm_id.hpp"

namespace gradsync {

namespace detail {

/// What every algorithm tag is: its id, and the name diagnostics print.
template <AlgorithmId Id>
struct AlgorithmTag {
  static constexpr AlgorithmId id = Id;
  static constexpr std::string_view name = gradsync::name(Id);
};

}  // namespace detail

/// Bandwidth-optimal ring: reduce-scatter then all-gather, pipelined in chunks.
struct Ring : detail::AlgorithmTag<AlgorithmId::ring> {};
/// NCCL-style double binary tree, pipelined in chunks.
struct Tree : detail::AlgorithmTag<AlgorithmId::tree> {};
/// Rabenseifner: reduce-scatter by recursive halving, all-gather by recursive
/// doubling, with a fold for world sizes that are not a power of two; a short
/// all-reduce runs recursive doubling alone.
struct RecursiveHalvingDoubling : detail::AlgorithmTag<AlgorithmId::rhd> {};
/// The backend's own best path (shared memory on Threads, MPI_* on Mpi).
struct Native : detail::AlgorithmTag<AlgorithmId::native> {};
/// Chooses among the others per call with the backend's cost model.
struct Auto : detail::AlgorithmTag<AlgorithmId::automatic> {};

}  // namespace gradsync
