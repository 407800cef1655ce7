#pragma once
/// \file The algorithm policies a primitive is templated on.

#include <string_view>

namespace gradsync {

/// Bandwidth-optimal ring: reduce-scatter then all-gather, pipelined in chunks.
struct Ring {
  static constexpr std::string_view name = "ring";
};
/// NCCL-style double binary tree, pipelined in chunks.
struct Tree {
  static constexpr std::string_view name = "tree";
};
/// Rabenseifner: reduce-scatter by recursive halving, all-gather by recursive
/// doubling, with a fold for world sizes that are not a power of two; a short
/// all-reduce runs recursive doubling alone.
struct RecursiveHalvingDoubling {
  static constexpr std::string_view name = "rhd";
};
/// The backend's own best path (shared memory on Threads, MPI_* on Mpi).
struct Native {
  static constexpr std::string_view name = "native";
};
/// Chooses among the others per call with the backend's cost model.
struct Auto {
  static constexpr std::string_view name = "auto";
};

}  // namespace gradsync
