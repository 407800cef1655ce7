#pragma once
/// \file ReadinessTracker: which units have their gradient, and which bucket may start next.

#include <algorithm>
#include <cstddef>
#include <vector>

#include "gradsync/train/ddp/bucket_plan.hpp"

namespace gradsync {

/// Follows one backward over a BucketPlan: units become ready in any order,
/// buckets start strictly in plan order. Bucket k may start once all its
/// units are ready and buckets 0..k−1 have started, so every rank issues the
/// same collectives in the same order whatever order its own units become
/// ready in.
///
/// It also remembers which units got a gradient at all since the last
/// synced backward ("touched", under no_sync too), which is what tells an
/// unused unit from one that accumulated.
class ReadinessTracker {
 public:
  ReadinessTracker() = default;
  explicit ReadinessTracker(const BucketPlan& plan)
      : ready_(plan.units(), 0), touched_(plan.units(), 0) {
    for (std::size_t k = 0; k < plan.size(); ++k) waits_for_.push_back(plan.units_in(k));
    bucket_of_.resize(ready_.size());
    for (std::size_t u = 0; u < ready_.size(); ++u) bucket_of_[u] = plan.bucket_of(u);
    pending_ = waits_for_;
  }

  std::size_t units() const noexcept { return ready_.size(); }
  bool ready(std::size_t u) const noexcept { return ready_[u] != 0; }
  bool touched(std::size_t u) const noexcept { return touched_[u] != 0; }

  /// Unit `u` got a gradient in this backward (synced or not).
  void touch(std::size_t u) noexcept { touched_[u] = 1; }

  /// Unit `u`'s gradient is final; false if it already was.
  bool mark_ready(std::size_t u) noexcept {
    if (ready_[u]) return false;
    ready_[u] = 1;
    --pending_[bucket_of_[u]];
    return true;
  }

  /// The next bucket in plan order may start.
  bool next_startable() const noexcept { return next_ < pending_.size() && pending_[next_] == 0; }
  /// Takes that bucket (call only when next_startable()).
  std::size_t take_next() noexcept {
    ++started_;
    return next_++;
  }

  /// Buckets started in the current backward.
  std::size_t started() const noexcept { return started_; }

  /// Starts a new backward: no unit ready, no bucket started.
  void reset_backward() {
    std::fill(ready_.begin(), ready_.end(), 0);
    pending_ = waits_for_;
    next_ = 0;
    started_ = 0;
  }
  /// Forgets which units got a gradient (after a synced backward).
  void clear_touched() { std::fill(touched_.begin(), touched_.end(), 0); }

 private:
  std::vector<unsigned char> ready_;
  std::vector<unsigned char> touched_;
  std::vector<std::size_t> bucket_of_;
  std::vector<std::size_t> waits_for_;  ///< units per bucket
  std::vector<std::size_t> pending_;    ///< units per bucket not yet ready
  std::size_t next_ = 0;
  std::size_t started_ = 0;
};

}  // namespace gradsync
