#pragma once
/// \file AllReduce: every rank ends with op over all ranks' buffers.

#include <ranges>
#include <span>
#include <string>
#include <type_traits>

#include "gradsync/collective/primitive_call.hpp"
#include "gradsync/core/ops.hpp"

namespace gradsync {

/// `AllReduce<Algo>{options}(comm, inout, op)` or `(comm, in, out, op)`.
///
/// \tparam Algo  Ring, Tree, RecursiveHalvingDoubling, Native or Auto.
template <class Algo = Auto>
struct AllReduce {
  using algorithm = Algo;
  Options options{};

  /// In place.
  template <class B, Element T, ReduceOp Op = Sum>
  void operator()(Communicator<B>& comm, std::span<T> inout, Op op = {}) const {
    (*this)(comm, std::span<const T>(inout), inout, op);
  }

  /// Out of place: `in` and `out` have the same size and are either the same
  /// span or disjoint.
  template <class B, Element T, ReduceOp Op = Sum>
  void operator()(Communicator<B>& comm, std::type_identity_t<std::span<const T>> in, std::span<T> out, Op = {}) const {
    const detail::PrimitiveCall<Collective::all_reduce, Algo, B> call{comm, options};
    if (in.size() != out.size()) {
      call.reject("in and out must have the same size, got in.size() = " + std::to_string(in.size()) +
                  " and out.size() = " + std::to_string(out.size()));
    }
    if (detail::partially_overlap(in, std::span<const T>(out))) {
      call.reject("in and out overlap without being the same buffer; pass one span for in place");
    }
    call.run(in, out, Op::kind, -1, in.size());
  }

  /// Any contiguous range (std::vector, std::array, ...), in place.
  template <class B, std::ranges::contiguous_range R, ReduceOp Op = Sum>
    requires(!std::is_const_v<std::remove_reference_t<std::ranges::range_reference_t<R>>>)
  void operator()(Communicator<B>& comm, R&& inout, Op op = {}) const {
    (*this)(comm, std::span(inout), op);
  }
};

}  // namespace gradsync
