#pragma once
/// \file ReductionPolicy: how a bucket of gradients is combined across ranks.
///
/// GradSync plans buckets and tracks readiness; what one bucket's collective
/// is, and where each rank finds its result, is the policy's. Two exist:
/// AllReduceAverage (replicated training: every rank gets the whole mean)
/// and ReduceScatterAverage (sharded training: each rank gets the mean of
/// its 1/N shard).

#include <concepts>
#include <cstddef>

#include "gradsync/core/options.hpp"

namespace gradsync {

/// Where a policy leaves this rank's result in a bucket's storage.
struct ReducedPart {
  /// Index in the storage of the result's first element.
  std::size_t offset = 0;
  /// The bucket element it holds.
  std::size_t first = 0;
  /// Elements of the result.
  std::size_t count = 0;
};

/// What GradSync asks of a reduction policy `P`, besides
/// `p.reduce(comm, std::span<E> storage, std::size_t count, bool mean)`,
/// which combines the `count` elements at the front of `storage` across the
/// ranks of `comm` and, when `mean`, divides by the world size:
///
/// - `P{options}` builds it with the collective's Options;
/// - `P::in_place`: the reduction can run in the gradients' own memory
///   (storage == the `count` elements);
/// - `P::storage(count, world)`: elements the storage must hold (≥ count);
///   those past `count` start as zeros and are the policy's;
/// - `P::result(count, world, rank)`: where the result is afterwards.
///
/// The call is not in the concept because it is a template on the backend
/// and the element type (the gradient type, or bfloat16 when compressed).
template <class P>
concept ReductionPolicy = requires(const P& p, std::size_t n, int world, int rank) {
  P{Options{}};
  { P::in_place } -> std::convertible_to<bool>;
  { P::storage(n, world) } -> std::same_as<std::size_t>;
  { P::result(n, world, rank) } -> std::same_as<ReducedPart>;
};

}  // namespace gradsync
