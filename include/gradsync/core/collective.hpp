#pragma once
/// \file Names of the four collectives, for diagnostics and the cost model.

#include <cstdint>
#include <string_view>

namespace gradsync {

/// The collectives, and the two calls that move no user data (barrier, and
/// split, which makes a sub-communicator): every numbered call has one.
enum class Collective : std::uint8_t { all_reduce, reduce_scatter, all_gather, broadcast, barrier, split };

constexpr std::string_view name(Collective c) noexcept {
  switch (c) {
    case Collective::all_reduce: return "AllReduce";
    case Collective::reduce_scatter: return "ReduceScatter";
    case Collective::all_gather: return "AllGather";
    case Collective::broadcast: return "Broadcast";
    case Collective::barrier: return "Barrier";
    case Collective::split: return "Split";
  }
  return "?";
}

}  // namespace gradsync
