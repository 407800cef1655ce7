#pragma once
/// \file The skeleton every primitive shares once its typed arguments are checked.

#include <concepts>
#include <cstddef>
#include <string_view>
#include <utility>

#include "gradsync/algorithm/algorithm.hpp"
#include "gradsync/algorithm/auto.hpp"
#include "gradsync/algorithm/entry.hpp"
#include "gradsync/algorithm/native.hpp"
#include "gradsync/algorithm/recursive_halving_doubling.hpp"
#include "gradsync/algorithm/tags.hpp"
#include "gradsync/core/algorithm_id.hpp"
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

/// The algorithm as the ranks must agree on it. Auto's pick and RHD's path
/// for an all-reduce (short or halving) follow each process's cost model,
/// which ranks may have been given differently (GRADSYNC_COST_MODEL): named
/// in the call, a difference is a disagreement every rank reports at once,
/// instead of peers waiting in exchanges that never match until the deadline.
template <Collective C, class Algo, class B>
std::string_view agreed_algorithm(int world, const Operands& o) {
  if constexpr (std::same_as<Algo, Auto> || std::same_as<Algo, RecursiveHalvingDoubling>) {
    // Asked only where RHD runs: the cost model is not read on Auto's other picks.
    auto rhd_short = [&] {
      return C == Collective::all_reduce && world > 1 && !o.options->deterministic &&
             Algorithm<RecursiveHalvingDoubling>::short_path<B>(world, o.out.size_bytes());
    };
    if constexpr (std::same_as<Algo, RecursiveHalvingDoubling>) {
      return rhd_short() ? "rhd-short" : "rhd";
    } else {
      switch (auto_pick<B>(world, C, auto_bytes(C, o))) {
        case AlgorithmId::tree: return "auto:tree";
        case AlgorithmId::rhd: return rhd_short() ? "auto:rhd-short" : "auto:rhd";
        case AlgorithmId::native: return "auto:native";
        default: return "auto:ring";
      }
    }
  } else {
    return Algo::name;
  }
}

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
    CallInfo call{C, agreed_algorithm<C, Algo, B>(comm.size(), o), o.out.type(), o.op, count, o.root,
                  o.options->deterministic};
    call.chunk_bytes = chunk_bytes(*o.options);
    call.label = o.options->label;
    RunCall::run(comm, call, [&](CallView<B>& view) { entry<Algorithm<Algo>, C>(view, o); });
  }
}

}  // namespace gradsync::detail
