#pragma once
/// \file detail::communicates_host_memory: whether a communicator's buffers
/// live in host memory. Both trainers keep their buffers in host vectors and
/// refuse other backends with it.

#include "gradsync/core/backend_traits.hpp"
#include "gradsync/core/communicator.hpp"

namespace gradsync::detail {

/// Whether a communicator's buffers live in host memory. What is not a
/// communicator passes here: its own static_assert says what is wrong.
template <class C>
inline constexpr bool communicates_host_memory = true;
template <class B>
inline constexpr bool communicates_host_memory<Communicator<B>> = backend_traits<B>::host_memory;

}  // namespace gradsync::detail
