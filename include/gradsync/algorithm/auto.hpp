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
#include "gradsync/core/error.hpp"

namespace gradsync {

namespace detail {

/// Reads "alpha=..,beta=..,gamma=..,native_alpha=..,native_beta=..,chunk_bytes=.." over a
/// model; unknown keys are an error so that a typo is not silently ignored.
inline CostModel parse_cost_model(std::string_view text, CostModel m) {
  while (!text.empty()) {
    const std::size_t comma = text.find(',');
    const std::string_view item = text.substr(0, comma);
    text = comma == std::string_view::npos ? std::string_view{} : text.substr(comma + 1);
    if (item.empty()) continue;
    const std::size_t eq = item.find('=');
    if (eq == std::string_view::npos) throw InvalidArgument("gradsync: GRADSYNC_COST_MODEL expects key=value, got '" + std::string(item) + "'");
    const std::string key(item.substr(0, eq));
    const std::string value(item.substr(eq + 1));
    char* end = nullptr;
    const double v = std::strtod(value.c_str(), &end);
    if (end == value.c_str() || *end != '\0') throw InvalidArgument("gradsync: GRADSYNC_COST_MODEL: '" + value + "' is not a number");
    // Times are finite and non-negative; a chunk is a whole number of bytes
    // from 1 up to 1 TiB (beyond that it would not fit a size_t cast safely).
    if (!std::isfinite(v) || v < 0) {
      throw InvalidArgument("gradsync: GRADSYNC_COST_MODEL: " + key + " must be a finite number >= 0, got '" + value + "'");
    }
    if (key == "alpha") m.alpha = v;
    else if (key == "beta") m.beta = v;
    else if (key == "gamma") m.gamma = v;
    else if (key == "native_alpha") m.native_alpha = v;
    else if (key == "native_beta") m.native_beta = v;
    else if (key == "chunk_bytes") {
      if (v < 1 || v > 1099511627776.0 || v != std::floor(v)) {
        throw InvalidArgument("gradsync: GRADSYNC_COST_MODEL: chunk_bytes must be a whole number of bytes in [1, 2^40], got '" + value + "'");
      }
      m.chunk_bytes = static_cast<std::size_t>(v);
    }
    else throw InvalidArgument("gradsync: GRADSYNC_COST_MODEL: unknown key '" + key + "' (expected alpha, beta, gamma, native_alpha, native_beta, chunk_bytes)");
  }
  return m;
}

}  // namespace detail

/// The cost model Auto uses for backend B: B::cost_model, overridden by the
/// environment variable GRADSYNC_COST_MODEL (as written by bench/calibrate).
template <class B>
const CostModel& cost_model() {
  static const CostModel model = [] {
    const char* env = std::getenv("GRADSYNC_COST_MODEL");
    return env ? detail::parse_cost_model(env, B::cost_model) : B::cost_model;
  }();
  return model;
}

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
