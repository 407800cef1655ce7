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

#include "gradsync/core/algorithm_id.hpp"
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
  /// Largest message payload the transport sends eagerly; a larger one first
  /// waits for a rendezvous handshake (MPI's eager/rendezvous switch). 0: no
  /// such switch.
  std::size_t eager_bytes = 0;
  /// Seconds the handshake adds to each message above eager_bytes.
  double rendezvous_alpha = 0.0;
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
/// Latency of one message of `bytes`: alpha, plus the handshake above the
/// eager limit.
inline double latency(double bytes, const CostModel& m) noexcept {
  const bool rendezvous = m.eager_bytes > 0 && bytes > static_cast<double>(m.eager_bytes);
  return m.alpha + (rendezvous ? m.rendezvous_alpha : 0.0);
}

/// The fold of a world size that is not a power of two: the extra ranks
/// hand their n bytes to a partner, which reduces them and hands the result
/// back.
inline double rhd_fold(int p, double n, const CostModel& m) noexcept {
  const bool pow2 = (p & (p - 1)) == 0;
  return pow2 ? 0.0 : 2 * latency(n, m) + 2 * n * m.beta + n * m.gamma;
}
/// RecursiveHalvingDoubling's all-reduce, the two ways it can run on p ranks
/// with n bytes each. Rabenseifner: lg p' halving steps with messages of
/// n/2, n/4, ..., then the same sizes back while doubling.
inline double rhd_all_reduce_halving(int p, double n, const CostModel& m) noexcept {
  const int pow2 = 1 << static_cast<int>(floor_log2(p));
  const double pfrac = static_cast<double>(pow2 - 1) / pow2;
  double messages = 0;
  for (int part = 2; part <= pow2; part *= 2) messages += 2 * latency(n / part, m);
  return messages + 2 * pfrac * n * m.beta + pfrac * n * m.gamma + rhd_fold(p, n, m);
}
/// Recursive doubling on whole buffers: lg p' messages of n bytes, each
/// reduced on arrival; cheaper while latency dominates.
inline double rhd_all_reduce_doubling(int p, double n, const CostModel& m) noexcept {
  return floor_log2(p) * (latency(n, m) + n * m.beta + n * m.gamma) + rhd_fold(p, n, m);
}
/// Whether RecursiveHalvingDoubling all-reduces n bytes on p ranks by
/// recursive doubling alone. Every rank decides from the same model, so
/// they agree.
inline bool rhd_all_reduce_short(int p, double n, const CostModel& m) noexcept {
  return rhd_all_reduce_doubling(p, n, m) <= rhd_all_reduce_halving(p, n, m);
}

/// Predicted seconds for one call. `bytes` is the per-rank buffer of
/// all-reduce and broadcast, and the whole (N blocks) buffer of reduce-scatter
/// and all-gather, as nccl-tests counts them.
inline double predict(AlgorithmId algo, Collective c, int p, double n, const CostModel& m) noexcept {
  if (p <= 1) return 0.0;
  const double b = m.beta, g = m.gamma;
  const double frac = static_cast<double>(p - 1) / p;
  const double lg = ceil_log2(p);
  const int pow2 = 1 << static_cast<int>(floor_log2(p));
  const double fold = pow2 == p ? 0.0 : 1.0;
  const double pfrac = static_cast<double>(pow2 - 1) / pow2;
  const double lgp2 = floor_log2(p);
  if (algo == AlgorithmId::ring) {
    const double k = chunks(n / p, m);
    const double msg = latency(n / p / k, m);
    switch (c) {
      case Collective::all_reduce: return 2 * (p - 1) * k * msg + 2 * frac * n * b + frac * n * g;
      case Collective::reduce_scatter: return (p - 1) * k * msg + frac * n * (b + g) + n * b;
      case Collective::all_gather: return (p - 1) * k * msg + frac * n * b;
      case Collective::broadcast: {
        const double kb = chunks(n, m);
        return (p - 2 + kb) * (latency(n / kb, m) + n / kb * b);
      }
      default: return 0.0;
    }
  }
  if (algo == AlgorithmId::tree) {
    switch (c) {
      case Collective::all_reduce: {
        const double k = chunks(n / 2, m);
        return (2 * lg + 2 * (k - 1)) * latency(n / 2 / k, m) + 2 * n * b + n * g;
      }
      case Collective::reduce_scatter: return (2 * lg + chunks(n, m)) * latency(n / chunks(n, m), m) + 2 * n * b + n * g;
      case Collective::all_gather: return (2 * lg + chunks(n, m)) * latency(n / chunks(n, m), m) + 2 * n * b;
      case Collective::broadcast: {
        const double k = chunks(n, m);
        return (lg + k - 1) * (latency(n / k, m) + 2 * n / k * b);
      }
      default: return 0.0;
    }
  }
  if (algo == AlgorithmId::rhd) {
    // Messages halve at each step; charged at the first (largest) one's latency.
    const double half = latency(n / 2, m);
    switch (c) {
      case Collective::all_reduce: return std::min(rhd_all_reduce_halving(p, n, m), rhd_all_reduce_doubling(p, n, m));
      case Collective::reduce_scatter:
        return lgp2 * half + pfrac * n * (b + g) + n * b + fold * (2 * latency(n, m) + n * b + n * g);
      case Collective::all_gather: return lgp2 * half + pfrac * n * b + fold * (2 * latency(n, m) + n * b);
      case Collective::broadcast: return 2 * lgp2 * half + 2 * pfrac * n * b + fold * (latency(n, m) + n * b);
      default: return 0.0;
    }
  }
  if (algo == AlgorithmId::native && m.native_alpha > 0) {
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
/// The same, for an algorithm given by name ("ring", "tree", "rhd", "native");
/// an unknown name costs HUGE_VAL.
inline double predict(std::string_view algo, Collective c, int p, double n, const CostModel& m) noexcept {
  const auto id = algorithm_id(algo);
  return id ? predict(*id, c, p, n, m) : HUGE_VAL;
}

}  // namespace detail
}  // namespace gradsync
