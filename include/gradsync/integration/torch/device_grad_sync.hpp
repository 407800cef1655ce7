#pragma once
/// \file DeviceGradSync: GradSync's bucketed, overlapped averaging for gradients in GPU memory, over a DeviceCommunicator.

#include <chrono>
#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gradsync/core/error.hpp"
#include "gradsync/core/types.hpp"
#include "gradsync/core/visit.hpp"
#include "gradsync/integration/torch/device_communicator.hpp"
#include "gradsync/train/ddp/bucket_plan.hpp"
#include "gradsync/train/ddp/grad_sync_options.hpp"
#include "gradsync/train/ddp/readiness_tracker.hpp"

namespace gradsync::detail {

/// GradSync's plan and readiness rules (the same BucketPlan and
/// ReadinessTracker, so the same buckets in the same order on every rank)
/// for one flat gradient in device memory. There is no progress worker: a
/// device collective is only enqueued, so the hook that makes a bucket
/// ready launches it itself. Before each launch the communicator's stream
/// waits for the gradient stream's work so far (the gradients just
/// accumulated); finish() makes the gradient stream wait for the reductions
/// and waits for them on the host, within the deadline.
///
/// The units are adjacent slices of one flat buffer in registration order,
/// so every bucket is reduced in place.
class DeviceGradSync {
 public:
  /// `base`: device address of the flat gradient of `type`; `counts[u]`:
  /// unit u's elements, units back to back. `zero(u)` zeroes unit u on the
  /// gradient stream (an unused parameter's contribution). `stream` is the
  /// gradient stream (nullptr: the legacy default stream).
  DeviceGradSync(DeviceCommunicator& comm, DataType type, void* base, const std::vector<std::size_t>& counts,
                 const GradSyncOptions& options, std::function<void(std::size_t)> zero, void* stream)
      : comm_(comm), type_(type), base_(static_cast<char*>(base)), o_(options), zero_(std::move(zero)),
        stream_(stream) {
    if (o_.bucket_cap_bytes == 0 || o_.first_bucket_cap_bytes == 0) {
      throw InvalidArgument("gradsync: DistributedDataParallel expects positive bucket caps, got bucket_cap_bytes = " +
                            std::to_string(o_.bucket_cap_bytes) +
                            " and first_bucket_cap_bytes = " + std::to_string(o_.first_bucket_cap_bytes));
    }
    std::size_t at = 0;
    for (std::size_t c : counts) {
      offsets_.push_back(at);
      at += c;
    }
    // BucketPlan reads only sizes and addresses (never the memory), so
    // spans over device addresses are safe to hand it.
    visit(type_, [&]<class T>(T) {
      element_size_ = sizeof(T);
      std::vector<std::span<T>> units;
      for (std::size_t u = 0; u < counts.size(); ++u) {
        units.emplace_back(reinterpret_cast<T*>(base_) + offsets_[u], counts[u]);
      }
      plan_ = BucketPlan(std::span<const std::span<T>>(units), o_.first_bucket_cap_bytes, o_.bucket_cap_bytes, true);
    });
    tracker_ = ReadinessTracker(plan_);
  }

  const std::vector<BucketInfo>& buckets() const noexcept { return plan_.buckets(); }
  const GradSyncStats& stats() const noexcept { return stats_; }
  void reset_stats() { stats_ = {}; }
  bool sync_enabled() const noexcept { return sync_; }

  void set_sync(bool on) {
    if (tracker_.started() != 0) {
      throw InvalidArgument("gradsync: DistributedDataParallel::set_sync on rank " + std::to_string(comm_.rank()) +
                            " in the middle of a synced backward");
    }
    sync_ = on;
    tracker_.reset_backward();
  }

  /// Unit u's gradient is final for this backward (its accumulation is
  /// enqueued on the gradient stream).
  void ready(std::size_t u) {
    tracker_.touch(u);
    if (!sync_) return;
    if (!tracker_.mark_ready(u)) {
      throw InvalidArgument("gradsync: DistributedDataParallel on rank " + std::to_string(comm_.rank()) + ": unit " +
                            std::to_string(u) + " was marked ready twice in one backward");
    }
    if (o_.overlap) launch_ready(true);
  }

  /// Launches what is left (zeros for unused units under
  /// find_unused_parameters), then joins the reductions.
  void finish() {
    if (!sync_) return;
    const auto t0 = std::chrono::steady_clock::now();
    std::size_t missing = 0;
    for (std::size_t u = 0; u < tracker_.units(); ++u) {
      if (tracker_.ready(u)) continue;
      if (!o_.find_unused_parameters) {
        ++missing;
        continue;
      }
      if (!tracker_.touched(u)) zero_(u);
      tracker_.mark_ready(u);
    }
    if (missing != 0) {
      // What was launched runs on; let it end before the caller reports.
      comm_.join(stream_);
      tracker_.reset_backward();
      throw InvalidArgument("gradsync: DistributedDataParallel on rank " + std::to_string(comm_.rank()) + ": " +
                            std::to_string(missing) + " parameters got no gradient in a synced backward");
    }
    launch_ready(false);
    comm_.join(stream_);
    stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++stats_.syncs;
    tracker_.reset_backward();
    tracker_.clear_touched();
  }

  /// After a backward that threw part-way: what it launched ends (its
  /// errors dropped: the caller has its own) and it is forgotten, as
  /// GradSync::abandon does.
  void abandon() noexcept {
    try {
      comm_.join(stream_);
    } catch (...) {
    }
    tracker_.reset_backward();
    tracker_.clear_touched();
  }

 private:
  void launch_ready(bool early) {
    bool waited = false;
    while (tracker_.next_startable()) {
      const BucketInfo& b = plan_[tracker_.take_next()];
      if (!waited) {
        comm_.wait_for(stream_);
        waited = true;
      }
      ++stats_.buckets_launched;
      if (early) ++stats_.buckets_launched_early;
      if (comm_.size() > 1 && b.count != 0) {
        comm_.all_reduce_mean(base_ + offsets_[b.first_unit] * element_size_, b.count, type_);
      }
    }
  }

  DeviceCommunicator& comm_;
  DataType type_;
  char* base_;
  GradSyncOptions o_;
  std::function<void(std::size_t)> zero_;
  void* stream_;
  std::size_t element_size_ = 0;
  std::vector<std::size_t> offsets_;
  BucketPlan plan_;
  ReadinessTracker tracker_;
  bool sync_ = true;
  GradSyncStats stats_{};
};

}  // namespace gradsync::detail
