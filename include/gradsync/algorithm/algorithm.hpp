#pragma once
/// \file The primary template every algorithm specialises.

#include <type_traits>

namespace gradsync::detail {

template <class>
inline constexpr bool dependent_false = false;

/// Algorithm<Tag> holds the static functions that run one algorithm:
/// all_reduce, reduce_scatter, all_gather and broadcast, each taking the
/// call's view (CallView<B>) and type-erased buffers. The primary template
/// exists only to say, in one line, that the tag is not an algorithm.
template <class Tag>
struct Algorithm {
  static_assert(dependent_false<Tag>,
                "gradsync: not an algorithm policy; use gradsync::Ring, Tree, RecursiveHalvingDoubling, Native or Auto");
};

}  // namespace gradsync::detail
