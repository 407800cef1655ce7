#pragma once
/// \file The collectives one wrapped unit issues, as the progress worker runs
/// them: the all-gather with its copy-in (from an offload space, rounding to
/// param_dtype) and copy-out (widening to the master type), the
/// reduce-scatter (and HybridShard's all-reduce across replicas) with its
/// copy-out, and NoShard's all-reduce. When they are queued is
/// collective_issuer.hpp's business; what each moves, in which type, is this file's.

#include <algorithm>
#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

#include "gradsync/collective/all_reduce.hpp"
#include "gradsync/collective/reduce_scatter.hpp"
#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/offload_space.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/train/common/finite_scan.hpp"

namespace gradsync::detail::fsdp {

/// `x` in the master type T (bfloat16 widens through float).
template <class T, class E>
T to_master(E x) noexcept {
  if constexpr (std::is_same_v<E, T>) {
    return x;
  } else {
    return static_cast<T>(static_cast<float>(x));
  }
}

/// On the worker: gathers a wrapped unit from this rank's master chunk
/// `home` into `out` (N·c, the master type; empty for a bfloat16 model).
/// Offloaded (`space`), the chunk is copied in first, into its own block
/// of the unit. With `bf16_wire` (param_dtype bfloat16) the chunk is rounded once
/// and gathered in bfloat16, into `kept` if the unit keeps that copy (a
/// bfloat16 model's unit, or ShardGradOp's keeps_bf16), then widened into
/// `out`.
template <bool ComputesBf16, class T, class Gather, class C>
void gather_unit(C& c, const Gather& all_gather, std::span<const T> home, std::span<T> out, std::span<bfloat16> kept,
                 bool bf16_wire, OffloadSpace* space) {
  std::span<const T> in = home;
  std::vector<T> staged;
  if (space) {
    // Into its own block of the unit, gathered in place; a
    // bfloat16 model's unit has no value_type block to use.
    std::span<T> own;
    if (ComputesBf16) {
      staged.resize(home.size());
      own = staged;
    } else {
      own = out.subspan(static_cast<std::size_t>(c.rank()) * home.size(), home.size());
    }
    space->copy_in(own.data(), home.data(), home.size_bytes());
    space->wait();
    in = own;
  }
  if (!bf16_wire) return all_gather(c, in, out);
  // param_dtype bfloat16: rounded once, half the bytes.
  const std::vector<bfloat16> mine(in.begin(), in.end());
  std::vector<bfloat16> scratch(kept.empty() ? out.size() : 0);
  const std::span<bfloat16> all = kept.empty() ? scratch : kept;
  all_gather(c, std::span<const bfloat16>(mine), all);
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i] = to_master<T>(all[i]);
  }
}

/// On the worker, NoShard: averages a whole unit's gradient `g` in place,
/// in bfloat16 on the wire with `bf16_wire` (reduce_dtype). Returns whether
/// `check` is set and the mean holds a NaN or an Inf: found as the bfloat16
/// copy-back writes it, else by one more read of `g` (the all-reduce's own
/// last pass is below this layer).
template <class Algo, class T, class C>
bool all_reduce_unit(C& c, const Options& opts, std::span<T> g, bool bf16_wire, bool check) {
  using Scan = FiniteScan<T>;
  if (bf16_wire && c.size() > 1) {
    std::vector<bfloat16> packed(g.begin(), g.end());
    AllReduce<Algo>{opts}(c, std::span<bfloat16>(packed), Avg{});
    typename Scan::word seen = Scan::start;
    for (std::size_t i = 0; i < g.size(); ++i) {
      g[i] = to_master<T>(packed[i]);
      seen = Scan::fold(seen, g[i]);
    }
    return check && Scan::found(seen);
  }
  if (c.size() > 1) AllReduce<Algo>{opts}(c, g, Avg{});
  return check && Scan::any(g);
}

/// On the worker: reduces a unit's gradient (`storage`, the padded unit
/// N·c, `count` elements and zeros) in element type E into this rank's
/// gradient shard `mine` (c): a mean, or under HybridShard a sum in the
/// group, a sum across `replicas` and one division. In the master type and
/// not adding, the reduce-scatter writes straight into `mine` (its padding
/// gets the sum of zeros); adding (sharded accumulation) it writes into a
/// c-element sum first, and in bfloat16 into the packed copy's tail. A
/// bfloat16 model's gradient (`bf16_in`, N·c, reduces_bf16_grad) is reduced
/// as it is, in place of `storage`, into a c-element bfloat16 result.
/// Returns whether `check` is set and `mine` then holds a NaN or an Inf:
/// found in the copy into `mine` where there is one, else by one read of it.
template <class Algo, class E, class T, class C, class R>
bool reduce_unit(C& c, const Options& opts, const Options& replica_opts, std::span<T> storage,
                 std::span<const bfloat16> bf16_in, std::size_t count, std::span<T> mine, R* replicas, T divisor,
                 bool add, bool check) {
  using Scan = FiniteScan<T>;
  const std::size_t chunk = mine.size();
  std::vector<E> packed;
  std::vector<T> sum;
  std::span<const E> in;
  std::span<E> out;
  if constexpr (std::is_same_v<E, T>) {
    in = storage;
    if (add) {
      sum.assign(chunk, T(0));
      out = std::span<E>(sum);
    } else {
      out = mine;
    }
  } else if (!bf16_in.empty()) {
    packed.assign(chunk, E(0.0f));
    in = bf16_in;
    out = std::span<E>(packed);
  } else {
    packed.assign(storage.size() + chunk, E(0.0f));
    for (std::size_t i = 0; i < count; ++i) packed[i] = E(static_cast<float>(storage[i]));
    in = std::span<const E>(packed).first(storage.size());
    out = std::span<E>(packed).subspan(storage.size(), chunk);
  }
  if (c.size() == 1) {
    std::copy(in.begin(), in.end(), out.begin());
  } else if (replicas == nullptr) {
    ReduceScatter<Algo>{opts}(c, in, out, Avg{});
  } else {
    ReduceScatter<Algo>{opts}(c, in, out, Sum{});
  }
  if (replicas && replicas->size() > 1) AllReduce<Algo>{replica_opts}(*replicas, out, Sum{});
  if constexpr (std::is_same_v<E, T>) {
    if (!add && !replicas) return check && Scan::any(mine);
  }
  // A NaN or Inf survives the addition, so `mine` after it tells for every micro-step so far.
  typename Scan::word seen = Scan::start;
  for (std::size_t i = 0; i < chunk; ++i) {
    const T x = replicas ? to_master<T>(out[i]) / divisor : to_master<T>(out[i]);
    mine[i] = add ? mine[i] + x : x;
    seen = Scan::fold(seen, mine[i]);
  }
  return check && Scan::found(seen);
}

}  // namespace gradsync::detail::fsdp
