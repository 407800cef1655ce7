#pragma once
/// \file ReduceScatter: rank r ends with block r of op over all ranks' inputs.

#include <span>
#include <type_traits>

#include "gradsync/collective/primitive_call.hpp"
#include "gradsync/core/ops.hpp"

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
    const detail::PrimitiveCall<Collective::reduce_scatter, Algo, B> call{comm, options};
    call.expect_blocks("in", in.size(), "out", out.size());
    if (detail::any_overlap(in, std::span<const T>(out))) {
      call.reject("in and out overlap; reduce-scatter needs separate buffers");
    }
    call.run(in, out, Op::kind, -1, out.size());
  }
};

}  // namespace gradsync
