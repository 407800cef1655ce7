#pragma once
/// \file AllGather: every rank ends with all ranks' blocks, block r from rank r.

#include <cstddef>
#include <span>
#include <string>
#include <type_traits>

#include "gradsync/algorithm/tags.hpp"
#include "gradsync/collective/launch.hpp"
#include "gradsync/core/collective.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/types.hpp"
#include "gradsync/core/validate.hpp"

namespace gradsync {

/// `AllGather<Algo>{options}(comm, in, out)`, where
/// `out.size() == in.size() * comm.size()`. `in` may be block `rank` of
/// `out` itself (in place); any other overlap is an error.
///
/// \tparam Algo  Ring, Tree, RecursiveHalvingDoubling, Native or Auto.
template <class Algo = Auto>
struct AllGather {
  using algorithm = Algo;
  Options options{};

  template <class B, Element T>
  void operator()(Communicator<B>& comm, std::type_identity_t<std::span<const T>> in, std::span<T> out) const {
    constexpr std::string_view what = "AllGather";
    const auto p = static_cast<std::size_t>(comm.size());
    if (out.size() != in.size() * p) {
      detail::invalid(what, detail::who(comm), "expected out.size() == in.size() * comm.size() = " + std::to_string(in.size()) +
                                             " * " + std::to_string(p) + " = " + std::to_string(in.size() * p) +
                                             ", got out.size() = " + std::to_string(out.size()));
    }
    const auto own = std::span<const T>(out).subspan(in.size() * static_cast<std::size_t>(comm.rank()), in.size());
    const bool in_place = !in.empty() && in.data() == own.data();
    if (!in_place && detail::any_overlap(in, std::span<const T>(out))) {
      detail::invalid(what, detail::who(comm), "in overlaps out; pass out's own block (rank * in.size()) for in place, or a separate buffer");
    }
    detail::launch<Collective::all_gather, Algo>(comm, {in, out, OpKind::sum, -1, &options}, in.size());
  }
};

}  // namespace gradsync
