#pragma once
/// \file The skeleton every primitive shares once its typed arguments are checked.

#include <concepts>
#include <cstddef>
#include <utility>

#include "gradsync/algorithm/algorithm.hpp"
#include "gradsync/algorithm/auto.hpp"
#include "gradsync/algorithm/entry.hpp"
#include "gradsync/algorithm/native.hpp"
#include "gradsync/algorithm/tags.hpp"
#include "gradsync/core/call_info.hpp"
#include "gradsync/core/call_view.hpp"
#include "gradsync/core/collective.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/options.hpp"

namespace gradsync::detail {

/// The primitives' way into Communicator::run, which users do not see.
struct RunCall {
  template <class B, class F>
  static void run(Communicator<B>& comm, const CallInfo& call, F&& body) {
    comm.run(call, std::forward<F>(body));
  }
};

/// Describes collective C (`count` as every rank passes it), runs it as one
/// call of the communicator, and hands the operands to algorithm Algo.
/// Compiled once per collective, algorithm and backend: the element type is
/// a run-time value from here down.
template <Collective C, class Algo, class B>
void launch(Communicator<B>& comm, const Operands& o, std::size_t count) {
  if constexpr (std::same_as<Algo, Native> && !HasNative<B>) {
    // One line of error, not the static_assert plus every missing member.
    Algorithm<Native>::require<B>();
  } else {
    CallInfo call{C, Algo::name, o.out.type(), o.op, count, o.root, o.options->deterministic};
    call.chunk_bytes = chunk_bytes(*o.options);
    call.label = o.options->label;
    RunCall::run(comm, call, [&](CallView<B>& view) { entry<Algorithm<Algo>, C>(view, o); });
  }
}

}  // namespace gradsync::detail
