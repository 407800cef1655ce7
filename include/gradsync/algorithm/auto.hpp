#pragma once
/// \file Auto: picks an algorithm per call from the backend's cost model.

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "gradsync/algorithm/algorithm.hpp"
#include "gradsync/algorithm/entry.hpp"
#include "gradsync/algorithm/native.hpp"
#include "gradsync/algorithm/recursive_halving_doubling.hpp"
#include "gradsync/algorithm/ring.hpp"
#include "gradsync/algorithm/tags.hpp"
#include "gradsync/algorithm/tree.hpp"
#include "gradsync/core/algorithm_id.hpp"
#include "gradsync/core/buffer.hpp"
#include "gradsync/core/call_view.hpp"
#include "gradsync/core/collective.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/cost_model.hpp"
#include "gradsync/core/cost_model_env.hpp"
#include "gradsync/core/error.hpp"

namespace gradsync {

/// One candidate's predicted time.
struct Prediction {
  std::string_view algorithm;
  double seconds = 0;
};

/// What Auto would choose for a call, and why.
struct Explanation {
  std::string_view chosen;
  std::vector<Prediction> candidates;
};

namespace detail {

inline constexpr std::array<AlgorithmId, 4> auto_candidates{AlgorithmId::ring, AlgorithmId::tree, AlgorithmId::rhd,
                                                           AlgorithmId::native};

/// Calls f(id, predicted seconds) for each algorithm backend B can run.
template <class B, class F>
void for_each_prediction(int world, Collective collective, std::size_t bytes, F&& f) {
  const CostModel& m = cost_model<B>();
  for (AlgorithmId a : auto_candidates) {
    if (a == AlgorithmId::native && !HasNative<B>) continue;
    f(a, predict(a, collective, world, static_cast<double>(bytes), m));
  }
}

/// Auto's pick: the cheapest prediction. Allocates nothing, since it runs
/// on every call and an 8-byte all-reduce takes a fraction of a microsecond.
template <class B>
AlgorithmId choose(int world, Collective collective, std::size_t bytes) {
  AlgorithmId best_id = AlgorithmId::ring;
  double best = HUGE_VAL;
  for_each_prediction<B>(world, collective, bytes, [&](AlgorithmId a, double t) {
    if (t < best) {
      best = t;
      best_id = a;
    }
  });
  return best_id;
}

/// The bytes Auto weighs for collective `c` on `o`: per rank for all-reduce
/// and broadcast, the whole for reduce-scatter and all-gather.
inline std::size_t auto_bytes(Collective c, const Operands& o) noexcept {
  return c == Collective::all_gather || c == Collective::broadcast ? o.out.size_bytes() : o.in.size_bytes();
}

/// Auto's pick for collective `c` of `bytes` on `world` ranks. Training
/// loops repeat the same calls; remembering the last answer per thread keeps
/// Auto's cost on an 8-byte call to a compare.
template <class B>
AlgorithmId auto_pick(int world, Collective c, std::size_t bytes) {
  struct Memo {
    Collective collective = Collective::barrier;
    int world = 0;
    std::size_t bytes = 0;
    AlgorithmId pick = AlgorithmId::ring;
  };
  thread_local Memo memo;
  if (memo.collective != c || memo.world != world || memo.bytes != bytes) {
    memo = {c, world, bytes, choose<B>(world, c, bytes)};
  }
  return memo.pick;
}

}  // namespace detail

/// Predicts every algorithm for `collective` on `bytes` (per-rank bytes for
/// all-reduce and broadcast, total for reduce-scatter and all-gather) and
/// names the fastest, as Auto picks it.
template <class B>
Explanation explain(const Communicator<B>& comm, Collective collective, std::size_t bytes) {
  Explanation e;
  e.chosen = name(detail::choose<B>(comm.size(), collective, bytes));
  detail::for_each_prediction<B>(comm.size(), collective, bytes,
                                 [&](AlgorithmId a, double t) { e.candidates.push_back({name(a), t}); });
  return e;
}

namespace detail {

/// Collective C's entries of algorithm A, indexed by Collective.
template <class A, class B>
constexpr std::array<Entry<B>, 4> entries() {
  return {&entry<A, Collective::all_reduce, B>, &entry<A, Collective::reduce_scatter, B>,
          &entry<A, Collective::all_gather, B>, &entry<A, Collective::broadcast, B>};
}
/// Native's row is empty on a backend without native collectives (Auto
/// never picks it there).
template <class B>
constexpr std::array<Entry<B>, 4> native_entries() {
  if constexpr (HasNative<B>) {
    return entries<Algorithm<Native>, B>();
  } else {
    return {};
  }
}

/// Auto's dispatch table: algorithm_table<B>[id][collective].
template <class B>
inline constexpr std::array<std::array<Entry<B>, 4>, 4> algorithm_table{
    entries<Algorithm<Ring>, B>(), entries<Algorithm<Tree>, B>(), entries<Algorithm<RecursiveHalvingDoubling>, B>(),
    native_entries<B>()};

/// Auto: an algorithm like the others, whose every collective asks the cost
/// model for the fastest of the rest and runs it through the table.
template <>
struct Algorithm<Auto> {
  template <class B>
  static void all_reduce(CallView<B>& comm, ConstBuffer in, Buffer out, OpKind op, const Options& opt) {
    run(comm, Collective::all_reduce, in.size_bytes(), {in, out, op, -1, &opt});
  }
  template <class B>
  static void reduce_scatter(CallView<B>& comm, ConstBuffer in, Buffer out, OpKind op, const Options& opt) {
    run(comm, Collective::reduce_scatter, in.size_bytes(), {in, out, op, -1, &opt});
  }
  template <class B>
  static void all_gather(CallView<B>& comm, ConstBuffer in, Buffer out, const Options& opt) {
    run(comm, Collective::all_gather, out.size_bytes(), {in, out, OpKind::sum, -1, &opt});
  }
  template <class B>
  static void broadcast(CallView<B>& comm, Buffer buf, int root, const Options& opt) {
    run(comm, Collective::broadcast, buf.size_bytes(), {buf, buf, OpKind::sum, root, &opt});
  }

 private:
  template <class B>
  static void run(CallView<B>& comm, Collective c, std::size_t bytes, const Operands& o) {
    const AlgorithmId pick = auto_pick<B>(comm.size(), c, bytes);
    algorithm_table<B>[static_cast<std::size_t>(pick)][static_cast<std::size_t>(c)](comm, o);
  }
};

}  // namespace detail
}  // namespace gradsync
