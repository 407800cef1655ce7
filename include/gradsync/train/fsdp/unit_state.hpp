#pragma once
/// \file detail::fsdp::MemberState and UnitState: what one step knows of a
/// model unit (asked, held, ready) and of a wrapped unit (its gathered
/// buffers, its gradient buffer, its gather and reduction in flight). The
/// protocol checks are per model unit, the memory and the collectives per
/// wrapped unit, so each has its own record.

#include <cstddef>
#include <span>
#include <vector>

#include "gradsync/core/aligned_allocator.hpp"
#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/request.hpp"
#include "gradsync/train/model.hpp"

namespace gradsync::detail::fsdp {

/// A model unit in this step.
template <class C>
struct MemberState {
  UnitView<C> view;  ///< what the model sees while it holds the unit
  int asks = 0;      ///< in this step: 1 = forward, 2 = backward
  bool held = false;
  bool ready = false;
};

/// Storage of a gathered unit or a gradient buffer of value_type T.
/// Aligned alike in every process: the model's math runs on it, so
/// vectorized sums go in one order whatever else the process allocated.
template <class T>
using Storage = std::vector<T, AlignedAllocator<T>>;

/// A wrapped unit: what is gathered and reduced as one buffer.
template <class T>
struct UnitState {
  Storage<T> full;  ///< gathered parameters, N·c (empty when resharded)
  /// param_dtype bfloat16 under ShardGradOp: the gathered unit as it was
  /// gathered, kept from its forward to its backward while `full` (its
  /// value_type copy, for the model) exists only while the model holds it.
  /// A model computing in bfloat16: the gathered unit itself (no `full`).
  std::vector<bfloat16> low;
  Storage<T> grad;  ///< unsharded gradient, the padded unit N·c (backward; NoSync keeps it)
  /// A model computing in bfloat16: its gradient of this backward, N·c,
  /// added into `grad` once every member is ready (fold_low_grad).
  std::vector<bfloat16> low_grad;
  std::size_t held = 0;   ///< members the model holds
  std::size_t ready = 0;  ///< members reported ready in this backward
  Request request;        ///< the gradient's reduction
  Request gathering;      ///< the gather into `full`, until acquire waits for it

  /// Its parameters are gathered (or being gathered) now.
  bool gathered() const noexcept { return !full.empty() || !low.empty(); }

  /// Bytes its gathered and gradient buffers hold now.
  std::size_t held_bytes() const noexcept {
    return (full.capacity() + grad.capacity()) * sizeof(T) + (low.capacity() + low_grad.capacity()) * sizeof(bfloat16);
  }
};

/// Wrapped units whose parameters are gathered (or being gathered) now:
/// what ShardedTrainerOptions::limit_all_gathers bounds.
template <class T>
std::size_t gathered_units(std::span<const UnitState<T>> units) noexcept {
  std::size_t n = 0;
  for (const UnitState<T>& s : units) n += s.gathered() ? 1 : 0;
  return n;
}

/// Bytes of gathered units and gradient buffers held now.
template <class T>
std::size_t transient_held(std::span<const UnitState<T>> units) noexcept {
  std::size_t held = 0;
  for (const UnitState<T>& s : units) held += s.held_bytes();
  return held;
}

}  // namespace gradsync::detail::fsdp
