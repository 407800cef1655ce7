#pragma once
/// \file AllGather: every rank ends with all ranks' blocks, block r from rank r.

#include <cstddef>
#include <span>
#include <type_traits>

#include "gradsync/collective/primitive_call.hpp"

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
    const detail::PrimitiveCall<Collective::all_gather, Algo, B> call{comm, options};
    call.expect_blocks("out", out.size(), "in", in.size());
    const auto own = std::span<const T>(out).subspan(in.size() * static_cast<std::size_t>(comm.rank()), in.size());
    const bool in_place = !in.empty() && in.data() == own.data();
    if (!in_place && detail::any_overlap(in, std::span<const T>(out))) {
      call.reject("in overlaps out; pass out's own block (rank * in.size()) for in place, or a separate buffer");
    }
    call.run(in, out, OpKind::sum, -1, in.size());
  }
};

}  // namespace gradsync
