#pragma once
/// \file One call's operands, and the one signature every algorithm runs under.
///
/// A primitive checks its typed arguments, then hands the algorithm these
/// type-erased operands. Every algorithm is thus compiled once per backend
/// and collective, whatever the element types a program uses, and Auto can
/// pick one from a table of plain function pointers.

#include "gradsync/algorithm/algorithm.hpp"
#include "gradsync/core/buffer.hpp"
#include "gradsync/core/collective.hpp"
#include "gradsync/core/call_view.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/options.hpp"

namespace gradsync::detail {

/// What one collective works on. Broadcast's buffer is `out` (and `in`).
struct Operands {
  ConstBuffer in;
  Buffer out;
  OpKind op = OpKind::sum;
  int root = -1;
  const Options* options = nullptr;
};

/// An algorithm's entry for one collective, over backend B.
template <class B>
using Entry = void (*)(CallView<B>&, const Operands&);

/// Runs collective C of algorithm A (an Algorithm<Tag>) on `o`.
template <class A, Collective C, class B>
void entry(CallView<B>& comm, const Operands& o) {
  if constexpr (C == Collective::all_reduce) {
    A::all_reduce(comm, o.in, o.out, o.op, *o.options);
  } else if constexpr (C == Collective::reduce_scatter) {
    A::reduce_scatter(comm, o.in, o.out, o.op, *o.options);
  } else if constexpr (C == Collective::all_gather) {
    A::all_gather(comm, o.in, o.out, *o.options);
  } else {
    static_assert(C == Collective::broadcast, "gradsync: a barrier has no algorithm");
    A::broadcast(comm, o.out, o.root, *o.options);
  }
}

}  // namespace gradsync::detail
