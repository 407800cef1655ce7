#pragma once
/// \file Alpha-beta-gamma cost model used by Auto.
///
/// Hockney's model: a message of n bytes costs alpha + n·beta, reducing n
/// bytes costs n·gamma. The formulas per algorithm follow Thakur, Rabenseifner
/// & Gropp (2005) and Patarasuk & Yuan (2009); chunked algorithms pay alpha
/// once per chunk. Each backend carries one CostModel with the machine and
/// benchmark its numbers came from.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string_view>

#include "gradsync/algorithm/tags.hpp"
#include "gradsync/core/collective.hpp"

namespace gradsync {

struct CostModel {
  double alpha = 1e-6;        ///< seconds per message
  double beta = 1e-10;        ///< seconds per byte moved between ranks
  double gamma = 1e-10;       ///< seconds per byte reduced locally
  double native_alpha = 0.0;  ///< seconds per synchronisation of the Native path (0: no Native)
  /// Seconds per byte of the Native path, where it is not gradsync's own
  /// code (MPI's and NCCL's collectives choose their own algorithms, so
  /// their per-byte cost is fitted on its own); 0: the same as beta.
  double native_beta = 0.0;
  std::size_t chunk_bytes = std::size_t{1} << 19;
};

namespace detail {

inline double ceil_log2(int p) noexcept {
  int l = 0;
  while ((1 << l) < p) ++l;
  return l;
}
inline double floor_log2(int p) noexcept {
  int l = 0;
  while ((2 << l) <= p) ++l;
  return l;
}
inline double chunks(double bytes, const CostModel& m) noexcept {
  return std::max(1.0, std::ceil(bytes / static_cast<double>(m.chunk_bytes)));
}

/// Predicted seconds for one call. `bytes` is the per-rank buffer of
/// all-reduce and broadcast, and the whole (N blocks) buffer of reduce-scatter
/// and all-gather, as nccl-tests counts them.
inline double predict(std::string_view algo, Collective c, int p, double n, const CostModel& m) noexcept {
  if (p <= 1) return 0.0;
  const double a = m.alpha, b = m.beta, g = m.gamma;
  const double frac = static_cast<double>(p - 1) / p;
  const double lg = ceil_log2(p);
  const int pow2 = 1 << static_cast<int>(floor_log2(p));
  const double fold = pow2 == p ? 0.0 : 1.0;
  const double pfrac = static_cast<double>(pow2 - 1) / pow2;
  const double lgp2 = floor_log2(p);
  if (algo == "ring") {
    const double k = chunks(n / p, m);
    switch (c) {
      case Collective::all_reduce: return 2 * (p - 1) * k * a + 2 * frac * n * b + frac * n * g;
      case Collective::reduce_scatter: return (p - 1) * k * a + frac * n * (b + g) + n * b;
      case Collective::all_gather: return (p - 1) * k * a + frac * n * b;
      case Collective::broadcast: {
        const double kb = chunks(n, m);
        return (p - 2 + kb) * (a + n / kb * b);
      }
      default: return 0.0;
    }
  }
  if (algo == "tree") {
    switch (c) {
      case Collective::all_reduce: {
        const double k = chunks(n / 2, m);
        return (2 * lg + 2 * (k - 1)) * a + 2 * n * b + n * g;
      }
      case Collective::reduce_scatter: return (2 * lg + chunks(n, m)) * a + 2 * n * b + n * g;
      case Collective::all_gather: return (2 * lg + chunks(n, m)) * a + 2 * n * b;
      case Collective::broadcast: {
        const double k = chunks(n, m);
        return (lg + k - 1) * (a + 2 * n / k * b);
      }
      default: return 0.0;
    }
  }
  if (algo == "rhd") {
    switch (c) {
      case Collective::all_reduce: {
        const double folding = fold * (2 * a + 2 * n * b + n * g);
        // Short buffers: recursive doubling on whole buffers.
        if (n <= static_cast<double>(RecursiveHalvingDoubling::short_bytes)) return lgp2 * (a + n * b + n * g) + folding;
        return 2 * lgp2 * a + 2 * pfrac * n * b + pfrac * n * g + folding;
      }
      case Collective::reduce_scatter: return lgp2 * a + pfrac * n * (b + g) + n * b + fold * (2 * a + n * b + n * g);
      case Collective::all_gather: return lgp2 * a + pfrac * n * b + fold * (2 * a + n * b);
      case Collective::broadcast: return 2 * lgp2 * a + 2 * pfrac * n * b + fold * (a + n * b);
      default: return 0.0;
    }
  }
  if (algo == "native" && m.native_alpha > 0) {
    // Two synchronisations, then each rank streams its 1/p share of every
    // rank's buffer: beta is per byte copied, so reading n and writing n
    // costs n·beta, where a ring's 2(p-1)/p·n of messages cost that much each.
    const double sync = 2 * m.native_alpha * lg;
    const double nb = m.native_beta > 0 ? m.native_beta : b;
    switch (c) {
      case Collective::all_reduce: return sync + n * nb + frac * n * g;
      case Collective::reduce_scatter: return sync + (n + n / p) / 2 * nb + frac * n * g;
      case Collective::all_gather: return sync + n * nb;
      case Collective::broadcast: return sync + n * nb;
      default: return 0.0;
    }
  }
  return HUGE_VAL;
}

}  // namespace detail
}  // namespace gradsync
