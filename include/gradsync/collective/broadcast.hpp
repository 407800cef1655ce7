#pragma once
/// \file Broadcast: every rank ends with the root's buffer.

#include <ranges>
#include <span>
#include <string>
#include <type_traits>

#include "gradsync/collective/primitive_call.hpp"

namespace gradsync {

/// `Broadcast<Algo>{options}(comm, buf, root)`.
///
/// \tparam Algo  Ring, Tree, RecursiveHalvingDoubling, Native or Auto.
template <class Algo = Auto>
struct Broadcast {
  using algorithm = Algo;
  Options options{};

  template <class B, Element T>
  void operator()(Communicator<B>& comm, std::span<T> buf, int root) const {
    const detail::PrimitiveCall<Collective::broadcast, Algo, B> call{comm, options};
    if (root < 0 || root >= comm.size()) {
      call.reject("root must be in [0, " + std::to_string(comm.size()) + "), got " + std::to_string(root));
    }
    call.run(buf, buf, OpKind::sum, root, buf.size());
  }

  template <class B, std::ranges::contiguous_range R>
    requires(!std::is_const_v<std::remove_reference_t<std::ranges::range_reference_t<R>>>)
  void operator()(Communicator<B>& comm, R&& buf, int root) const {
    (*this)(comm, std::span(buf), root);
  }
};

}  // namespace gradsync
