#pragma once
/// \file detail::TorchGatherScheduler: when the fully_shard units of one communicator gather, ahead of
/// their use (forward and backward prefetch) within FullyShardOptions::max_gathered_units, and the
/// spare bytes their gathers reuse.
///
/// Every decision here follows from the units' pre- and post-forward and
/// pre-backward calls and the order recorded from them, which are alike on
/// every rank of a correct program; so every rank issues the same gathers in
/// the same order, each labelled as the gather on demand would be, and a
/// rank whose forward differs fails on every rank with the labels' error.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "gradsync/integration/torch/queue_after_backward.hpp"
#include "gradsync/integration/torch/torch_buffer_pool.hpp"
#include "gradsync/integration/torch/torch_gather_event.hpp"

namespace gradsync::detail {

/// The gathers of the units wrapped with one communicator (one rank).
/// `Unit` is TorchShardedUnit<B>, which calls it and which it drives
/// (it is that class's friend; see there for the members used).
template <class Unit>
class TorchGatherScheduler : public std::enable_shared_from_this<TorchGatherScheduler<Unit>> {
 public:
  /// The scheduler of the units wrapped with `comm`; `fresh`: the first
  /// live unit of `comm` is being made, so one left by units of a
  /// communicator since destroyed (maybe at the same address) is not reused.
  static std::shared_ptr<TorchGatherScheduler> of(const void* comm, bool fresh) {
    static std::mutex mutex;
    static std::vector<std::pair<const void*, std::weak_ptr<TorchGatherScheduler>>> registry;
    const std::lock_guard<std::mutex> lock(mutex);
    std::erase_if(registry, [](const auto& e) { return e.second.expired(); });
    auto it = std::ranges::find_if(registry, [&](const auto& e) { return e.first == comm; });
    if (it != registry.end() && !fresh) {
      if (auto s = it->second.lock()) return s;
    }
    auto s = std::make_shared<TorchGatherScheduler>();
    if (it != registry.end()) {
      it->second = s;
    } else {
      registry.emplace_back(comm, s);
    }
    return s;
  }

  void add(Unit* u) { units_.push_back(u); }
  /// `u` is being destroyed (it has let its gather end).
  void remove(Unit* u) noexcept {
    for (auto* list : {&units_, &previous_, &forward_, &post_, &back_order_}) std::erase(*list, u);
    if (pending_ == u) pending_ = nullptr;
    cursor_ = std::min(cursor_, previous_.size());
    back_cursor_ = std::min(back_cursor_, back_order_.size());
  }

  /// Unit `u`'s forward starts: a new recording of the forward order when
  /// a backward came since the last one began or `u` already ran in it
  /// (what was gathered ahead and not used is let go first); then `u` is
  /// gathered (waiting for its prefetch) and the unit after it in the
  /// previous forward's order is gathered ahead.
  void before_forward(Unit& u) {
    try {
      if (backward_seen_ || std::ranges::find(forward_, &u) != forward_.end()) restart();
      forward_.push_back(&u);
      use(u, false);
      if (Unit* next = next_of(previous_, cursor_, u)) prefetch(*next, u.o_.max_gathered_units, false);
    } catch (...) {
      fail();
      throw;
    }
    ++depth_;
  }

  /// Unit `u`'s forward ended (and the unit freed what its strategy frees).
  /// Once no unit's forward is running, what was gathered ahead is waited
  /// for: the communicator is then the caller's, for collectives of its own.
  void after_forward(Unit& u) {
    post_.push_back(&u);
    if (depth_ > 0) --depth_;
    if (depth_ > 0) return;
    quiesce();
    // Where a unit encloses the others (the root wrapped too), a whole
    // forward is one outermost forward, and a prefetch left at its end
    // came from a part of the model called alone: kept, an optimizer step
    // before the next forward would leave it stale, and a forward taking
    // the units in another order would use it. (LibTorch's optimizers step
    // through .data(), which no version counter sees.)
    if (std::ranges::any_of(units_, [](const Unit* v) { return v->encloses_; })) drop_unused();
  }

  /// A forward that threw: what is in flight ends, what was gathered ahead
  /// and not used is freed, and the workers are let go.
  void forward_failed() noexcept {
    if (depth_ > 0) --depth_;
    fail();
  }

  /// Unit `u`'s backward starts. The first after a forward frees its
  /// prefetches that were never used; the first of each backward queues its
  /// end on the engine. Then `u` is gathered and the next unit in the
  /// reverse of this forward's order is gathered ahead, or once a unit is
  /// freed if the limit stands in the way.
  void before_backward(Unit& u) {
    try {
      if (!backward_seen_) {
        backward_seen_ = true;
        wait_all();
        drop_unused();
        back_order_.assign(post_.rbegin(), post_.rend());
        back_cursor_ = 0;
      }
      if (!end_queued_) {
        backward_open_ = true;
        queue_end();
      }
      if (pending_ == &u) pending_ = nullptr;
      use(u, true);
      if (Unit* next = next_of(back_order_, back_cursor_, u)) {
        if (!prefetch(*next, u.o_.max_gathered_units, true)) {
          pending_ = next;
          pending_limit_ = u.o_.max_gathered_units;
        }
      }
    } catch (...) {
      fail();
      throw;
    }
  }

  /// A unit's full buffer was freed: a backward prefetch the limit held back goes now.
  void freed() {
    if (pending_ == nullptr || !backward_open_) return;
    try {
      if (prefetch(*pending_, pending_limit_, true)) pending_ = nullptr;
    } catch (...) {
      fail();
      throw;
    }
  }

  /// Before a collective on the caller's thread: every gather in flight
  /// ends first (the communicator is the worker's while one is).
  void quiesce() {
    try {
      wait_all();
    } catch (...) {
      fail();
      throw;
    }
  }

  /// What the hooks on this forward's outputs hold. When the last goes
  /// (its graph freed: a rank unwinding from an exception that aborted the
  /// backward, or a forward never backpropagated) and no backward ended for
  /// this forward, what it left in flight ends and unused prefetches are
  /// freed; the engine drops its end-of-backward callback when backward throws.
  std::shared_ptr<void> graph_token() {
    std::shared_ptr<void> t = token_.lock();
    if (!t) {
      t = std::shared_ptr<void>(nullptr, [weak = this->weak_from_this(), gen = generation_](void*) noexcept {
        if (auto s = weak.lock()) s->graph_gone(gen);
      });
      token_ = t;
    }
    return t;
  }

  TorchBufferPool& pool() noexcept { return pool_; }

  /// The worker that runs prefetches on the communicator the units were
  /// wrapped with (theirs but under HybridShard, whose shard groups each
  /// get their own): made on first use, kept while the units live.
  /// Private, not ProgressWorker::shared: units outlive their module in the
  /// registry, and a shared worker kept past its communicator could be
  /// handed to another communicator made at the same address.
  template <class Comm>
  const std::shared_ptr<typename Unit::Worker>& world_worker(Comm& comm) {
    if (!world_worker_) world_worker_ = std::make_shared<typename Unit::Worker>(comm);
    return world_worker_;
  }

  /// What the pool's spares and the gathered units may hold together: the
  /// peak max_gathered_units allows, each the largest counted unit, the
  /// units it does not count, and one unit's gradient buffer. At least two
  /// units: in backward the next gathers before the last one frees, prefetch or not.
  std::size_t pool_limit() const noexcept {
    std::size_t limit = 2, largest = 0, uncounted = 0;
    for (const Unit* u : units_) {
      limit = std::max(limit, u->o_.max_gathered_units);
      if (u->encloses_) {
        uncounted += u->full_bytes();
      } else {
        largest = std::max(largest, u->full_bytes());
      }
    }
    return (limit + 1) * largest + uncounted;
  }

  /// Bytes every unit's gathered parameters hold now.
  std::size_t held_bytes() const noexcept {
    std::size_t total = 0;
    for (const Unit* u : units_) total += u->gathered_bytes();
    return total;
  }

  /// The gathers of the last forward and its backward, in issue order.
  const std::vector<TorchGatherEvent>& trace() const noexcept { return trace_; }
  /// The most bytes the units max_gathered_units counts held at once since the last reset.
  std::size_t peak_transient_bytes() const noexcept { return peak_; }
  void reset_peak() noexcept { peak_ = 0; }

 private:
  /// The unit after `u` in `order`, searched from `cursor` on (which then
  /// moves past `u`); null when `u` is not there or is last.
  static Unit* next_of(const std::vector<Unit*>& order, std::size_t& cursor, const Unit& u) {
    for (std::size_t i = cursor; i < order.size(); ++i) {
      if (order[i] != &u) continue;
      cursor = i + 1;
      return cursor < order.size() ? order[cursor] : nullptr;
    }
    return nullptr;
  }

  std::size_t counted() const noexcept {
    return static_cast<std::size_t>(std::ranges::count_if(units_, [](const Unit* u) { return u->counts(); }));
  }

  void track() noexcept {
    std::size_t bytes = 0;
    for (const Unit* u : units_) {
      if (u->counts()) bytes += u->gathered_bytes();
    }
    peak_ = std::max(peak_, bytes);
  }

  /// `u` gathered for its own use: its prefetch waited for, or its gather
  /// run now (after whatever else is in flight).
  void use(Unit& u, bool backward) {
    if (!u.sharded() || u.params_.empty()) return;
    if (u.gathering_.valid()) {
      u.wait_gather();
    } else if (!u.holds_gather()) {
      wait_all();
      u.gather(false);
      trace_.push_back({u.index(), backward, false, counted()});
    }
    u.take_prefetched();
    track();
  }

  /// Gathers `t` ahead unless it needs none, holds one, or `limit` units
  /// are counted already; false only in that last case.
  bool prefetch(Unit& t, std::size_t limit, bool backward) {
    if (!t.can_prefetch() || t.holds_gather()) return true;
    if (limit < 2 || counted() >= limit) return false;
    t.gather(true);
    trace_.push_back({t.index(), backward, true, counted()});
    track();
    return true;
  }

  /// Waits for every gather in flight (they stay gathered, for their use).
  void wait_all() {
    for (Unit* u : units_) {
      if (u->gathering_.valid()) u->wait_gather();
    }
  }

  /// Frees what was gathered ahead and never used (after it ended).
  void drop_unused() noexcept {
    for (Unit* u : units_) u->drop_prefetch();
  }
  /// Frees what ShardGradOp kept for a backward that did not use it.
  void drop_stashes() noexcept {
    for (Unit* u : units_) u->drop_stash();
  }

  /// After a failure: what is in flight ends, what was gathered ahead is
  /// freed, and the workers go (a worker whose job failed fails every later
  /// one with that error; the next prefetch starts a new one).
  void fail() noexcept {
    for (Unit* u : units_) u->settle_gather();
    drop_unused();
    drop_stashes();
    pending_ = nullptr;
    backward_open_ = false;
    for (Unit* u : units_) u->worker_.reset();
    world_worker_.reset();
  }

  void graph_gone(std::uint64_t generation) noexcept {
    if (generation != generation_ || ended_ || depth_ > 0) return;
    for (Unit* u : units_) u->settle_gather();
    drop_unused();
    drop_stashes();
    if (backward_seen_) backward_failed();
    pending_ = nullptr;
    backward_open_ = false;
  }

  /// A new forward: the last one's order is what prefetches follow.
  void restart() {
    wait_all();
    drop_unused();
    if (backward_seen_ && !ended_) backward_failed();
    // What ShardGradOp kept from an outermost forward no backward followed
    // may predate an optimizer step; inside one (a unit called twice) it is
    // this forward's, kept for its backward.
    if (depth_ == 0) drop_stashes();
    if (!forward_.empty()) previous_ = forward_;
    forward_.clear();
    post_.clear();
    back_order_.clear();
    cursor_ = back_cursor_ = 0;
    backward_seen_ = backward_open_ = end_queued_ = ended_ = false;
    pending_ = nullptr;
    trace_.clear();
    ++generation_;
    token_.reset();
  }

  /// A backward began and never reached its end (the engine drops the end
  /// callback of one that throws): what backwards without sync summed is
  /// dropped on every unit, as a trainer drops a failed micro-step's
  /// window, since the units the failed backward reached hold part of it.
  void backward_failed() noexcept {
    for (Unit* u : units_) {
      if (u->unsynced_.defined()) u->give_bytes(u->unsynced_);
      u->unsynced_.reset();
    }
  }

  /// The end of this backward, after every node: what was prefetched and
  /// not used (a unit no gradient reached) is waited for and freed.
  void queue_end() {
    if (end_queued_) return;
    end_queued_ = true;
    queue_after_backward(*this, &TorchGatherScheduler::end_backward);
  }

  /// (A second backward through the same forward follows the same order.)
  void end_backward() {
    end_queued_ = false;
    backward_open_ = false;
    pending_ = nullptr;
    back_cursor_ = 0;
    ended_ = true;
    quiesce();
    drop_unused();
    drop_stashes();
  }

  std::vector<Unit*> units_;
  /// Pre-forward order: the last complete forward's, and this one's; the post-forward order of this one.
  std::vector<Unit*> previous_, forward_, post_;
  /// This backward's expected order: post_ reversed.
  std::vector<Unit*> back_order_;
  std::size_t cursor_ = 0, back_cursor_ = 0;
  /// Forwards of units running (nested: a root's forward holds its children's).
  std::size_t depth_ = 0;
  bool backward_seen_ = false, backward_open_ = false, end_queued_ = false;
  /// A backward prefetch the limit held back, and the limit it was asked under.
  Unit* pending_ = nullptr;
  std::size_t pending_limit_ = 0;
  std::vector<TorchGatherEvent> trace_;
  std::size_t peak_ = 0;
  TorchBufferPool pool_;
  std::shared_ptr<typename Unit::Worker> world_worker_;
  /// Forwards recorded so far (restart()), this one's graph token, and whether a backward of it ended.
  std::uint64_t generation_ = 0;
  std::weak_ptr<void> token_;
  bool ended_ = false;
};

}  // namespace gradsync::detail
