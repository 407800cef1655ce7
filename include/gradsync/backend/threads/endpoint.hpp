#pragma once
/// \file One rank's end of the in-process transport.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "gradsync/backend/threads/doorbell.hpp"
#include "gradsync/backend/threads/memory.hpp"
#include "gradsync/backend/threads/native.hpp"
#include "gradsync/backend/threads/world.hpp"
#include "gradsync/core/call_info.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/peer_wait_timer.hpp"
#include "gradsync/core/rank_names.hpp"

namespace gradsync::detail::threads {

/// One rank's transport. Point-to-point is a rendezvous: a send posts a
/// pointer to its data in the receiver's mailbox, and the receiver copies
/// (or reduces) straight out of the sender's buffer, then marks it done.
/// Receivers never let anyone write into their memory, and a sender never
/// returns while its buffer may still be read, so an abort on any rank can
/// unwind every other rank safely.
///
/// Native's collectives (NativeCollectives) work inside native_call, which
/// this class keeps because split runs the same way.
class Endpoint : public NativeCollectives<Endpoint> {
 public:
  Endpoint(std::shared_ptr<World> world, int rank, Memory memory = {})
      : world_(std::move(world)), rank_(rank), memory_(memory), spinner_(world_->oversubscribed()) {}
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;
  Endpoint(Endpoint&&) = default;
  Endpoint& operator=(Endpoint&&) = delete;
  /// A rank that goes away is named to the peers still waiting for it.
  ~Endpoint() {
    cancel();
    if (world_) world_->leave(rank_, started_, std::uncaught_exceptions() > 0);
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return world_->size(); }
  /// How errors name this communicator's ranks.
  const RankNames& names() const noexcept { return names_; }

  void post_send(const void* data, std::size_t count, DataType type, int peer, std::uint32_t tag,
                 std::uint32_t token, const CallInfo& call) {
    Op& op = acquire(Op::send, token, peer);
    Message& m = op.msg;
    m.data = data;
    m.count = count;
    m.type = type;
    m.seq = call.seq;
    m.tag = tag;
    m.src = rank_;
    m.call = &call;
    m.state.store(Message::posted, std::memory_order_relaxed);
    Mailbox& box = world_->mailbox(peer);
    {
      std::lock_guard<std::mutex> lock(box.mutex);
      box.queue.push_back(&m);
      box.posted.fetch_add(1, std::memory_order_release);
    }
    world_->bell(peer).ring();
  }

  void post_recv(void* data, std::size_t count, DataType type, int peer, std::uint32_t tag, std::uint32_t token,
                 const CallInfo& call, OpKind reduce_op, bool reduce) {
    Op& op = acquire(Op::recv, token, peer);
    op.dst = data;
    op.count = count;
    op.type = type;
    op.tag = tag;
    op.call = &call;
    op.reduce_op = reduce_op;
    op.reduce = reduce;
    scan_needed_ = true;
  }

  std::size_t pending() const noexcept { return active_.size() + completed_.size(); }

  /// Publishes the call, so peers can compare it with theirs while they
  /// wait, and refuses to start when another rank has already failed.
  void begin_call(const CallInfo& call, std::chrono::nanoseconds timeout) {
    if (world_->aborted_for(call.seq)) throw_aborted(call);
    started_ = call.seq;
    timeout_ = timeout;
    world_->log(rank_).publish(call);
    if (world_->publish_waiters() > 0) world_->ring_all();
  }

  /// No rank returns from a call its peers disagree on: before returning,
  /// every peer must have started this call, as the same call. Native calls
  /// compared everything at their opening barrier already.
  ///
  /// A failure elsewhere does not fail a call whose every peer has started
  /// it alike: that call is complete here, and the failure belongs to a
  /// later one (this rank's next call is refused at once).
  void end_call(const CallInfo& call, std::chrono::nanoseconds timeout) {
    if (verified_ == call.seq) return;
    auto all_started = [&] {
      for (int q = 0; q < size(); ++q)
        if (world_->log(q).latest() < call.seq) return false;
      return true;
    };
    if (!all_started()) {
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      world_->add_publish_waiter(1);
      try {
        wait_on(world_->bell(rank_), spinner_, all_started, [&] {
          if (!all_started()) check_peers(call, deadline, timeout);
        });
      } catch (...) {
        world_->add_publish_waiter(-1);
        throw;
      }
      world_->add_publish_waiter(-1);
    }
    check_agreement(call);
  }

  /// Returns the token of one completed operation, waiting if none has.
  std::uint32_t wait_any(const CallInfo& call, std::chrono::nanoseconds timeout) {
    if (completed_.empty()) {
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      const PeerWaitTimer::Mark waiting = waits_.wait_begins();
      wait_on(
          world_->bell(rank_), spinner_, [&] { return progress(), !completed_.empty(); },
          [&] { check_peers(call, deadline, timeout); });
      waits_.wait_ends(waiting);
    }
    const std::uint32_t token = completed_.back();
    completed_.pop_back();
    return token;
  }

  /// While a timeline is recorded (the communicator turns it on), the time
  /// this rank's waits for its peers took: the waits in wait_any that found
  /// nothing to do, without the copies and reductions out of the peers'
  /// buffers that it made meanwhile, plus the waits in barriers (Native's
  /// phases). Two clock reads per wait and two per message taken during one,
  /// so only when asked.
  PeerWaitTimer& peer_waits() noexcept { return waits_; }

  /// Waits for every rank to arrive.
  void barrier(const CallInfo& call, std::chrono::nanoseconds timeout) {
    const std::uint64_t k = ++barriers_;
    const std::uint64_t target = k * static_cast<std::uint64_t>(size());
    auto& count = world_->barrier_count();
    world_->arrivals(rank_).store(k, std::memory_order_relaxed);
    if (count.fetch_add(1, std::memory_order_acq_rel) + 1 == target) {
      for (int r = 0; r < size(); ++r)
        if (r != rank_) world_->bell(r).ring();
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    const PeerWaitTimer::Mark waiting = waits_.wait_begins();
    // Gives up only if the barrier has not completed: the arrival is taken
    // back with a compare-and-swap, so either everyone passes or nobody does.
    auto give_up = [&](auto&& thrower) {
      std::uint64_t cur = count.load(std::memory_order_acquire);
      while (cur < target) {
        if (count.compare_exchange_weak(cur, cur - 1, std::memory_order_acq_rel)) {
          --barriers_;
          thrower();
        }
      }
    };
    wait_on(
        world_->bell(rank_), spinner_, [&] { return count.load(std::memory_order_acquire) >= target; },
        [&] {
          if (world_->aborted_for(call.seq)) give_up([&] { throw_aborted(call); });
          if (std::chrono::steady_clock::now() > deadline) give_up([&] { throw_barrier_timeout(call, timeout, k); });
          // A peer in another call (or gone) will never arrive.
          if (const PeerProblem problem = peer_problem(call)) give_up([&] { problem.raise(); });
        });
    waits_.wait_ends(waiting);
  }

  void local_copy(void* dst, const void* src, std::size_t count, DataType type) noexcept {
    if (dst != src && count) memory_.copy(dst, src, count * size_of(type));
  }
  void local_reduce(void* dst, const void* src, std::size_t count, DataType type, OpKind op) noexcept {
    memory_.reduce(type, op, dst, src, count);
  }
  void local_finish(void* data, std::size_t count, DataType type, OpKind op) noexcept {
    memory_.finish(type, op, data, count, size());
  }

  /// Marks the world failed, then abandons everything in flight. In that
  /// order: a peer whose message this rank hands back unread (refused) reads
  /// the failure's reason when it sees that.
  void fail(const CallInfo& call, std::string_view why, FailureKind kind) noexcept {
    std::string reason;
    try {
      reason = why;
      // A disagreement's message already names both calls; a failure carried
      // over from another communicator (a call not begun here) names its own.
      if (call.seq && call.seq <= started_ && kind != FailureKind::invalid_argument) {
        reason += " (in " + describe(call) + ")";
      }
    } catch (...) {
    }
    world_->abort(rank_, names_, call.seq, reason, kind);
    cancel();
  }

  /// This rank's end of a sub-world of the ranks passing `color` (see
  /// Communicator::split); none for a negative color. It runs as a Native
  /// call: each rank publishes its color and key, the opening barrier makes
  /// them visible and compares the calls, and the first member of each group
  /// in (key, rank) order makes the group's World and hands every member its
  /// share and new rank, which they take after the closing barrier. The World
  /// is owned by its members' endpoints, so it lives as long as the last one,
  /// whatever becomes of this one's. `name` names the group in errors
  /// (RankNames::split).
  std::optional<Endpoint> split(int color, int key, const CallInfo& call, std::chrono::nanoseconds timeout,
                                std::string_view name) {
    const SplitAsk mine{color, key};
    SplitShare share;
    std::vector<int> order;  // the members' ranks here, in their new order
    native_call(&mine, &share, call, timeout, [&] {
      if (color < 0) return;
      std::vector<std::pair<int, int>> members;  // (key, rank): the new order
      for (int q = 0; q < size(); ++q) {
        const auto& theirs = *static_cast<const SplitAsk*>(world_->slot(q).in);
        if (theirs.color == color) members.emplace_back(theirs.key, q);
      }
      std::sort(members.begin(), members.end());
      for (const auto& m : members) order.push_back(m.second);
      if (members.front().second != rank_) return;
      auto sub = std::make_shared<World>(static_cast<int>(members.size()), world_->oversubscribed());
      for (std::size_t i = 0; i < members.size(); ++i) {
        auto& out = *static_cast<SplitShare*>(world_->slot(members[i].second).out);
        out.world = sub;
        out.rank = static_cast<int>(i);
      }
    });
    if (!share.world) return std::nullopt;
    std::optional<Endpoint> child(std::in_place, std::move(share.world), share.rank, memory_);
    child->names_ = names_.split(order, color, name);
    return child;
  }

 private:
  // Its collectives run inside native_call on the World's slots.
  friend class NativeCollectives<Endpoint>;

  /// Publish, opening barrier, compare the calls, `work` on the peers'
  /// buffers, closing barrier. While `busy` holds this call's number, this
  /// rank may touch its peers' buffers; a rank leaving by any path after the
  /// opening barrier (timeout, abort, disagreement) first waits for every
  /// peer's `busy` to drop, which takes bounded time since `work` never
  /// waits on anyone. So no buffer is freed while a peer still uses it.
  template <class Work>
  void native_call(const void* in, void* out, const CallInfo& call, std::chrono::nanoseconds timeout, Work&& work) {
    NativeSlot& s = world_->slot(rank_);
    s.in = in;
    s.out = out;
    s.call = call;
    // Made visible by the barrier's release, before any peer can pass it.
    s.busy.store(call.seq, std::memory_order_relaxed);
    try {
      barrier(call, timeout);
    } catch (...) {
      // The barrier completed for nobody, so nobody touched anything.
      s.busy.store(0, std::memory_order_release);
      throw;
    }
    try {
      for (int q = 0; q < size(); ++q) {
        const CallInfo& theirs = world_->slot(q).call;
        if (!(theirs == call)) throw InvalidArgument(mismatch_message(call, q, theirs));
      }
      verified_ = call.seq;
      work();
      s.busy.store(0, std::memory_order_release);
      barrier(call, timeout);
    } catch (...) {
      s.busy.store(0, std::memory_order_release);
      fence_native(call);
      throw;
    }
  }

  /// Waits until no peer is inside Native call `call` any more.
  void fence_native(const CallInfo& call) const noexcept {
    for (int q = 0; q < size(); ++q) {
      const auto& busy = world_->slot(q).busy;
      bounded_wait([&] { return busy.load(std::memory_order_acquire) != call.seq; }, "a peer's Native copy loop", q);
    }
  }

  /// Waits for something that takes bounded time by construction (a peer's
  /// copy loop, or its hand-back of a message it claimed). Past a generous
  /// bound that can only be a bug, and freeing memory a peer still uses
  /// would be worse than stopping, so it terminates with a message.
  template <class Ready>
  void bounded_wait(Ready&& ready, const char* what, int peer) const noexcept {
    const auto bound = std::chrono::steady_clock::now() +
                       std::max<std::chrono::nanoseconds>(timeout_, std::chrono::seconds(10));
    for (int i = 0; !ready(); ++i) {
      if (i < 64) {
        cpu_relax();
        continue;
      }
      std::this_thread::yield();
      if (i % 256 == 0 && std::chrono::steady_clock::now() > bound) {
        std::fprintf(stderr, "gradsync: internal error on %s: waiting for %s on %s ran past its bound\n",
                     names_.who(rank_).c_str(), what, names_.who(peer).c_str());
        std::fflush(stderr);
        std::terminate();
      }
    }
  }

 private:
  /// What a rank publishes for split, and what its group's first member
  /// writes back to it.
  struct SplitAsk {
    int color;
    int key;
  };
  struct SplitShare {
    std::shared_ptr<World> world;
    int rank = -1;
  };

  struct Op {
    enum Kind : std::uint8_t { send, recv };
    Kind kind = send;
    std::uint32_t token = 0;
    int peer = 0;
    Message msg;  // send
    void* dst = nullptr;  // recv
    std::size_t count = 0;
    DataType type = DataType::float32;
    std::uint32_t tag = 0;
    const CallInfo* call = nullptr;
    OpKind reduce_op = OpKind::sum;
    bool reduce = false;
    Message* matched = nullptr;
  };

  Op& acquire(Op::Kind kind, std::uint32_t token, int peer) {
    if (free_.empty()) {
      pool_.push_back(std::make_unique<Op>());
      free_.push_back(pool_.back().get());
    }
    Op* op = free_.back();
    free_.pop_back();
    op->kind = kind;
    op->token = token;
    op->peer = peer;
    op->matched = nullptr;
    active_.push_back(op);
    return *op;
  }

  void release(std::size_t i) {
    free_.push_back(active_[i]);
    active_[i] = active_.back();
    active_.pop_back();
  }

  /// Completes whatever can complete now; receivers do their own copying.
  void progress() {
    Mailbox& box = world_->mailbox(rank_);
    const std::uint64_t posted = box.posted.load(std::memory_order_acquire);
    if (scan_needed_ || posted != seen_) {
      scan_needed_ = false;
      seen_ = posted;
      // The message is built under the lock: once it is released, the other
      // rank may fail, take its message back and free what it points to.
      std::string mismatch;
      {
        std::lock_guard<std::mutex> lock(box.mutex);
        for (Op* op : active_) {
          if (op->kind != Op::recv || op->matched) continue;
          for (std::size_t j = 0; j < box.queue.size(); ++j) {
            Message* m = box.queue[j];
            if (m->src != op->peer || m->seq != op->call->seq) continue;
            if (!(*m->call == *op->call)) {
              mismatch = mismatch_message(*op->call, m->src, *m->call);
              break;
            }
            if (m->tag != op->tag) continue;
            m->state.store(Message::claimed, std::memory_order_relaxed);
            box.queue.erase(box.queue.begin() + static_cast<std::ptrdiff_t>(j));
            op->matched = m;
            break;
          }
          if (!mismatch.empty()) break;
        }
      }
      if (!mismatch.empty()) throw InvalidArgument(mismatch);
    }
    for (std::size_t i = 0; i < active_.size();) {
      Op* op = active_[i];
      bool done = false;
      if (op->kind == Op::send) {
        const int state = op->msg.state.load(std::memory_order_acquire);
        if (state == Message::refused) throw_aborted(*op->msg.call);
        done = state == Message::done;
      } else if (op->matched) {
        Message* m = op->matched;
        if (m->count != op->count || m->type != op->type) {
          // The message stays claimed: fail() hands it back once the world
          // is marked failed, so its sender cannot mistake it for delivered.
          throw InvalidArgument("gradsync: " + names_.who(rank_) + " expected " + std::to_string(op->count) +
                                " x " + std::string(name(op->type)) + " from " + names_.who(m->src) + " in " +
                                describe(*op->call) + " but was sent " + std::to_string(m->count) + " x " +
                                std::string(name(m->type)) + ": the ranks called it with different arguments");
        }
        const std::int64_t begin = waits_.work_begins();
        if (op->reduce) {
          memory_.reduce(op->type, op->reduce_op, op->dst, m->data, op->count);
        } else if (op->count) {
          memory_.copy(op->dst, m->data, op->count * size_of(op->type));
        }
        waits_.work_ends(begin);
        const int src = m->src;
        m->state.store(Message::done, std::memory_order_release);
        world_->bell(src).ring();
        done = true;
      }
      if (done) {
        completed_.push_back(op->token);
        release(i);
      } else {
        ++i;
      }
    }
  }

  /// Takes back every send still in flight, and hands back unread every
  /// message this rank claimed but did not consume (a receive that threw
  /// part-way), so that no sender waits for it. A send already claimed is
  /// being read by its receiver right now, which takes bounded time.
  void cancel() noexcept {
    if (!world_) return;
    for (Op* op : active_) {
      if (op->kind == Op::recv) {
        if (Message* m = op->matched) {
          const int src = m->src;
          m->state.store(Message::refused, std::memory_order_release);
          world_->bell(src).ring();
        }
        continue;
      }
      Mailbox& box = world_->mailbox(op->peer);
      bool retracted = false;
      {
        std::lock_guard<std::mutex> lock(box.mutex);
        auto it = std::find(box.queue.begin(), box.queue.end(), &op->msg);
        if (it != box.queue.end()) {
          box.queue.erase(it);
          retracted = true;
        }
      }
      if (!retracted) {
        const auto& state = op->msg.state;
        bounded_wait([&] { return state.load(std::memory_order_acquire) >= Message::done; },
                     "the receiver to finish reading a message", op->peer);
      }
    }
    for (Op* op : active_) free_.push_back(op);
    active_.clear();
    completed_.clear();
  }

  /// What makes waiting in `call` pointless, besides the deadline: a peer
  /// that started the same call number as a different call (a disagreement),
  /// or a peer that left before it. Empty `why` when nothing is wrong (yet).
  struct PeerProblem {
    std::string why;
    bool disagreement = false;
    explicit operator bool() const noexcept { return !why.empty(); }
    [[noreturn]] void raise() const {
      if (disagreement) throw InvalidArgument(why);
      throw Aborted(why);
    }
  };

  /// A disagreement with any peer is named before a peer that left: it is
  /// the cause, the leaving only its consequence.
  PeerProblem peer_problem(const CallInfo& call) const {
    for (int q = 0; q < size(); ++q) {
      CallInfo theirs;
      if (q != rank_ && world_->log(q).read(call.seq, theirs) && !(theirs == call))
        return {mismatch_message(call, q, theirs), true};
    }
    for (int q = 0; q < size(); ++q) {
      const std::uint64_t left = q == rank_ ? World::still_here : world_->left_after(q);
      if (left == World::still_here || left >= call.seq) continue;
      // A rank that fails marks the world failed before it leaves, and
      // reading its leave (acquire) makes that mark visible. So read the mark
      // again: it may have been set after this rank's own check, and then the
      // failure, not the leaving it caused, is what this call died of.
      if (world_->aborted_for(call.seq)) return aborted_problem(call);
      return {"gradsync: " + names_.who(rank_) + " abandoned " + describe(call) + " because " +
                  departed(q, world_->departure(q), left),
              false};
    }
    return {};
  }

  /// Checks made while a wait finds nothing to do: another rank failed, a
  /// peer is in a different call or gone, or the deadline has passed.
  void check_peers(const CallInfo& call, std::chrono::steady_clock::time_point deadline,
                   std::chrono::nanoseconds timeout) const {
    if (world_->aborted_for(call.seq)) throw_aborted(call);
    if (const PeerProblem problem = peer_problem(call)) problem.raise();
    if (std::chrono::steady_clock::now() > deadline) throw_timeout(call, timeout);
  }

  /// Every peer has started `call`: was it the same call?
  void check_agreement(const CallInfo& call) const {
    for (int q = 0; q < size(); ++q) {
      CallInfo theirs;
      if (q != rank_ && world_->log(q).read(call.seq, theirs) && !(theirs == call))
        throw InvalidArgument(mismatch_message(call, q, theirs));
    }
  }

  static constexpr std::string_view disagreement_head = "gradsync: ranks disagree on a collective: ";
  std::string mismatch_message(const CallInfo& mine, int their_rank, const CallInfo& theirs) const {
    return std::string(disagreement_head) + names_.who(rank_) + " called " + describe(mine) + ", " +
           names_.who(their_rank) + " called " + describe(theirs, mine.label.names);
  }

  /// Why rank q, gone after `calls` calls, will never join: what happened
  /// on that rank, so that the reader knows where to look.
  std::string departed(int q, Departure how, std::uint64_t calls) const {
    const std::string n = std::to_string(calls) + (calls == 1 ? " call" : " calls");
    switch (how) {
      case Departure::unwound:
        return names_.who(q) + " will never join it: an exception on that rank destroyed its communicator after " + n;
      case Departure::returned:
        return names_.who(q) + " left after " + n + " (its run_threads body returned), so it will never join it";
      case Departure::threw:
        return names_.who(q) + " will never join it: its run_threads body ended with an exception after " + n;
      case Departure::destroyed: break;
    }
    return names_.who(q) + " left after " + n + " (its communicator was destroyed), so it will never join it";
  }

  /// Fails the way the world failed: a disagreement is InvalidArgument on
  /// every rank, with the text that names both calls.
  [[noreturn]] void throw_aborted(const CallInfo& call) const { aborted_problem(call).raise(); }

  PeerProblem aborted_problem(const CallInfo& call) const {
    AbortInfo a = world_->abort_info();
    if (a.kind == FailureKind::invalid_argument) {
      // A disagreement another rank found first: where this call is one of
      // the two, this rank names it first, as its own finding would.
      if (a.reason.starts_with(disagreement_head)) {
        for (int q = 0; q < size(); ++q) {
          CallInfo theirs;
          if (q != rank_ && world_->log(q).read(call.seq, theirs) && !(theirs == call)) {
            return {mismatch_message(call, q, theirs), true};
          }
        }
      }
      return {std::move(a.reason), true};
    }
    return {"gradsync: " + names_.who(rank_) + " abandoned " + describe(call) + " because " + a.reason, false};
  }

  /// "; rank 2 has not started it (its last call was #3)", for every peer
  /// that is behind: the rank a timeout is really about.
  std::string laggards(const CallInfo& call) const {
    std::string s;
    for (int q = 0; q < size(); ++q) {
      const std::uint64_t latest = world_->log(q).latest();
      if (q == rank_ || latest >= call.seq) continue;
      s += "; " + names_.who(q) + " has not started it";
      s += latest ? " (its last call was #" + std::to_string(latest) + ")" : " (it has made no call)";
    }
    return s;
  }

  static std::string seconds(std::chrono::nanoseconds t) {
    std::string s = std::to_string(std::chrono::duration<double>(t).count());
    return s.substr(0, s.find('.') + 4) + " s";
  }

  [[noreturn]] void throw_timeout(const CallInfo& call, std::chrono::nanoseconds timeout) const {
    std::string what = "gradsync: " + names_.who(rank_) + " timed out after " + seconds(timeout) + " in " +
                       describe(call);
    if (!active_.empty()) {
      const Op* op = active_.front();
      what += " waiting for " + names_.who(op->peer) + (op->kind == Op::recv ? " to send" : " to receive");
    }
    throw Timeout(what + laggards(call));
  }

  [[noreturn]] void throw_barrier_timeout(const CallInfo& call, std::chrono::nanoseconds timeout,
                                          std::uint64_t k) const {
    std::string what = "gradsync: " + names_.who(rank_) + " timed out after " + seconds(timeout) + " in " +
                       describe(call) + " waiting for";
    for (int q = 0; q < size(); ++q)
      if (world_->arrivals(q).load(std::memory_order_relaxed) < k) {
        what += " " + names_.who(q);
        break;
      }
    throw Timeout(what + laggards(call));
  }

  std::shared_ptr<World> world_;
  int rank_;
  RankNames names_;  ///< the world's until split names a group
  Memory memory_;
  Spinner spinner_;
  std::uint64_t barriers_ = 0;
  std::uint64_t started_ = 0;   ///< the last call begun
  std::uint64_t verified_ = 0;  ///< the last call whose agreement Native checked
  std::chrono::nanoseconds timeout_ = default_timeout;
  std::uint64_t seen_ = 0;
  bool scan_needed_ = false;
  PeerWaitTimer waits_;
  std::vector<std::unique_ptr<Op>> pool_;
  std::vector<Op*> free_;
  std::vector<Op*> active_;
  std::vector<std::uint32_t> completed_;
};

}  // namespace gradsync::detail::threads
