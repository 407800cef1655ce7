#pragma once
/// \file detail::fsdp::HybridGroups: the communicators a sharded trainer runs
/// its collectives on. Under HybridShard a rank belongs to a shard group
/// (where units are gathered and reduce-scattered) and a replica group
/// (where gradient shards are summed across copies), both split from the
/// trainer's communicator; under the other strategies the communicator is
/// the shard group and there are no replicas. Kept apart so that the step
/// code asks "which group" without knowing how the groups were made, and so
/// that a failure in one group reaches the others in its own words.
///
/// Ranks that part ways under HybridShard can wait in different
/// communicators: one in its shard group, its peer in their replica group,
/// neither call visible to the other, and both would wait out the deadline.
/// Two rules keep every such parting on one communicator, where it fails
/// at once: each public call that goes on to call in a group starts with a
/// labelled world agreement (enter), and a rank whose model threw in a step
/// or an evaluation fails all three communicators (abandon), since its
/// peers may be waiting in group calls it will not make. (gather_chunk, a
/// shard-group call that a full checkpoint's save makes on replica 0 alone,
/// cannot start with a world call: the save's own agreement precedes it.)

#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "gradsync/collective/all_reduce.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/fail_access.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/train/fsdp/options.hpp"
#include "gradsync/train/fsdp/sharding_strategy.hpp"

namespace gradsync::detail::fsdp {

/// The world, shard and replica communicators of one trainer.
template <class Comm>
class HybridGroups {
 public:
  explicit HybridGroups(Comm& world) noexcept : world_(world) {}
  HybridGroups(const HybridGroups&) = delete;
  HybridGroups& operator=(const HybridGroups&) = delete;

  /// Under HybridShard, splits the world into this rank's shard group (ranks
  /// r / s alike) and replica group (ranks r % s alike). Collective: every
  /// rank must pass the same options, so the trainer agrees on them first.
  void split(const ShardedTrainerOptions& o, const std::string& where) {
    if (o.strategy != ShardingStrategy::HybridShard) return;
    const int s = shard_group_size(o, world_.size(), where);
    if constexpr (requires(Comm& c) { c.split(0, 0); }) {
      const int r = world_.rank();
      // Colors are never no_color, so both splits give a communicator.
      if (auto g = world_.split(r / s, r, "shard group " + std::to_string(r / s))) shard_.emplace(std::move(*g));
      if (auto g = world_.split(r % s, r, "replica group " + std::to_string(r % s))) replica_.emplace(std::move(*g));
    } else {
      throw InvalidArgument(where + ": HybridShard needs Communicator::split, which this backend lacks");
    }
  }

  Comm& world() noexcept { return world_; }
  const Comm& world() const noexcept { return world_; }
  /// Where units are sharded and gathered: the shard group under
  /// HybridShard, else the whole communicator.
  Comm& shard() noexcept { return shard_ ? *shard_ : world_; }
  const Comm& shard() const noexcept { return shard_ ? *shard_ : world_; }
  /// HybridShard's replica group (null otherwise): used only on the shard
  /// group's worker after construction, so one thread drives it in one order.
  Comm* replica() noexcept { return replica_ ? &*replica_ : nullptr; }
  /// The shard group is the whole communicator (not HybridShard).
  bool shard_is_world() const noexcept { return !shard_; }

  /// Under HybridShard, one 4-byte world all-reduce carrying `labelled`'s
  /// label, which names the call that follows: ranks that make different
  /// calls (one saves, one steps; one a step ahead of the other) fail here,
  /// naming both. Nothing under the other strategies, whose every call is
  /// on the world already.
  template <class Algo>
  void enter(const Options& labelled) {
    if (!shard_ || world_.size() == 1) return;
    std::int32_t nothing = 0;
    AllReduce<Algo>{labelled}(world_, std::span<std::int32_t>(&nothing, 1), Max{});
  }

  /// Under HybridShard, after this rank's model threw with its communicators
  /// sound: fails them all with `what`. Its peers may wait in group calls
  /// this rank will never make (it threw before asking for every unit), or
  /// have finished the step it abandoned; a rank cannot tell which, nor
  /// whether they threw alike, without a call they would be blocked from.
  /// So under HybridShard a step whose model throws ends the trainer, on
  /// every rank at once.
  void abandon(const std::string& what) noexcept {
    if (shard_ && world_.size() > 1 && !world_.failed() && !shard_->failed() && !(replica_ && replica_->failed())) {
      fail_all(what, FailureKind::aborted);
    }
  }

  /// Fails this rank's communicators (world, shard and replica groups) with
  /// `what` as `kind` (InvalidArgument by default), so that every rank's next
  /// call, in any group, fails with those words.
  void fail_all(const std::string& what, FailureKind kind = FailureKind::invalid_argument) noexcept {
    for (Comm* c : {&world_, shard_ ? &*shard_ : nullptr, replica()}) {
      if (c) FailAccess::fail(*c, kind, what);
    }
  }

  /// Runs f; if one of the communicators failed in it under HybridShard,
  /// lets what is in flight end (`settle`) and fails the other ones with the
  /// same words. A disagreement found in one shard or replica group would
  /// otherwise reach the other groups' ranks only as this rank leaving (its
  /// communicators destroyed), not as what went wrong.
  template <class F, class Settle>
  decltype(auto) failing_together(F&& f, Settle&& settle) {
    try {
      return std::forward<F>(f)();
    } catch (...) {
      // Only a communicator's failure (or abandon()'s, after a model's own
      // exception); another error, such as a refusal every rank makes
      // alike, leaves the communicators usable.
      if (shard_ && (world_.failed() || shard_->failed() || (replica_ && replica_->failed()))) {
        settle();
        const FailureKind kind = current_failure_kind();
        const std::string what = current_exception_what("a collective failed");
        for (Comm* c : {&world_, &*shard_, replica()}) {
          if (c) FailAccess::fail(*c, kind, what);
        }
      }
      throw;
    }
  }

 private:
  Comm& world_;
  /// Declared before the trainer's worker, which runs on the shard group.
  std::optional<Comm> shard_, replica_;
};

}  // namespace gradsync::detail::fsdp
