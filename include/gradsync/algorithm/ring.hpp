#pragma once
/// \file Ring: reduce-scatter then all-gather around the ring, pipelined.
///
/// At step s rank r sends block (r + shift - s) to its right neighbour and
/// receives block (r + shift - s - 1) from its left one; the first N-1 steps
/// reduce, the rest copy. Each block is cut into chunks and every chunk moves
/// on to the next step as soon as it has arrived, so chunks of different
/// steps are in flight at once. Per rank that is 2(N-1)/N of the data sent,
/// the bandwidth lower bound (Patarasuk & Yuan 2009).

#include <cstddef>
#include <cstdint>

#include "gradsync/algorithm/algorithm.hpp"
#include "gradsync/algorithm/ordered_reduce_scatter.hpp"
#include "gradsync/algorithm/tags.hpp"
#include "gradsync/core/buffer.hpp"
#include "gradsync/core/call_view.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/partition.hpp"

namespace gradsync::detail {

inline int mod(int a, int p) noexcept { return ((a % p) + p) % p; }

/// Runs ring steps [first, last) on x, split into `parts` blocks of
/// block(count, parts, i). Steps below `reduce_steps` reduce; the step that
/// completes a block's reduction (reduce_steps - 1) also applies op's finish.
/// A non-empty `step0_src` (same size as x) is where step 0's sends read
/// from: its block is one this rank never reduces into, so the caller need
/// not have copied it into x.
template <class B>
void ring_steps(CallView<B>& comm, Buffer x, OpKind op, int shift, int first, int last, int reduce_steps,
                const Options& opt, ConstBuffer step0_src = {}) {
  const int p = comm.size();
  const int r = comm.rank();
  if (first >= last) return;
  const int right = mod(r + 1, p);
  const int left = mod(r - 1, p);
  const std::size_t n = x.size();
  const std::size_t biggest = (n + static_cast<std::size_t>(p) - 1) / static_cast<std::size_t>(p);
  const std::size_t k_chunks = pieces_for(biggest, chunk_bytes(opt) / x.element_size());
  auto range = [&](int blk, std::size_t k) {
    return sub(block(n, static_cast<std::size_t>(p), static_cast<std::size_t>(blk)), k_chunks, k);
  };
  auto chunk = [&](int blk, std::size_t k) {
    const Range b = range(blk, k);
    return x.subspan(b.begin, b.size());
  };
  // Tokens: (step * chunks + chunk) * 2 + 1 for receives, 0 for sends.
  auto post = [&](int s, std::size_t k) {
    const auto id = static_cast<std::uint32_t>(static_cast<std::size_t>(s) * k_chunks + k);
    const int out_blk = mod(r + shift - s, p);
    if (s == 0 && !step0_src.empty()) {
      const Range b = range(out_blk, k);
      comm.send(step0_src.subspan(b.begin, b.size()), right, id, 0);
    } else {
      comm.send(ConstBuffer(chunk(out_blk, k)), right, id, 0);
    }
    auto dst = chunk(mod(r + shift - s - 1, p), k);
    if (s < reduce_steps) {
      comm.recv_reduce(dst, left, id, id * 2 + 1, op);
    } else {
      comm.recv(dst, left, id, id * 2 + 1);
    }
  };
  for (std::size_t k = 0; k < k_chunks; ++k) post(first, k);
  std::size_t receives_left = static_cast<std::size_t>(last - first) * k_chunks;
  while (receives_left) {
    const std::uint32_t t = comm.wait_any();
    if ((t & 1u) == 0) continue;
    --receives_left;
    const std::size_t id = t >> 1;
    const int s = static_cast<int>(id / k_chunks);
    const std::size_t k = id % k_chunks;
    if (s == reduce_steps - 1) comm.finish(chunk(mod(r + shift - s - 1, p), k), op);
    if (s + 1 < last) post(s + 1, k);
  }
  comm.wait_all();
}

template <>
struct Algorithm<Ring> {
  template <class B>
  static void all_reduce(CallView<B>& comm, ConstBuffer in, Buffer out, OpKind op,
                         const Options& opt) {
    const int p = comm.size();
    if (p == 1 || opt.deterministic || in.data() == out.data()) {
      comm.copy(out, in);
    } else {
      // Out of place: block r is sent at step 0 straight from `in` and only
      // ever received back whole (never reduced into here), so it is the one
      // block not copied first: 1/N of the copy saved.
      const Range mine = block(out.size(), static_cast<std::size_t>(p), static_cast<std::size_t>(comm.rank()));
      comm.copy(out.first(mine.begin), in.first(mine.begin));
      comm.copy(out.subspan(mine.end), in.subspan(mine.end));
      return ring_steps(comm, out, op, 0, 0, 2 * (p - 1), p - 1, opt, in);
    }
    if (p == 1) return comm.finish(out, op);
    if (opt.deterministic) {
      const Range mine = block(out.size(), static_cast<std::size_t>(p), static_cast<std::size_t>(comm.rank()));
      ordered_reduce_scatter(comm, ConstBuffer(out), out.subspan(mine.begin, mine.size()), op, [&](int q) {
        return block(out.size(), static_cast<std::size_t>(p), static_cast<std::size_t>(q));
      });
      // Rank r owns block r, which the all-gather steps expect at step N-1.
      return ring_steps(comm, out, op, p - 1, p - 1, 2 * (p - 1), 0, opt);
    }
    ring_steps(comm, out, op, 0, 0, 2 * (p - 1), p - 1, opt);
  }

  template <class B>
  static void reduce_scatter(CallView<B>& comm, ConstBuffer in, Buffer out, OpKind op,
                             const Options& opt) {
    if (reduce_scatter_in_rank_order(comm, in, out, op, opt)) return;
    const int p = comm.size();
    // Shift -1 leaves rank r holding block r after N-1 reducing steps.
    auto work = comm.scratch(in.type(), in.size());
    comm.copy(work, in);
    ring_steps(comm, work, op, -1, 0, p - 1, p - 1, opt);
    const Range mine = EqualBlocks{out.size()}(comm.rank());
    comm.copy(out, ConstBuffer(work.subspan(mine.begin, mine.size())));
  }

  template <class B>
  static void all_gather(CallView<B>& comm, ConstBuffer in, Buffer out, const Options& opt) {
    const int p = comm.size();
    const std::size_t m = in.size();
    comm.copy(out.subspan(m * static_cast<std::size_t>(comm.rank()), m), in);
    ring_steps(comm, out, OpKind::sum, p - 1, p - 1, 2 * (p - 1), 0, opt);
  }

  /// A pipelined chain from the root around the ring.
  template <class B>
  static void broadcast(CallView<B>& comm, Buffer buf, int root, const Options& opt) {
    const int p = comm.size();
    if (p == 1) return;
    const int r = comm.rank();
    const int pos = mod(r - root, p);
    const int next = mod(r + 1, p);
    const int prev = mod(r - 1, p);
    const std::size_t k_chunks = pieces_for(buf.size(), chunk_bytes(opt) / buf.element_size());
    auto chunk = [&](std::size_t k) {
      const Range c = block(buf.size(), k_chunks, k);
      return buf.subspan(c.begin, c.size());
    };
    const bool forwards = pos != p - 1;
    for (std::size_t k = 0; k < k_chunks; ++k) {
      const auto id = static_cast<std::uint32_t>(k);
      if (pos == 0) {
        comm.send(ConstBuffer(chunk(k)), next, id, 0);
      } else {
        comm.recv(chunk(k), prev, id, id * 2 + 1);
      }
    }
    if (pos != 0) {
      for (std::size_t left = k_chunks; left;) {
        const std::uint32_t t = comm.wait_any();
        if ((t & 1u) == 0) continue;
        --left;
        const std::uint32_t id = t >> 1;
        if (forwards) comm.send(ConstBuffer(chunk(id)), next, id, 0);
      }
    }
    comm.wait_all();
  }
};

}  // namespace gradsync::detail
