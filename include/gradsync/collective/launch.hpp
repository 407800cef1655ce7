#pragma once
/// \file The skeleton every primitive shares once its typed arguments are checked.

#include <cstddef>

#include "gradsync/algorithm/algorithm.hpp"
#include "gradsync/algorithm/auto.hpp"
#include "gradsync/algorithm/entry.hpp"
#include "gradsync/algorithm/native.hpp"
#include "gradsync/algorithm/tags.hpp"
#include "gradsync/core/call_info.hpp"
#include "gradsync/core/collective.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/options.hpp"

namespace gradsync::detail {

/// Describes collective C (`count` as every rank passes it), runs it as one
/// call of the communicator, and hands the operands to algorithm Algo.
/// Compiled once per collective, algorithm and backend: the element type is
/// a run-time value from here down.
template <Collective C, class Algo, class B>
void launch(Communicator<B>& comm, const Operands& o, std::size_t count) {
  if constexpr (std::same_as<Algo, Native>) Algorithm<Native>::require<B>();
  CallInfo call{C, Algo::name, o.out.type(), o.op, count, o.root, o.options->deterministic};
  call.chunk_bytes = chunk_bytes(*o.options);
  comm.run(call, [&](const CallInfo&) { entry<Algorithm<Algo>, C>(comm, o); });
}

}  // namespace gradsync::detail
