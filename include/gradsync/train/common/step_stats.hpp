#pragma once
/// \file StepStats: where one training step's time went, and what it sent.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <utility>

#include "gradsync/core/collective.hpp"
#include "gradsync/core/partition.hpp"

namespace gradsync {

/// One step of a trainer on one rank. Collective times are the progress
/// worker's time inside each job; exposed time is what the rank's own
/// thread spent waiting for them (a gather, a reduction it must retire,
/// the end of backward), so the rest was hidden behind compute.
struct StepStats {
  /// AllGather of units (ShardedTrainer).
  double gather_seconds = 0;
  /// Reduce-scatter and all-reduce of gradients.
  double reduce_seconds = 0;
  /// forward + backward on the rank's thread, less its waits for collectives.
  double compute_seconds = 0;
  double optimizer_seconds = 0;
  /// The rank's thread waiting for gathers and reductions.
  double exposed_comm_seconds = 0;
  /// Elements and bytes this rank sent in the step's gathers and gradient
  /// reductions, as the Ring schedule sends them (see detail::ring_sent),
  /// padding included; buffer broadcasts and clip_grad_norm's one-element
  /// all-reduce are left out.
  std::size_t sent_elements = 0;
  std::size_t sent_bytes = 0;
  /// Offload (ShardedTrainer): bytes copied from the offload space to the
  /// compute side (each gather's chunk of the master shard) and back (each
  /// reduced gradient shard); 0 without offload.
  std::size_t offload_in_bytes = 0;
  std::size_t offload_out_bytes = 0;
  /// OnNonfinite::skip_step skipped this step's optimizer update.
  bool skipped = false;

  /// Communication that overlapped compute: collective time not waited for.
  double hidden_comm_seconds() const noexcept {
    return std::max(0.0, gather_seconds + reduce_seconds - exposed_comm_seconds);
  }
  double total_seconds() const noexcept { return compute_seconds + exposed_comm_seconds + optimizer_seconds; }
};

namespace detail {

/// Elements rank `rank` of `n` sends in gradsync's Ring (not deterministic):
/// `count` is the whole buffer (an all-gather's output, a reduce-scatter's
/// padded input, an all-reduce's data). All-gather and reduce-scatter send
/// N−1 of N equal blocks; all-reduce sends 2(N−1) of its blocks
/// block(count, N, i), all but blocks r+1 (reduce phase) and r+2 (gather
/// phase), so the ranks together send 2(N−1)·count.
inline std::size_t ring_sent(Collective collective, std::size_t count, std::size_t n, std::size_t rank) noexcept {
  if (n <= 1) return 0;
  if (collective == Collective::all_reduce) {
    return 2 * count - block(count, n, (rank + 1) % n).size() - block(count, n, (rank + 2) % n).size();
  }
  return count / n * (n - 1);
}

/// `f` with its run time added to `*seconds` (written by the thread that
/// runs it; read once the job's Request has been waited for).
template <class F>
auto timed(double* seconds, F f) {
  return [seconds, f = std::move(f)](auto& comm) {
    const auto t0 = std::chrono::steady_clock::now();
    f(comm);
    *seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
}

/// Adds the time from construction to destruction to `*seconds`.
class Stopwatch {
 public:
  explicit Stopwatch(double* seconds) noexcept : seconds_(seconds), t0_(std::chrono::steady_clock::now()) {}
  Stopwatch(const Stopwatch&) = delete;
  Stopwatch& operator=(const Stopwatch&) = delete;
  ~Stopwatch() { *seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count(); }

 private:
  double* seconds_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace detail

}  // namespace gradsync
