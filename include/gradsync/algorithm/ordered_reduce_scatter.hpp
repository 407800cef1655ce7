#pragma once
/// \file Reduce-scatter with every element folded in rank order 0..N-1.
///
/// The deterministic option runs every algorithm's reduction through this:
/// each rank sends block q of its input straight to rank q, and rank q folds
/// the N contributions in rank order. It moves the same (N-1)/N of the data
/// per rank as a ring reduce-scatter, in N-1 rounds of latency.

#include <cstddef>
#include <cstdint>

#include "gradsync/core/buffer.hpp"
#include "gradsync/core/call_view.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/partition.hpp"

namespace gradsync::detail {

/// Waits until the operation with `token` completes (others may complete first).
template <class B>
void wait_for(CallView<B>& comm, std::uint32_t token) {
  while (comm.wait_any() != token) {
  }
}

/// `in` holds this rank's contribution to all blocks, laid out as `blocks(q)`
/// ranges; `out` (block `rank` in size) receives the rank-ordered fold of block
/// `rank`. `out` may alias in's own block.
///
/// Every contribution lands in its own slot of a work buffer, all in one
/// round of sends and receives, and only then is folded. Receiving in rank
/// order instead would save the buffer but chain each receive behind the
/// last, which backends that match messages in issue order (NCCL) cannot do
/// without deadlock on 3 or more ranks.
template <class B, class BlockOf>
void ordered_reduce_scatter(CallView<B>& comm, ConstBuffer in, Buffer out, OpKind op,
                            BlockOf blocks) {
  const int p = comm.size();
  const int r = comm.rank();
  const std::size_t m = out.size();
  auto slots = comm.scratch(out.type(), m * static_cast<std::size_t>(p), 1);
  auto slot = [&](int q) { return slots.subspan(m * static_cast<std::size_t>(q), m); };
  for (int q = 0; q < p; ++q) {
    if (q == r) continue;
    const Range b = blocks(q);
    comm.recv(slot(q), q, 0, 1);
    comm.send(in.subspan(b.begin, b.size()), q, 0, 0);
  }
  const Range mine = blocks(r);
  comm.copy(slot(r), in.subspan(mine.begin, mine.size()));
  comm.wait_all();
  comm.copy(out, ConstBuffer(slot(0)));
  for (int q = 1; q < p; ++q) comm.reduce(out, ConstBuffer(slot(q)), op);
  comm.finish(out, op);
}

/// Where Ring, Tree and RHD's reduce-scatters start: a deterministic call, or
/// one rank, is the rank-ordered fold of equal blocks. Returns whether it ran.
template <class B>
bool reduce_scatter_in_rank_order(CallView<B>& comm, ConstBuffer in, Buffer out, OpKind op, const Options& opt) {
  if (!opt.deterministic && comm.size() > 1) return false;
  ordered_reduce_scatter(comm, in, out, op, EqualBlocks{out.size()});
  return true;
}

}  // namespace gradsync::detail
