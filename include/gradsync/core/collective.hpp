#pragma once
/// \file Names of the four collectives, for diagnostics and the cost model.

#include <cstdint>
#include <string_view>

namespace gradsync {

enum class Collective : std::uint8_t { all_reduce, reduce_scatter, all_gather, broadcast, barrier };

constexpr std::string_view name(Collective c) noexcept {
  switch (c) {
    case Collective::all_reduce: return "AllReduce";
    case Collective::reduce_scatter: return "ReduceScatter";
    case Collective::all_gather: return "AllGather";
    case Collective::broadcast: return "Broadcast";
    case Collective::barrier: return "Barrier";
  }
  return "?";
}

}  // namespace gradsync
