#pragma once
/// \file Auto: picks an algorithm per call from the backend's cost model.

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gradsync/algorithm/algorithm.hpp"
#include "gradsync/algorithm/native.hpp"
#include "gradsync/algorithm/recursive_halving_doubling.hpp"
#include "gradsync/algorithm/ring.hpp"
#include "gradsync/algorithm/tags.hpp"
#include "gradsync/algorithm/tree.hpp"
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

inline constexpr std::array<std::string_view, 4> auto_candidates{Ring::name, Tree::name, RecursiveHalvingDoubling::name,
                                                                 Native::name};

/// Calls f(name, predicted seconds) for each algorithm backend B can run.
template <class B, class F>
void for_each_prediction(int world, Collective collective, std::size_t bytes, F&& f) {
  const CostModel& m = cost_model<B>();
  for (std::string_view n : auto_candidates) {
    if (n == Native::name && !HasNative<B>) continue;
    f(n, predict(n, collective, world, static_cast<double>(bytes), m));
  }
}

/// Auto's pick: the cheapest prediction. Allocates nothing, since it runs
/// on every call and an 8-byte all-reduce takes a fraction of a microsecond.
template <class B>
std::string_view choose(int world, Collective collective, std::size_t bytes) {
  std::string_view best_name = Ring::name;
  double best = HUGE_VAL;
  for_each_prediction<B>(world, collective, bytes, [&](std::string_view n, double t) {
    if (t < best) {
      best = t;
      best_name = n;
    }
  });
  return best_name;
}

}  // namespace detail

/// Predicts every algorithm for `collective` on `bytes` (per-rank bytes for
/// all-reduce and broadcast, total for reduce-scatter and all-gather) and
/// names the fastest, as Auto picks it.
template <class B>
Explanation explain(const Communicator<B>& comm, Collective collective, std::size_t bytes) {
  Explanation e;
  e.chosen = detail::choose<B>(comm.size(), collective, bytes);
  detail::for_each_prediction<B>(comm.size(), collective, bytes,
                                 [&](std::string_view n, double t) { e.candidates.push_back({n, t}); });
  return e;
}

namespace detail {

template <>
struct Algorithm<Auto> {
  template <class B, class F>
  static void dispatch(Communicator<B>& comm, Collective c, std::size_t bytes, F&& run) {
    // Training loops repeat the same calls; remembering the last answer per
    // thread keeps Auto's cost on an 8-byte call to a compare.
    struct Memo {
      Collective collective = Collective::barrier;
      int world = 0;
      std::size_t bytes = 0;
      std::string_view pick;
    };
    thread_local Memo memo;
    if (memo.pick.empty() || memo.collective != c || memo.world != comm.size() || memo.bytes != bytes) {
      memo = {c, comm.size(), bytes, choose<B>(comm.size(), c, bytes)};
    }
    const std::string_view pick = memo.pick;
    if (pick == Native::name) {
      if constexpr (HasNative<B>) return run(Algorithm<Native>{});
    }
    if (pick == Tree::name) return run(Algorithm<Tree>{});
    if (pick == RecursiveHalvingDoubling::name) return run(Algorithm<RecursiveHalvingDoubling>{});
    return run(Algorithm<Ring>{});
  }
};

}  // namespace detail
}  // namespace gradsync
