#pragma once
/// \file The algorithm policies a primitive is templated on.

#include <string_view>

#include "gradsync/core/algorithm_id.hpp"

namespace gradsync {

/// Bandwidth-optimal ring: reduce-scatter then all-gather, pipelined in chunks.
struct Ring {
  static constexpr AlgorithmId id = AlgorithmId::ring;
  static constexpr std::string_view name = gradsync::name(id);
};
/// NCCL-style double binary tree, pipelined in chunks.
struct Tree {
  static constexpr AlgorithmId id = AlgorithmId::tree;
  static constexpr std::string_view name = gradsync::name(id);
};
/// Rabenseifner: reduce-scatter by recursive halving, all-gather by recursive
/// doubling, with a fold for world sizes that are not a power of two; a short
/// all-reduce runs recursive doubling alone.
struct RecursiveHalvingDoubling {
  static constexpr AlgorithmId id = AlgorithmId::rhd;
  static constexpr std::string_view name = gradsync::name(id);
};
/// The backend's own best path (shared memory on Threads, MPI_* on Mpi).
struct Native {
  static constexpr AlgorithmId id = AlgorithmId::native;
  static constexpr std::string_view name = gradsync::name(id);
};
/// Chooses among the others per call with the backend's cost model.
struct Auto {
  static constexpr AlgorithmId id = AlgorithmId::automatic;
  static constexpr std::string_view name = gradsync::name(id);
};

}  // namespace gradsync
