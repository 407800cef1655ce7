#pragma once
/// \file RecursiveHalvingDoubling: Rabenseifner's algorithm.
///
/// Reduce-scatter by recursive halving (lg p' exchanges, each half the size
/// of the last), then all-gather by recursive doubling: 2 lg p' messages and
/// 2(p'-1)/p' of the data per rank. For a world size that is not a power of
/// two, the first 2r ranks (r = p - p') pair up and fold: one of each pair
/// hands its data to the other before and gets the result back after
/// (Thakur, Rabenseifner & Gropp 2005).
///
/// A short all-reduce is latency-bound, so it skips the halving and runs
/// recursive doubling on whole buffers: lg p' exchanges instead of 2 lg p',
/// each carrying everything. MPICH splits the two at a fixed 2 KiB
/// (MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE; Thakur et al. 2005, section 4.4);
/// here the backend's cost model decides, since the crossover moves with the
/// world size and with the transport's eager limit (on Open MPI's shared
/// memory, 2 ranks: up to 16 KiB).

#include <cstddef>
#include <cstdint>
#include <optional>

#include "gradsync/algorithm/algorithm.hpp"
#include "gradsync/algorithm/ordered_reduce_scatter.hpp"
#include "gradsync/algorithm/ring.hpp"
#include "gradsync/algorithm/tags.hpp"
#include "gradsync/core/buffer.hpp"
#include "gradsync/core/call_view.hpp"
#include "gradsync/core/cost_model.hpp"
#include "gradsync/core/cost_model_env.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/partition.hpp"

namespace gradsync::detail {

/// The power-of-two group and how a rank maps onto it.
struct Fold {
  int p = 1;      ///< world size
  int pow2 = 1;   ///< largest power of two <= p
  int extra = 0;  ///< p - pow2: pairs that fold
  /// With keep_odd, pair (2i, 2i+1) is represented by 2i+1 (reductions, whose
  /// result the odd rank hands back); otherwise by 2i (broadcast, so that
  /// relative rank 0, the root, always takes part).
  bool keep_odd = true;

  explicit Fold(int size, bool odd = true) : p(size), keep_odd(odd) {
    while (pow2 * 2 <= p) pow2 *= 2;
    extra = p - pow2;
  }
  /// Virtual rank in the power-of-two group, or -1 if r only folds.
  int virt(int r) const noexcept {
    if (r >= 2 * extra) return r - extra;
    return (r % 2 == 1) == keep_odd ? r / 2 : -1;
  }
  int real(int v) const noexcept { return v < extra ? 2 * v + (keep_odd ? 1 : 0) : v + extra; }
  /// The folding partner of a rank in a pair; -1 outside the pairs.
  int partner(int r) const noexcept { return r < 2 * extra ? (r ^ 1) : -1; }
  /// First real rank (= block) that virtual rank v stands for.
  int first_block(int v) const noexcept { return v < extra ? 2 * v : v + extra; }
};

/// One exchange with a partner: send `out`, receive `in` (reducing with op
/// unless it is empty), and wait for both.
template <class B>
void exchange(CallView<B>& comm, int peer, std::uint32_t tag, ConstBuffer out, Buffer in,
              std::optional<OpKind> op) {
  if (op) {
    comm.recv_reduce(in, peer, tag, 1, *op);
  } else {
    comm.recv(in, peer, tag, 1);
  }
  comm.send(out, peer, tag, 0);
  comm.wait_all();
}

/// Recursive halving over virtual parts; `range(a, b)` maps a run of parts
/// to elements of x. Leaves virtual rank v's part reduced (not finished).
/// With `src` (out of place), x starts empty: the first step sends its half
/// straight from src and copies in only the half it keeps.
template <class B, class RangeOf>
void halving(CallView<B>& comm, Buffer x, OpKind op, const Fold& f, int v, RangeOf range,
             ConstBuffer src = {}) {
  // The parts [held_begin, held_end) still to reduce here; each step keeps
  // the half v's bit d selects and gives the partner the other.
  int held_begin = 0;
  int held_end = f.pow2;
  for (int d = f.pow2 / 2, step = 0; d >= 1; d /= 2, ++step) {
    const int mid = held_begin + (held_end - held_begin) / 2;
    const bool keeps_first_half = (v & d) == 0;
    const Range keep = keeps_first_half ? range(held_begin, mid) : range(mid, held_end);
    const Range give = keeps_first_half ? range(mid, held_end) : range(held_begin, mid);
    ConstBuffer from(x);
    if (step == 0 && !src.empty()) {
      comm.copy(x.subspan(keep.begin, keep.size()), src.subspan(keep.begin, keep.size()));
      from = src;
    }
    exchange(comm, f.real(v ^ d), static_cast<std::uint32_t>(step), from.subspan(give.begin, give.size()),
             x.subspan(keep.begin, keep.size()), op);
    if (keeps_first_half) {
      held_end = mid;
    } else {
      held_begin = mid;
    }
  }
}

/// Recursive doubling: starting from virtual rank v's part, swap ever larger
/// aligned runs of parts with the partner until everyone holds all.
template <class B, class RangeOf>
void doubling(CallView<B>& comm, Buffer x, const Fold& f, int v, RangeOf range) {
  for (int d = 1, step = 32; d < f.pow2; d *= 2, ++step) {
    const int mine = v & ~(d - 1);
    const int theirs = (v ^ d) & ~(d - 1);
    const Range give = range(mine, mine + d);
    const Range take = range(theirs, theirs + d);
    exchange(comm, f.real(v ^ d), static_cast<std::uint32_t>(step), ConstBuffer(x.subspan(give.begin, give.size())),
                  x.subspan(take.begin, take.size()), std::nullopt);
  }
}

template <>
struct Algorithm<RecursiveHalvingDoubling> {
  static constexpr std::uint32_t fold_tag = 100;
  static constexpr std::uint32_t unfold_tag = 101;
  /// Tags of the short path's steps: 64 + step, clear of halving's 0.. and
  /// doubling's 32.. (at most 31 steps each).
  static constexpr std::uint32_t short_tag = 64;
  /// Whether an all-reduce of `bytes` per rank takes the short path, by the
  /// backend's cost model. Remembered for the last size per thread: a
  /// training loop repeats its sizes, and this sits on an 8-byte call's path.
  template <class B>
  static bool short_path(int p, std::size_t bytes) {
    struct Memo {
      const CostModel* model = nullptr;
      int p = 0;
      std::size_t bytes = 0;
      bool value = false;
    };
    thread_local Memo memo;
    const CostModel& m = cost_model<B>();
    if (memo.model != &m || memo.p != p || memo.bytes != bytes) {
      memo = {&m, p, bytes, rhd_all_reduce_short(p, static_cast<double>(bytes), m)};
    }
    return memo.value;
  }

  template <class B>
  static void all_reduce(CallView<B>& comm, ConstBuffer in, Buffer out, OpKind op,
                         const Options& opt) {
    const int p = comm.size();
    const int r = comm.rank();
    const Fold f(p);
    const int v = f.virt(r);
    const int partner = f.partner(r);
    // Out of place, a rank outside the fold pairs on the halving path sends
    // its first half straight from `in` (see halving): half the copy saved.
    const bool whole = p > 1 && !opt.deterministic && short_path<B>(p, out.size_bytes());
    const bool from_in = p > 1 && !opt.deterministic && in.data() != out.data() && partner < 0 && !whole;
    if (!from_in) comm.copy(out, in);
    if (p == 1) return comm.finish(out, op);
    if (opt.deterministic) {
      const auto blocks = [&](int q) { return block(out.size(), static_cast<std::size_t>(p), static_cast<std::size_t>(q)); };
      const Range mine = blocks(r);
      ordered_reduce_scatter(comm, ConstBuffer(out), out.subspan(mine.begin, mine.size()), op, blocks);
      return gather_blocks(comm, out, blocks);
    }
    if (v < 0) {
      // Send and receive share the buffer, so one after the other.
      comm.send(ConstBuffer(out), partner, fold_tag, 0);
      comm.wait_all();
      comm.recv(out, partner, unfold_tag, 1);
      comm.wait_all();
      return;
    }
    if (partner >= 0) {
      comm.recv_reduce(out, partner, fold_tag, 1, op);
      comm.wait_all();
    }
    const std::size_t n = out.size();
    if (whole) {
      whole_doubling(comm, out, op, f, v);
    } else {
      auto range = [&](int a, int b) {
        return Range{block(n, static_cast<std::size_t>(f.pow2), static_cast<std::size_t>(a)).begin,
                     block(n, static_cast<std::size_t>(f.pow2), static_cast<std::size_t>(b - 1)).end};
      };
      halving(comm, out, op, f, v, range, from_in ? in : ConstBuffer{});
      const Range own = range(v, v + 1);
      comm.finish(out.subspan(own.begin, own.size()), op);
      doubling(comm, out, f, v, range);
    }
    if (partner >= 0) {
      comm.send(ConstBuffer(out), partner, unfold_tag, 0);
      comm.wait_all();
    }
  }

  template <class B>
  static void reduce_scatter(CallView<B>& comm, ConstBuffer in, Buffer out, OpKind op,
                             const Options& opt) {
    if (reduce_scatter_in_rank_order(comm, in, out, op, opt)) return;
    const Fold f(comm.size());
    const int r = comm.rank();
    const std::size_t m = out.size();
    const EqualBlocks blocks{m};
    const int v = f.virt(r);
    const int partner = f.partner(r);
    if (v < 0) {
      // Hand everything to the partner; get our block back, reduced.
      comm.send(in, partner, fold_tag, 0);
      comm.recv(out, partner, unfold_tag, 1);
      comm.wait_all();
      return comm.finish(out, op);
    }
    auto work = comm.scratch(in.type(), in.size());
    comm.copy(work, in);
    if (partner >= 0) {
      comm.recv_reduce(work, partner, fold_tag, 1, op);
      comm.wait_all();
    }
    // Virtual part v stands for the blocks of the real ranks it represents.
    auto range = [&](int a, int b) {
      return Range{m * static_cast<std::size_t>(f.first_block(a)),
                   b >= f.pow2 ? work.size() : m * static_cast<std::size_t>(f.first_block(b))};
    };
    halving(comm, work, op, f, v, range);
    if (partner >= 0) {
      comm.send(ConstBuffer(work.subspan(blocks(partner).begin, m)), partner, unfold_tag, 0);
    }
    comm.copy(out, ConstBuffer(work.subspan(blocks(r).begin, m)));
    comm.wait_all();
    comm.finish(out, op);
  }

  template <class B>
  static void all_gather(CallView<B>& comm, ConstBuffer in, Buffer out, const Options&) {
    const std::size_t m = in.size();
    comm.copy(out.subspan(m * static_cast<std::size_t>(comm.rank()), m), in);
    gather_blocks(comm, out, EqualBlocks{m});
  }

  /// Van de Geijn's broadcast: scatter by recursive halving from the root,
  /// then all-gather by recursive doubling.
  template <class B>
  static void broadcast(CallView<B>& comm, Buffer buf, int root, const Options&) {
    const int p = comm.size();
    if (p == 1) return;
    const int rel = mod(comm.rank() - root, p);
    const Fold f(p, false);
    const int v = f.virt(rel);
    const int partner = f.partner(rel);
    auto real = [&](int relative) { return mod(relative + root, p); };
    if (v < 0) {
      comm.recv(buf, real(partner), unfold_tag, 1);
      comm.wait_all();
      return;
    }
    const std::size_t n = buf.size();
    auto range = [&](int a, int b) {
      return Range{block(n, static_cast<std::size_t>(f.pow2), static_cast<std::size_t>(a)).begin,
                   block(n, static_cast<std::size_t>(f.pow2), static_cast<std::size_t>(b - 1)).end};
    };
    for (int d = f.pow2 / 2, step = 0; d >= 1; d /= 2, ++step) {
      if (v % (2 * d) == 0) {
        const Range give = range(v + d, v + 2 * d);
        comm.send(ConstBuffer(buf.subspan(give.begin, give.size())), real(f.real(v + d)), static_cast<std::uint32_t>(step), 0);
      } else if (v % (2 * d) == d) {
        const Range take = range(v, v + d);
        comm.recv(buf.subspan(take.begin, take.size()), real(f.real(v - d)), static_cast<std::uint32_t>(step), 1);
      }
      comm.wait_all();
    }
    for (int d = 1, step = 32; d < f.pow2; d *= 2, ++step) {
      const int mine = v & ~(d - 1);
      const int theirs = (v ^ d) & ~(d - 1);
      const Range give = range(mine, mine + d);
      const Range take = range(theirs, theirs + d);
      comm.recv(buf.subspan(take.begin, take.size()), real(f.real(v ^ d)), static_cast<std::uint32_t>(step), 1);
      comm.send(ConstBuffer(buf.subspan(give.begin, give.size())), real(f.real(v ^ d)), static_cast<std::uint32_t>(step), 0);
      comm.wait_all();
    }
    if (partner >= 0) {
      comm.send(ConstBuffer(buf), real(partner), unfold_tag, 0);
      comm.wait_all();
    }
  }

 private:
  /// The short all-reduce: each step swaps the whole buffer with the partner
  /// and reduces, so after lg p' steps every rank holds the full result. The
  /// smaller virtual rank's data is always the left operand, so both partners
  /// evaluate the same expression and all ranks end with the same bits, even
  /// for an op that is not bitwise commutative (max of +0 and -0, NaN
  /// payloads), as the halving path guarantees by reducing each part once.
  template <class B>
  static void whole_doubling(CallView<B>& comm, Buffer x, OpKind op, const Fold& f, int v) {
    auto theirs = comm.scratch(x.type(), x.size());
    for (int d = 1, step = 0; d < f.pow2; d *= 2, ++step) {
      const int peer = f.real(v ^ d);
      const auto tag = short_tag + static_cast<std::uint32_t>(step);
      comm.recv(theirs, peer, tag, 1);
      comm.send(ConstBuffer(x), peer, tag, 0);
      comm.wait_all();
      if ((v & d) == 0) {
        comm.reduce(x, ConstBuffer(theirs), op);
      } else {
        comm.reduce(theirs, ConstBuffer(x), op);
        comm.copy(x, ConstBuffer(theirs));
      }
    }
    comm.finish(x, op);
  }

  /// All-gather of x, where rank q's block is blocks(q) and this rank's own
  /// block is already in place: the fold pairs merge first, recursive
  /// doubling runs on the power-of-two group, the pairs split at the end.
  template <class B, class BlockOf>
  static void gather_blocks(CallView<B>& comm, Buffer x, BlockOf blocks) {
    const int p = comm.size();
    if (p == 1) return;
    const int r = comm.rank();
    const Fold f(p);
    const int v = f.virt(r);
    const int partner = f.partner(r);
    const Range mine = blocks(r);
    if (v < 0) {
      comm.send(ConstBuffer(x.subspan(mine.begin, mine.size())), partner, fold_tag, 0);
      comm.wait_all();
      comm.recv(x, partner, unfold_tag, 1);
      comm.wait_all();
      return;
    }
    if (partner >= 0) {
      const Range theirs = blocks(partner);
      comm.recv(x.subspan(theirs.begin, theirs.size()), partner, fold_tag, 1);
      comm.wait_all();
    }
    auto range = [&](int a, int b) {
      return Range{blocks(f.first_block(a)).begin, b >= f.pow2 ? x.size() : blocks(f.first_block(b)).begin};
    };
    doubling(comm, x, f, v, range);
    if (partner >= 0) {
      comm.send(ConstBuffer(x), partner, unfold_tag, 0);
      comm.wait_all();
    }
  }
};

}  // namespace gradsync::detail
