#pragma once
/// \file Reduce-scatter with every element folded in rank order 0..N-1.
///
/// The deterministic option runs every algorithm's reduction through this:
/// each rank sends block q of its input straight to rank q, and rank q folds
/// the N contributions in rank order. It moves the same (N-1)/N of the data
/// per rank as a ring reduce-scatter, in N-1 rounds of latency.

#include <cstddef>
#include <cstdint>
#include <span>

#include "gradsync/core/communicator.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/partition.hpp"

namespace gradsync::detail {

/// Waits until the operation with `token` completes (others may complete first).
template <class B>
void wait_for(Communicator<B>& comm, std::uint32_t token) {
  while (comm.wait_any() != token) {
  }
}

/// `in` holds this rank's contribution to all blocks, laid out as `blocks(q)`
/// ranges; `out` (block `rank` in size) receives the rank-ordered fold of block
/// `rank`. `out` may alias in's own block.
template <ReduceOp Op, class B, class T, class BlockOf>
void ordered_reduce_scatter(Communicator<B>& comm, std::span<const T> in, std::span<T> out, BlockOf blocks) {
  const int p = comm.size();
  const int r = comm.rank();
  constexpr std::uint32_t send_token = 0xffffffffu;
  const Range mine = blocks(r);
  // Our own contribution is needed at position r of the fold, after out has
  // been overwritten by lower ranks' data; keep it aside when they alias.
  std::span<const T> own = in.subspan(mine.begin, mine.size());
  if (r != 0 && own.data() == out.data()) {
    auto keep = comm.template scratch<T>(own.size(), 1);
    comm.copy(keep, own);
    own = keep;
  }
  for (int q = 0; q < p; ++q) {
    if (q == r) continue;
    const Range b = blocks(q);
    comm.send(in.subspan(b.begin, b.size()), q, 0, send_token);
  }
  for (int q = 0; q < p; ++q) {
    if (q == r) {
      if (q == 0) {
        comm.copy(out, own);
      } else {
        comm.template reduce<Op>(out, own);
      }
      continue;
    }
    if (q == 0) {
      comm.recv(out, q, 0, static_cast<std::uint32_t>(q));
    } else {
      comm.template recv_reduce<Op>(out, q, 0, static_cast<std::uint32_t>(q));
    }
    wait_for(comm, static_cast<std::uint32_t>(q));
  }
  comm.wait_all();
  comm.template finish<Op>(out);
}

}  // namespace gradsync::detail
