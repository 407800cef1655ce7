#pragma once
/// \file BucketPlan: which gradient units are reduced together, and in what order.

#include <cstddef>
#include <span>
#include <vector>

namespace gradsync {

/// One bucket of the plan: units [first_unit, last_unit] (indices in the
/// order they were registered), reduced together.
struct BucketInfo {
  std::size_t first_unit = 0;
  std::size_t last_unit = 0;
  std::size_t count = 0;
  /// The units are adjacent in memory, so the bucket is reduced in place.
  bool in_place = false;
};

/// Groups units into buckets the way PyTorch DDP does: in reverse
/// registration order (backward produces the last layers first), the first
/// bucket up to `first_cap_bytes` so communication starts early, the rest up
/// to `cap_bytes`; a unit larger than the cap gets a bucket of its own.
///
/// Only sizes and addresses go in, so every rank that registered the same
/// sizes gets the same plan, which is what lets bucket k be the same
/// collective on every rank.
class BucketPlan {
 public:
  BucketPlan() = default;

  /// `allow_in_place`: the reduction can work in the units' own memory
  /// (an all-reduce can; a reduce-scatter, which needs separate buffers, cannot).
  template <class T>
  BucketPlan(std::span<const std::span<T>> units, std::size_t first_cap_bytes, std::size_t cap_bytes,
             bool allow_in_place = true) {
    const std::size_t n = units.size();
    bucket_of_.assign(n, 0);
    std::size_t cap = first_cap_bytes;
    for (std::size_t i = n; i-- > 0;) {
      const std::size_t bytes = units[i].size_bytes();
      // A bucket always holds at least one unit, however large.
      const bool full = !buckets_.empty() && buckets_.back().count * sizeof(T) + bytes > cap;
      if (buckets_.empty() || full) {
        if (!buckets_.empty()) cap = cap_bytes;
        buckets_.emplace_back();
        buckets_.back().last_unit = i;
      }
      BucketInfo& b = buckets_.back();
      b.first_unit = i;
      b.count += units[i].size();
      bucket_of_[i] = buckets_.size() - 1;
    }
    for (BucketInfo& b : buckets_) {
      // Adjacent in memory, in registration order; empty units may point anywhere.
      bool adjacent = true;
      const T* end = nullptr;
      for (std::size_t u = b.first_unit; u <= b.last_unit; ++u) {
        if (units[u].empty()) continue;
        if (end && units[u].data() != end) adjacent = false;
        end = units[u].data() + units[u].size();
      }
      b.in_place = allow_in_place && adjacent;
    }
  }

  const std::vector<BucketInfo>& buckets() const noexcept { return buckets_; }
  std::size_t size() const noexcept { return buckets_.size(); }
  /// Units planned, in registration order.
  std::size_t units() const noexcept { return bucket_of_.size(); }
  const BucketInfo& operator[](std::size_t k) const noexcept { return buckets_[k]; }
  /// The bucket unit `u` belongs to.
  std::size_t bucket_of(std::size_t u) const noexcept { return bucket_of_[u]; }
  /// How many units bucket `k` waits for.
  std::size_t units_in(std::size_t k) const noexcept { return buckets_[k].last_unit - buckets_[k].first_unit + 1; }

 private:
  std::vector<BucketInfo> buckets_;
  std::vector<std::size_t> bucket_of_;
};

}  // namespace gradsync
