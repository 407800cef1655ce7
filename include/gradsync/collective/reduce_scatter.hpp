#pragma once
/// \file ReduceScatter: rank r ends with block r of op over all ranks' inputs.

#include <cstddef>
#include <span>
#include <string>
#include <type_traits>

#include "gradsync/algorithm/tags.hpp"
#include "gradsync/collective/launch.hpp"
#include "gradsync/core/collective.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/types.hpp"
#include "gradsync/core/validate.hpp"

namespace gradsync {

/// `ReduceScatter<Algo>{options}(comm, in, out, op)`, where
/// `in.size() == out.size() * comm.size()` and rank r gets block r.
///
/// \tparam Algo  Ring, Tree, RecursiveHalvingDoubling, Native or Auto.
template <class Algo = Auto>
struct ReduceScatter {
  using algorithm = Algo;
  Options options{};

  template <class B, Element T, ReduceOp Op = Sum>
  void operator()(Communicator<B>& comm, std::type_identity_t<std::span<const T>> in, std::span<T> out, Op = {}) const {
    constexpr std::string_view what = "ReduceScatter";
    const auto p = static_cast<std::size_t>(comm.size());
    if (in.size() != out.size() * p) {
      detail::invalid(what, detail::who(comm), "expected in.size() == out.size() * comm.size() = " + std::to_string(out.size()) +
                                             " * " + std::to_string(p) + " = " + std::to_string(out.size() * p) +
                                             ", got in.size() = " + std::to_string(in.size()));
    }
    if (detail::any_overlap(in, std::span<const T>(out))) {
      detail::invalid(what, detail::who(comm), "in and out overlap; reduce-scatter needs separate buffers");
    }
    detail::launch<Collective::reduce_scatter, Algo>(comm, {in, out, Op::kind, -1, &options}, out.size());
  }
};

}  // namespace gradsync
