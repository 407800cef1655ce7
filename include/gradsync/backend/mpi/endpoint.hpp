#pragma once
/// \file One rank's end of the MPI transport.

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "gradsync/backend/mpi/control.hpp"
#include "gradsync/backend/mpi/datatype.hpp"
#include "gradsync/backend/mpi/environment.hpp"
#include "gradsync/backend/mpi/idle_backoff.hpp"
#include "gradsync/backend/mpi/mpi_options.hpp"
#include "gradsync/backend/mpi/native.hpp"
#include "gradsync/backend/mpi/native_buffers.hpp"
#include "gradsync/backend/mpi/node_cores.hpp"
#include "gradsync/backend/mpi/receive_buffers.hpp"
#include "gradsync/backend/mpi/wire.hpp"
#include "gradsync/core/call_info.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/flight_signal.hpp"
#include "gradsync/core/local_reduce.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/peer_wait_timer.hpp"
#include "gradsync/core/rank_names.hpp"
#include "gradsync/core/spinner.hpp"

namespace gradsync {
namespace detail::mpi {

/// Ranks given different MpiOptions would check calls on some ranks only
/// (those waiting for an agreement the others never join) or fail in
/// different ways: one 8-byte MPI_Allreduce on the new duplicate `comm` at
/// construction compares them, and every rank throws InvalidArgument if they
/// differ.
inline void check_same_options(MPI_Comm comm, int rank, const MpiOptions& o) {
  const int mine = (o.check_calls ? 1 : 0) | static_cast<int>(o.failure_policy) << 1;
  int both[2] = {mine, -mine};
  if (MPI_Allreduce(MPI_IN_PLACE, both, 2, MPI_INT, MPI_MAX, comm) != MPI_SUCCESS) {
    throw Error("gradsync: MPI_Allreduce of the MpiOptions failed");
  }
  if (both[0] == -both[1]) return;
  throw InvalidArgument("gradsync: Communicator<Mpi> on rank " + std::to_string(rank) +
                        ": the ranks were given different MpiOptions (this rank: check_calls " +
                        (o.check_calls ? "true" : "false") + ", failure_policy " +
                        (o.failure_policy == MpiFailurePolicy::abort_job ? "abort_job" : "throw_error") +
                        "); every rank must pass the same");
}

/// Non-blocking MPI point-to-point under the backend concept. The user's
/// communicator is duplicated, so gradsync's messages never match the
/// user's. MPI has no timeouts: waits poll with MPI_Testsome against the
/// communicator's deadline.
///
/// Every call is checked against the other ranks' (see Control) unless
/// MpiOptions::check_calls is off and the call carries no label, and a rank
/// that fails or leaves tells the others on the control channel, so they
/// fail fast naming it.
///
/// Native's collectives, MPI's own, are mixed in from NativeCollectives.
class Endpoint : public NativeCollectives<Endpoint> {
 public:
  /// Duplicates `comm` twice, for data and for control (MPI is initialised
  /// first if the program has not). Collective: every rank passes the same
  /// options.
  Endpoint(MPI_Comm comm, MpiOptions options = {})  // NOLINT: implicit, so Communicator<Mpi> comm(MPI_COMM_WORLD) reads naturally
      : failure_policy(options.failure_policy) {
    Environment::ensure();
    check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    check_same_options(comm_, rank_, options);
    check(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node_), "MPI_Comm_split_type");
    MPI_Comm_rank(node_, &local_rank_);
    MPI_Comm_size(node_, &local_size_);
    int rc = MPI_SUCCESS;
    const int cores = node_cores(node_, rc);
    check(rc, "MPI_Allreduce of the cores on this host");
    spinner_ = Spinner(local_size_ > cores);
    void* ub = nullptr;
    int found = 0;
    MPI_Comm_get_attr(comm_, MPI_TAG_UB, &ub, &found);
    tag_ub_ = found ? *static_cast<int*>(ub) : 32767;
    while (tag_bits_ < 31 && (std::int64_t{1} << (tag_bits_ + 1)) - 1 <= tag_ub_) ++tag_bits_;
    control_ = Control(comm_, options.check_calls, local_size_ == size_);
  }
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;
  Endpoint(Endpoint&& o) noexcept { swap(o); }
  Endpoint& operator=(Endpoint&&) = delete;
  ~Endpoint() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    // Nothing is in flight unless a call ended without fail() (it always
    // takes everything back): then this rank leaves, and only after that do
    // its sends go (see let_sends_go).
    if (!finalized && !requests_.empty()) {
      take_back_receives();
      control_.leave();
      let_sends_go(user_call_.seq);
    }
    clear();
    native_.keep_abandoned(finalized != 0);
    // The data duplicate is kept until MPI ends, never freed: a peer may
    // still send to it (it does not know this rank left), and Open MPI
    // hands a message for a freed communicator to the next one created with
    // the same context id, where it breaks the message order and hangs.
    if (!finalized && node_ != MPI_COMM_NULL) MPI_Comm_free(&node_);
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  /// Rank among the processes on this host: what picks a GPU.
  int local_rank() const noexcept { return local_rank_; }
  /// Processes on this host.
  int local_size() const noexcept { return local_size_; }
  /// gradsync's private duplicate of the user's communicator.
  MPI_Comm mpi_comm() const noexcept { return comm_; }
  /// How errors name this communicator's ranks.
  const RankNames& names() const noexcept { return control_.names(); }

  /// Set at construction from MpiOptions; may be changed between calls.
  MpiFailurePolicy failure_policy = MpiFailurePolicy::throw_error;

  /// Starts the call's agreement, which its waits then watch. Refuses the
  /// call before anything is posted if a peer already said it failed in this
  /// call or an earlier one (see Control::begin).
  void begin_call(const CallInfo& call, std::chrono::nanoseconds timeout) {
    user_call_ = call;
    // The call's hash (sequence number included) goes into the tag bits
    // above tag_call_free (up to MPI_TAG_UB), so that messages of calls the
    // ranks disagree on, or of an earlier call, never match: a message larger
    // than its receive makes Open MPI's single-copy path write past the
    // receive's buffer.
    const WireCall wire = WireCall::of(call);
    const std::uint64_t h = wire.hash();
    const std::uint32_t mask = static_cast<std::uint32_t>((std::uint64_t{1} << tag_bits_) - 1) & ~tag_call_free;
    tag_salt_ = static_cast<std::uint32_t>(h ^ (h >> 32)) & mask;
    // The agreement compares the same hash: made once per call.
    control_.begin(call, wire, h, timeout);
  }

  /// No rank returns from a call the ranks disagreed on.
  void end_call(const CallInfo& call, std::chrono::nanoseconds timeout) { settle(call, timeout); }

  void post_send(const void* data, std::size_t count, DataType type, int peer, std::uint32_t tag, std::uint32_t token,
                 const CallInfo& call) {
    Op& op = acquire(token, peer, call);
    op.kind = Op::send;
    op.count = count;
    op.type = type;
    check_count(count);
    check(MPI_Isend(data, static_cast<int>(count), datatype(type), peer, mpi_tag(tag), comm_, &requests_.back()),
          "MPI_Isend");
  }

  void post_recv(void* data, std::size_t count, DataType type, int peer, std::uint32_t tag, std::uint32_t token,
                 const CallInfo& call, OpKind reduce_op, bool reduce) {
    Op& op = acquire(token, peer, call);
    op.kind = reduce ? Op::recv_reduce : Op::recv;
    op.dst = data;
    op.count = count;
    op.type = type;
    op.reduce_op = reduce_op;
    check_count(count);
    void* into = data;
    if (reduce) {
      // Lands in a buffer of its own, then is reduced into dst on completion.
      op.buffer = buffers_.take(count * size_of(type));
      into = buffers_.data(op.buffer);
    }
    check(MPI_Irecv(into, static_cast<int>(count), datatype(type), peer, mpi_tag(tag), comm_, &requests_.back()),
          "MPI_Irecv");
  }

  std::size_t pending() const noexcept { return ops_.size() + completed_.size(); }

  std::uint32_t wait_any(const CallInfo& call, std::chrono::nanoseconds timeout) {
    if (completed_.empty()) {
      if (ops_.empty()) throw Error("gradsync: wait_any with nothing in flight in " + describe(call));
      await([&] { return test_some(call, timeout), !completed_.empty(); }, timeout,
            [&] { throw_timeout(call, timeout); });
    }
    const std::uint32_t token = completed_.back();
    completed_.pop_back();
    return token;
  }

  /// While a timeline is recorded (the communicator turns it on), the time
  /// this rank's waits in wait_any and barriers took, less the reductions of
  /// what had arrived that it made meanwhile. MPI moves a message only inside
  /// this rank's MPI calls (shared memory's copies, TCP's fragments), and
  /// those are among the polls of the wait, so the transport's own copying
  /// counts as waiting: an upper bound on the time spent waiting for a late
  /// peer. Inside a native collective nothing can be told apart: untold.
  PeerWaitTimer& peer_waits() noexcept { return waits_; }

  void barrier(const CallInfo& call, std::chrono::nanoseconds timeout) {
    // The agreement completes only once every rank has joined: a barrier.
    if (control_.checking()) return settle(call, timeout);
    MPI_Request req = MPI_REQUEST_NULL;
    check(MPI_Ibarrier(comm_, &req), "MPI_Ibarrier");
    poll(req, call, timeout, "the barrier");
  }

  /// This rank's end of a sub-communicator of the ranks passing `color`
  /// (see Communicator::split), made by MPI_Comm_split, which orders them by
  /// key then rank; none for a negative color. MPI_Comm_split has no
  /// deadline, so it is entered only once every rank is known to be in this
  /// same call: after the call agreement (with check_calls off, a barrier),
  /// which has one. What is left is a rank that dies in the instant between
  /// the two. The new endpoint duplicates the result for its data and its
  /// control like any Mpi endpoint, with this one's options; `name` names
  /// the group in its errors (RankNames::split).
  std::optional<Endpoint> split(int color, int key, const CallInfo& call, std::chrono::nanoseconds timeout,
                                std::string_view name) {
    barrier(call, timeout);
    MPI_Comm sub = MPI_COMM_NULL;
    check(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub), "MPI_Comm_split");
    if (sub == MPI_COMM_NULL) return std::nullopt;
    // Only the new endpoint's duplicates carry messages: this one is freed.
    struct Free {
      MPI_Comm& comm;
      ~Free() { MPI_Comm_free(&comm); }
    } free_sub{sub};
    std::optional<Endpoint> child(std::in_place, sub,
                                  MpiOptions{.failure_policy = failure_policy, .check_calls = control_.checking()});
    // The child's ranks still share their cores with the parent's others,
    // so it waits as this one has learnt to, not as its own size suggests.
    child->spinner_ = spinner_;
    // Which of this communicator's ranks each member is: MPI's groups say,
    // locally, so errors can name the members' world ranks.
    MPI_Group parent_group = MPI_GROUP_NULL, child_group = MPI_GROUP_NULL;
    check(MPI_Comm_group(comm_, &parent_group), "MPI_Comm_group");
    struct FreeGroups {
      MPI_Group& a;
      MPI_Group& b;
      ~FreeGroups() {
        if (a != MPI_GROUP_NULL) MPI_Group_free(&a);
        if (b != MPI_GROUP_NULL) MPI_Group_free(&b);
      }
    } free_groups{parent_group, child_group};
    check(MPI_Comm_group(child->comm_, &child_group), "MPI_Comm_group");
    std::vector<int> members(static_cast<std::size_t>(child->size_)), here(members.size());
    std::iota(members.begin(), members.end(), 0);
    check(MPI_Group_translate_ranks(child_group, child->size_, members.data(), parent_group, here.data()),
          "MPI_Group_translate_ranks");
    child->control_.set_names(names().split(here, color, name));
    return child;
  }

  void local_copy(void* dst, const void* src, std::size_t count, DataType type) noexcept {
    if (dst != src && count) std::memcpy(dst, src, count * size_of(type));
  }
  void local_reduce(void* dst, const void* src, std::size_t count, DataType type, OpKind op) noexcept {
    reduce_into_erased(type, op, dst, src, count);
  }
  void local_finish(void* data, std::size_t count, DataType type, OpKind op) noexcept {
    finish_erased(type, op, data, count, size_);
  }

  /// Takes back what is in flight, then tells the others (if they do not
  /// know yet) and lets the sends go once no peer can read them.
  void fail(const CallInfo& call, std::string_view why, FailureKind kind) noexcept {
    if (failure_policy == MpiFailurePolicy::abort_job) abort_job(why, call);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
      take_back_receives();
      control_.tell(kind, why, -1, call.seq, true);
      let_sends_go(call.seq);
    }
    clear();
  }

 private:
  // Native's collectives use the agreement, the waits and the buffers here.
  friend class NativeCollectives<Endpoint>;

  struct Op {
    enum Kind : std::uint8_t { send, recv, recv_reduce };
    Kind kind = send;
    std::uint32_t token = 0;
    int peer = 0;
    const CallInfo* call = nullptr;
    void* dst = nullptr;
    std::size_t count = 0;
    DataType type = DataType::float32;
    OpKind reduce_op = OpKind::sum;
    std::size_t buffer = 0;
  };
  void swap(Endpoint& o) noexcept {
    std::swap(comm_, o.comm_);
    std::swap(node_, o.node_);
    std::swap(rank_, o.rank_);
    std::swap(size_, o.size_);
    std::swap(local_rank_, o.local_rank_);
    std::swap(local_size_, o.local_size_);
    std::swap(tag_ub_, o.tag_ub_);
    std::swap(tag_bits_, o.tag_bits_);
    std::swap(tag_salt_, o.tag_salt_);
    std::swap(spinner_, o.spinner_);
    std::swap(failure_policy, o.failure_policy);
    std::swap(control_, o.control_);
    ops_.swap(o.ops_);
    requests_.swap(o.requests_);
    buffers_.swap(o.buffers_);
    native_.swap(o.native_);
    std::swap(user_call_, o.user_call_);
  }

  Op& acquire(std::uint32_t token, int peer, const CallInfo& call) {
    ops_.push_back(Op{});
    requests_.push_back(MPI_REQUEST_NULL);
    Op& op = ops_.back();
    op.token = token;
    op.peer = peer;
    op.call = &call;
    return op;
  }

  void test_some(const CallInfo& call, std::chrono::nanoseconds timeout) {
    const int n = static_cast<int>(requests_.size());
    indices_.resize(requests_.size());
    statuses_.resize(requests_.size());
    int done = 0;
    const int rc = MPI_Testsome(n, requests_.data(), &done, indices_.data(), statuses_.data());
    if (rc == MPI_ERR_IN_STATUS) {
      for (int j = 0; j < done; ++j) {
        const MPI_Status& st = statuses_[static_cast<std::size_t>(j)];
        if (st.MPI_ERROR != MPI_SUCCESS) op_failed(ops_[static_cast<std::size_t>(indices_[static_cast<std::size_t>(j)])], st.MPI_ERROR, timeout);
      }
    }
    if (rc != MPI_SUCCESS) {
      control_.explain(timeout);
      check(rc, ("MPI_Testsome in " + describe(call)).c_str());
    }
    if (done == MPI_UNDEFINED || done == 0) return;
    for (int j = 0; j < done; ++j) {
      Op& op = ops_[static_cast<std::size_t>(indices_[static_cast<std::size_t>(j)])];
      const MPI_Status& st = statuses_[static_cast<std::size_t>(j)];
      if (op.kind != Op::send) {
        int got = 0;
        MPI_Get_count(&st, datatype(op.type), &got);
        if (static_cast<std::size_t>(got) != op.count) {
          // Ranks that called different things are told so first.
          control_.explain(timeout);
          throw InvalidArgument("gradsync: " + names().who(rank_) + " expected " + std::to_string(op.count) +
                                " x " + std::string(name(op.type)) + " from " + names().who(op.peer) + " in " +
                                describe(*op.call) + " but received " + std::to_string(got) +
                                ": the ranks called it with different arguments");
        }
        if (op.kind == Op::recv_reduce) {
          const std::int64_t begin = waits_.work_begins();
          reduce_into_erased(op.type, op.reduce_op, op.dst, buffers_.data(op.buffer), op.count);
          waits_.work_ends(begin);
          buffers_.release(op.buffer);
        }
      }
      completed_.push_back(op.token);
    }
    // Compact: drop completed (now MPI_REQUEST_NULL) entries.
    std::size_t w = 0;
    for (std::size_t i = 0; i < requests_.size(); ++i) {
      if (requests_[i] == MPI_REQUEST_NULL) continue;
      requests_[w] = requests_[i];
      ops_[w] = ops_[i];
      ++w;
    }
    requests_.resize(w);
    ops_.resize(w);
  }

  /// Waits for one collective request. If the wait ends otherwise (the
  /// deadline, a peer's notice), the request is given up: MPI can neither
  /// cancel nor free a pending collective, so it stays, with the native
  /// buffer if `native` (MPI may write there until it completes), in
  /// NativeBuffers until it completes or MPI ends.
  void poll(MPI_Request& req, const CallInfo& call, std::chrono::nanoseconds timeout, const char* what,
            bool native = false) {
    try {
      await(
          [&] {
            int flag = 0;
            const int rc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
            if (rc != MPI_SUCCESS) {
              control_.explain(timeout);
              check(rc, what);
            }
            return flag != 0;
          },
          timeout, [&] { timed_out(call, timeout, std::string(" waiting in ") + what + " (some rank has not joined)"); });
    } catch (...) {
      native_.abandon(req, native);
      throw;
    }
  }

  /// Waits for the ranks' verdict on the call: returns when they agree.
  void settle(const CallInfo& call, std::chrono::nanoseconds timeout) {
    if (!control_.pending()) return;
    await([&] { return control_.agreed(timeout); }, timeout, [&] {
      const std::vector<int> missing = control_.not_joined();
      control_.abandon();
      timed_out(call, timeout,
                " waiting for every rank to join it (" +
                    (missing.empty() ? std::string("some rank has")
                                     : names().list(missing) + (missing.size() > 1 ? " have" : " has")) +
                    " not called it)");
    });
  }

  /// One request failed inside MPI: named with its peer, and as a
  /// disagreement if the ranks called different things.
  [[noreturn]] void op_failed(const Op& op, int error, std::chrono::nanoseconds timeout) {
    control_.explain(timeout);
    int cls = error;
    MPI_Error_class(error, &cls);
    const std::string where = std::string(op.kind == Op::send ? " sending to " : " receiving from ") +
                              names().who(op.peer) + " in " + describe(*op.call);
    if (cls == MPI_ERR_TRUNCATE) {
      throw InvalidArgument("gradsync: " + names().who(rank_) + " received more than the " +
                            std::to_string(op.count) + " x " + std::string(name(op.type)) + " it expected" + where +
                            ": the ranks called it with different arguments");
    }
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(error, text, &len);
    throw Error("gradsync: " + names().who(rank_) + ": MPI failed" + where + ": " +
                std::string(text, static_cast<std::size_t>(len)));
  }

  [[noreturn]] void abort_job(std::string_view why, const CallInfo& call) const noexcept {
    std::fprintf(stderr, "gradsync: %s aborting the MPI job: %.*s (in %s)\n", names().who(rank_).c_str(),
                 static_cast<int>(why.size()), why.data(), describe(call).c_str());
    std::fflush(stderr);
    MPI_Abort(comm_, 1);
    std::abort();
  }

  /// Polls `ready` until it holds: spinning for the spinner's budget, then
  /// yielding the core between polls, as Open MPI itself does when
  /// oversubscribed (mpi_yield_when_idle). Spinning on a core the awaited
  /// peer needs would hold that peer off for a whole time slice. When ranks
  /// outnumber cores, a long wait sleeps between polls (IdleBackoff): its
  /// yields would take the cores the other ranks need. With a core per
  /// rank it keeps yielding: then nobody needs the core, and Open MPI moves
  /// a message only inside this rank's MPI calls, so sparser polls could
  /// stretch a large transfer that needs many of them (TCP's fragments).
  template <class Ready, class Expired>
  void await(Ready&& ready, std::chrono::nanoseconds timeout, Expired&& expired) {
    // A small message often lands within a poll or two: answer it before
    // paying for the clock (and without timing it as a wait for peers).
    for (int i = 0; i < 4; ++i) {
      if (ready()) return spinner_.spun_enough();
    }
    struct Timed {
      PeerWaitTimer& timer;
      const PeerWaitTimer::Mark began;
      ~Timed() { timer.wait_ends(began); }
    } timed{waits_, waits_.wait_begins()};
    const auto start = std::chrono::steady_clock::now();
    const auto spin_until = start + spinner_.budget();
    // Past the fast polls, a wait also watches the agreement and the other
    // ranks' notices, so it ends as soon as the call is known to be doomed.
    for (int i = 1;; ++i) {
      if (ready()) return spinner_.spun_enough();
      cpu_relax();
      if (i % 16 == 0) {
        control_.poll(timeout, waiting_for());
        if (std::chrono::steady_clock::now() > spin_until) break;
      }
    }
    spinner_.spun_in_vain();
    const auto deadline = start + timeout;
    const IdleBackoff backoff(start);
    const bool crowded = spinner_.oversubscribed();
    for (;;) {
      if (ready()) return;
      control_.poll(timeout, waiting_for());
      poll_flight_signal();
      if (std::chrono::steady_clock::now() > deadline) expired();
      if (crowded) {
        backoff.idle();
      } else {
        std::this_thread::yield();
      }
    }
  }

  /// Cancels the receives in flight and waits for them: MPI_Cancel alone
  /// lets MPI write into the buffer later (a message already matched still
  /// lands), after its owner freed it. The wait is short (an unmatched
  /// receive completes at once, a matched one when its data is in), unless
  /// the sender died mid-message: then the rest never comes, and on one host
  /// the receive goes once its sender's process is gone (Control::gone: a
  /// dead process writes nothing, and what it sent before is taken by the
  /// polls meanwhile). Past a generous bound (across hosts, the only end for
  /// such a receive) the process ends rather than return with memory MPI may
  /// still write. Sends are left alone here (see let_sends_go).
  void take_back_receives() noexcept {
    for (std::size_t i = 0; i < requests_.size(); ++i) {
      if (requests_[i] != MPI_REQUEST_NULL && ops_[i].kind != Op::send) MPI_Cancel(&requests_[i]);
    }
    settle_requests(false, [&](const Op& op) {
      return "a cancelled MPI receive from " + names().who(op.peer) + " did not complete";
    }, "MPI may still write into its buffer");
  }

  /// Waits for the sends in flight until no peer can read them any more.
  /// MPI cannot reliably cancel a send, and a receiver reads a large one
  /// (Open MPI's single-copy path, or a rendezvous that makes this rank push
  /// the data) whenever its own MPI runs after matching it, which on a
  /// loaded host can be long after this rank gave up. Freed unfinished, the
  /// send would read the caller's buffer after the caller has freed it: a
  /// crash, or another's data to the receiver. So one goes only once it
  /// completes or its peer can no longer match it (Control::may_read): the
  /// peer said it took back its receives, having heard this rank's notice
  /// (sent before this), or, on one host, it has not begun this call and will
  /// refuse it, or its process is gone (killed: it never says a word, but
  /// reads nothing either). A live peer in the call hears the notice within
  /// a poll; past the bound (a peer gone silent in the call, or across hosts
  /// a dead one, whose death no slot shows) the process ends.
  void let_sends_go(std::uint64_t seq) noexcept {
    settle_requests(true, [&](const Op& op) {
      return "an MPI send to " + names().who(op.peer) + " was neither received nor released by it";
    }, "MPI may still read its buffer", seq);
  }

  /// Polls the requests of `sends` (or receives) until each is done, or its
  /// peer can no longer touch it (for a send, may_read; for a receive, its
  /// process is gone); past cancel_bound, says why
  /// (`stuck` of the first one left, then `risk`) and ends the process.
  template <class Stuck>
  void settle_requests(bool sends, Stuck&& stuck, const char* risk, std::uint64_t seq = 0) noexcept {
    const auto start = std::chrono::steady_clock::now();
    const IdleBackoff backoff(start);
    for (;;) {
      const Op* left = nullptr;
      for (std::size_t i = 0; i < requests_.size(); ++i) {
        if (requests_[i] == MPI_REQUEST_NULL || (ops_[i].kind == Op::send) != sends) continue;
        int done = 0;
        if (MPI_Test(&requests_[i], &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || done ||
            (sends ? !control_.may_read(ops_[i].peer, seq) : control_.gone(ops_[i].peer))) {
          if (requests_[i] != MPI_REQUEST_NULL) MPI_Request_free(&requests_[i]);
          continue;
        }
        if (!left) left = &ops_[i];
      }
      if (!left) return;
      if (std::chrono::steady_clock::now() - start > cancel_bound) {
        std::string what;
        try {
          what = stuck(*left);
        } catch (...) {
          what = "an MPI request did not complete";
        }
        std::fprintf(stderr, "gradsync: internal error: %s: %s within %d s; ending the process, since %s\n",
                     names().who(rank_).c_str(), what.c_str(), static_cast<int>(cancel_bound.count()), risk);
        std::fflush(stderr);
        MPI_Abort(comm_, 1);
        std::abort();
      }
      backoff.idle();
    }
  }

  /// Forgets what was in flight, once none of it can touch memory any more.
  void clear() noexcept {
    requests_.clear();
    ops_.clear();
    completed_.clear();
    buffers_.release_all();
  }

  /// How long a cancelled receive may take to complete (a matched message
  /// still in flight, at worst a large one from a loaded host), and a send
  /// to be received or released by its peer.
  static constexpr std::chrono::seconds cancel_bound{30};

  /// The algorithm's tag, salted with the call (see begin_call): xor with
  /// a constant keeps a call's tags apart from each other.
  int mpi_tag(std::uint32_t tag) const {
    if (tag > static_cast<std::uint32_t>(tag_ub_) || (tag_bits_ < 32 && (tag >> tag_bits_) != 0)) {
      throw Error("gradsync: message tag " + std::to_string(tag) + " exceeds this MPI's MPI_TAG_UB " +
                  std::to_string(tag_ub_) + "; use a larger chunk_bytes");
    }
    return static_cast<int>(tag ^ tag_salt_);
  }

  /// Tag bits the call's salt leaves alone: the algorithms' small tags
  /// (steps, chunks) live there, so two calls' tags collide only if their
  /// salts do.
  static constexpr std::uint32_t tag_call_free = 0xffff;

  static void check_count(std::size_t count) {
    if (count > static_cast<std::size_t>(INT32_MAX)) {
      throw InvalidArgument("gradsync: the Mpi backend sends at most 2^31-1 elements per message, got " +
                            std::to_string(count));
    }
  }

  void check(int rc, const char* what) const {
    if (rc == MPI_SUCCESS) return;
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    // Also outside a call (construction), where no fail() would abort.
    if (failure_policy == MpiFailurePolicy::abort_job) {
      std::fprintf(stderr, "gradsync: %s aborting the MPI job: %s failed: %.*s\n", names().who(rank_).c_str(), what, len,
                   text);
      std::fflush(stderr);
      MPI_Abort(comm_ == MPI_COMM_NULL ? MPI_COMM_WORLD : comm_, 1);
    }
    throw Error("gradsync: " + names().who(rank_) + ": " + what + " failed: " +
                std::string(text, static_cast<std::size_t>(len)));
  }

  [[noreturn]] void throw_timeout(const CallInfo& call, std::chrono::nanoseconds timeout) {
    std::string waiting;
    if (!ops_.empty()) {
      const Op& op = ops_.front();
      waiting = " waiting for " + names().who(op.peer) + (op.kind == Op::send ? " to receive" : " to send");
    }
    timed_out(call, timeout, waiting);
  }

  /// The peer of the oldest operation in flight, which the others may want
  /// to hear about; -1 when waiting for no one in particular.
  int waiting_for() const noexcept { return ops_.empty() ? -1 : ops_.front().peer; }

  /// Tells the others, then hears them out briefly, so that the message can
  /// name the rank that is really missing, not only the neighbour waited for.
  [[noreturn]] void timed_out(const CallInfo& call, std::chrono::nanoseconds timeout, const std::string& waiting) {
    std::string s = std::to_string(std::chrono::duration<double>(timeout).count());
    s = s.substr(0, s.find('.') + 4);
    // A collective run inside the user's call (deterministic Native's
    // all-gather) is named as the user's call.
    const CallInfo& named = user_call_.seq == call.seq ? user_call_ : call;
    std::string what = "gradsync: " + names().who(rank_) + " timed out after " + s + " s in " + describe(named) + waiting;
    const auto grace = std::clamp<std::chrono::nanoseconds>(timeout / 4, std::chrono::milliseconds(1),
                                                            std::chrono::milliseconds(250));
    what += control_.after_timeout(what, grace, waiting_for());
    throw Timeout(what);
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm node_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  int local_rank_ = 0;
  int local_size_ = 1;
  int tag_ub_ = 32767;
  int tag_bits_ = 0;              ///< tags below 2^tag_bits_ are valid
  std::uint32_t tag_salt_ = 0;    ///< the current call's, in the bits above tag_call_free
  Spinner spinner_{false};
  std::vector<Op> ops_;
  std::vector<MPI_Request> requests_;
  std::vector<std::uint32_t> completed_;
  ReceiveBuffers buffers_;
  std::vector<int> indices_;
  std::vector<MPI_Status> statuses_;
  NativeBuffers native_;  ///< the Native collectives' buffer and the requests given up on
  /// The user's call, as begun: what errors name, even where an algorithm
  /// runs a native collective of its own inside it (deterministic Native).
  CallInfo user_call_{};
  Control control_;
  PeerWaitTimer waits_;
};

}  // namespace detail::mpi
}  // namespace gradsync
