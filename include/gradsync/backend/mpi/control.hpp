#pragma once
/// \file Control: the side channel on which Mpi ranks check that they agree
/// on each call, and tell each other that they failed or left.

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "gradsync/backend/mpi/wire.hpp"
#include "gradsync/core/call_info.hpp"
#include "gradsync/core/error.hpp"

namespace gradsync::detail::mpi {

/// A second private duplicate of the user's communicator, apart from the one
/// the data moves on, so that nothing here can match an algorithm's message.
///
/// Agreement: each call posts a non-blocking all-reduce (bitwise and) of
/// {h, ~h}, h the hash of its CallInfo. The result is {h, ~h} again on every
/// rank exactly when all hashes are equal, so every rank reaches the same
/// verdict without a second round. Only when they differ do the ranks gather
/// their calls, to name who called what.
///
/// Notices: a rank that fails sends each other rank a fixed-size Notice, and
/// waits that run long look for them, so a failure anywhere ends the call
/// everywhere within a poll, not at the deadline.
class Control {
 public:
  Control() = default;
  /// Collective over `comm`, like MPI_Comm_dup.
  Control(MPI_Comm comm, bool check_calls) : s_(std::make_unique<State>()) {
    s_->check = check_calls;
    if (MPI_Comm_dup(comm, &s_->comm) != MPI_SUCCESS) throw Error("gradsync: MPI_Comm_dup of the control channel failed");
    MPI_Comm_set_errhandler(s_->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(s_->comm, &s_->rank);
    MPI_Comm_size(s_->comm, &s_->size);
    s_->gone.assign(static_cast<std::size_t>(s_->size), never);
    s_->heard.resize(static_cast<std::size_t>(s_->size));
    // A notice sent on an earlier communicator could still be in flight when
    // MPI hands its context to a new one: a nonce per communicator tells it.
    if (s_->rank == 0) {
      std::random_device rd;
      s_->nonce = (std::uint64_t{rd()} << 32) ^ rd() ^
                  static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    }
    MPI_Bcast(&s_->nonce, 1, MPI_UINT64_T, 0, s_->comm);
  }
  Control(Control&&) noexcept = default;
  Control& operator=(Control&&) noexcept = default;
  Control(const Control&) = delete;
  Control& operator=(const Control&) = delete;
  /// Says goodbye to the peers (unless this rank's failure already did), so
  /// that a peer still waiting for it fails at once, naming it.
  ~Control() {
    if (!s_) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) {
      // MPI is gone, and with it every request: nothing to free.
      s_.release();  // NOLINT: buffers MPI may have held; the process is ending
      return;
    }
    if (!s_->spoken) send(true, FailureKind::aborted, s_->call.seq, "", -1);
    bool busy = s_->abandoned;
    for (auto& o : s_->outbox) {
      int done = 0;
      MPI_Test(&o.request, &done, MPI_STATUS_IGNORE);
      if (!done) {
        MPI_Request_free(&o.request);
        busy = true;
      }
    }
    // Kept, not freed, for the reason the data duplicate is (see ~Endpoint):
    // the notices just sent are exactly such late messages for the peers.
    // A request MPI still holds writes into these buffers when it ends; a
    // few hundred bytes are left behind rather than risk that.
    if (busy) s_.release();  // NOLINT
  }

  bool checking() const noexcept { return s_->check; }

  /// Starts `call`: fails at once if a peer is known not to join it, then
  /// posts the agreement.
  void begin(const CallInfo& call) {
    State& s = *s_;
    s.call = call;
    for (int q = 0; q < s.size; ++q) {
      if (s.gone[static_cast<std::size_t>(q)] < call.seq) throw_notice(q, std::chrono::nanoseconds::zero(), -1);
    }
    if (!s.check) return;
    s.wire = WireCall::of(call);
    const std::uint64_t h = s.wire.hash();
    s.mine[0] = h;
    s.mine[1] = ~h;
    const int rc = MPI_Iallreduce(s.mine, s.verdict, 2, MPI_UINT64_T, MPI_BAND, s.comm, &s.agreement);
    if (rc != MPI_SUCCESS) throw Error("gradsync: rank " + std::to_string(s.rank) + ": MPI_Iallreduce of the call agreement failed");
    s.pending = true;
  }

  /// True once the ranks' verdict on the current call is in and they agree
  /// (at once when calls are not checked); throws InvalidArgument naming
  /// both calls when they disagree. Never blocks.
  bool agreed(std::chrono::nanoseconds timeout) {
    State& s = *s_;
    if (!s.pending) return true;
    int done = 0;
    if (MPI_Test(&s.agreement, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
      s.pending = false;
      throw Error("gradsync: rank " + std::to_string(s.rank) + ": MPI_Test of the call agreement failed in " +
                  describe(s.call));
    }
    if (!done) return false;
    s.pending = false;
    if ((s.verdict[0] ^ s.verdict[1]) != ~std::uint64_t{0}) disagree(timeout);
    return true;
  }

  /// The slow part of a wait: the agreement, then notices from peers.
  /// Throws if the current call cannot complete. `waiting_for` is the peer
  /// the wait is for (-1: none in particular), passed on to the others.
  void poll(std::chrono::nanoseconds timeout, int waiting_for) {
    agreed(timeout);
    State& s = *s_;
    for (Notice n; receive(n);) {
      if (s.gone[static_cast<std::size_t>(n.rank)] < s.call.seq) throw_notice(n.rank, timeout, waiting_for);
    }
  }

  /// After an MPI error or a message of the wrong size: waits a while for
  /// the verdict, so that ranks calling different things are told so rather
  /// than shown what it did to MPI. Returns when they agree or cannot tell.
  void explain(std::chrono::nanoseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!agreed(timeout)) {
      if (std::chrono::steady_clock::now() > deadline) return abandon();
      std::this_thread::yield();
    }
  }

  /// Whether the agreement for the current call is still in flight.
  bool pending() const noexcept { return s_->pending; }

  /// Gives up on the agreement in flight: MPI cannot cancel a collective.
  void abandon() noexcept {
    if (s_->pending) s_->abandoned = true;
    s_->pending = false;
  }

  /// Tells every other rank that this one failed, unless they know already
  /// (it failed because of them, or said so before). Never blocks.
  void tell(FailureKind kind, std::string_view why, int waiting_for = -1) noexcept {
    if (!s_ || s_->spoken) return;
    abandon();
    send(false, kind, s_->call.seq, why, waiting_for);
  }

  /// What the others say after this rank timed out: tells them first, then
  /// listens for up to `grace`, and returns a sentence to append naming those
  /// that failed too and those that said nothing (dead, stuck, elsewhere).
  std::string after_timeout(std::string_view what, std::chrono::nanoseconds grace, int waiting_for) {
    State& s = *s_;
    tell(FailureKind::timeout, what, waiting_for);
    const auto until = std::chrono::steady_clock::now() + grace;
    std::vector<bool> heard(static_cast<std::size_t>(s.size), false);
    heard[static_cast<std::size_t>(s.rank)] = true;
    for (int q = 0; q < s.size; ++q) {
      if (s.gone[static_cast<std::size_t>(q)] < s.call.seq) heard[static_cast<std::size_t>(q)] = true;
    }
    while (std::count(heard.begin(), heard.end(), false) > 0 && std::chrono::steady_clock::now() < until) {
      Notice n;
      if (receive(n)) {
        heard[static_cast<std::size_t>(n.rank)] = true;
      } else {
        std::this_thread::yield();
      }
    }
    std::string said, silent;
    int answered = 0;
    for (int q = 0; q < s.size; ++q) {
      if (q == s.rank) continue;
      if (!heard[static_cast<std::size_t>(q)]) {
        silent += (silent.empty() ? "" : ", ") + std::to_string(q);
        continue;
      }
      ++answered;
      const Notice& n = s.heard[static_cast<std::size_t>(q)];
      if (n.left) {
        said += "; " + account(q);
      } else if (n.waiting_for >= 0) {
        said += "; rank " + std::to_string(q) + " gave up too, waiting for rank " + std::to_string(n.waiting_for);
      } else {
        said += "; rank " + std::to_string(q) + " gave up too";
      }
    }
    // Only when some answered does silence single a rank out.
    if (answered && !silent.empty()) said += "; no word from rank " + silent + " (dead, stuck or not in this call)";
    return said;
  }

 private:
  static constexpr std::uint64_t never = std::numeric_limits<std::uint64_t>::max();
  static constexpr int notice_tag = 1;

  struct Outgoing {
    MPI_Request request = MPI_REQUEST_NULL;
    std::unique_ptr<Notice> notice;
  };
  /// On the heap, so that MPI's pointers into it survive a move.
  struct State {
    MPI_Comm comm = MPI_COMM_NULL;
    int rank = 0;
    int size = 1;
    bool check = true;
    std::uint64_t nonce = 0;
    CallInfo call{};
    WireCall wire{};
    std::uint64_t mine[2] = {};
    std::uint64_t verdict[2] = {};
    MPI_Request agreement = MPI_REQUEST_NULL;
    bool pending = false;    ///< agreement posted, verdict not yet read
    bool abandoned = false;  ///< a collective request was given up
    bool spoken = false;     ///< the peers know this rank failed or left
    std::vector<WireCall> calls;  ///< every rank's call, gathered on disagreement
    MPI_Request gather = MPI_REQUEST_NULL;
    /// Per rank: the number of calls after which it is gone (never: here).
    std::vector<std::uint64_t> gone;
    std::vector<Notice> heard;
    std::vector<Outgoing> outbox;
  };

  void send(bool left, FailureKind kind, std::uint64_t seq, std::string_view why, int waiting_for) noexcept {
    State& s = *s_;
    s.spoken = true;
    std::erase_if(s.outbox, [](Outgoing& o) {
      int done = 0;
      MPI_Test(&o.request, &done, MPI_STATUS_IGNORE);
      return done != 0;
    });
    try {
      for (int q = 0; q < s.size; ++q) {
        if (q == s.rank) continue;
        auto n = std::make_unique<Notice>();
        n->left = left ? 1 : 0;
        n->kind = kind;
        n->rank = s.rank;
        n->seq = seq;
        n->nonce = s.nonce;
        n->waiting_for = waiting_for;
        std::memcpy(n->text, why.data(), std::min(why.size(), sizeof(n->text) - 1));
        Outgoing o{MPI_REQUEST_NULL, std::move(n)};
        if (MPI_Isend(o.notice.get(), sizeof(Notice), MPI_BYTE, q, notice_tag, s.comm, &o.request) == MPI_SUCCESS) {
          s.outbox.push_back(std::move(o));
        }
      }
    } catch (...) {
      // Out of memory while failing: the peers will time out instead.
    }
  }

  /// Takes one notice for this communicator off the wire, if one is there.
  bool receive(Notice& n) {
    State& s = *s_;
    for (;;) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, notice_tag, s.comm, &flag, &st) != MPI_SUCCESS || !flag) return false;
      if (MPI_Recv(&n, sizeof(Notice), MPI_BYTE, st.MPI_SOURCE, notice_tag, s.comm, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
        return false;
      }
      if (n.nonce != s.nonce || n.rank != st.MPI_SOURCE) continue;
      auto& gone = s.gone[static_cast<std::size_t>(n.rank)];
      // Failing in call k means it completes no call from k on.
      gone = std::min(gone, n.left ? n.seq : n.seq - 1);
      s.heard[static_cast<std::size_t>(n.rank)] = n;
      return true;
    }
  }

  /// What rank q's notice said, as part of a sentence.
  std::string account(int q) const {
    const Notice& n = s_->heard[static_cast<std::size_t>(q)];
    if (n.left) {
      return "rank " + std::to_string(q) + " left (destroyed its communicator) after " + std::to_string(n.seq) + " calls";
    }
    std::string_view what = n.what();
    if (what.starts_with("gradsync: ")) what.remove_prefix(10);
    return "rank " + std::to_string(q) + " failed: " + std::string(what);
  }

  /// This rank cannot finish its call because of rank q's notice.
  [[noreturn]] void throw_notice(int q, std::chrono::nanoseconds timeout, int waiting_for) {
    State& s = *s_;
    const Notice& n = s.heard[static_cast<std::size_t>(q)];
    // A disagreement is best named from this rank's own view of it: the
    // agreement of the call the peer refused is complete, or about to be.
    if (!n.left && n.kind == FailureKind::invalid_argument && s.pending) explain(timeout);
    std::string what = "gradsync: rank " + std::to_string(s.rank) + " abandoned " + describe(s.call) + " because " +
                       account(q);
    if (n.left) {
      s.spoken = true;
      abandon();
      throw Aborted(what);
    }
    // Whom this rank was waiting for is news to the others: with it, a
    // timeout elsewhere can name the rank that is really missing.
    if (waiting_for >= 0) what += "; rank " + std::to_string(s.rank) + " was waiting for rank " + std::to_string(waiting_for);
    tell(n.kind == FailureKind::timeout ? FailureKind::timeout : FailureKind::aborted, what, waiting_for);
    switch (n.kind) {
      case FailureKind::invalid_argument: throw InvalidArgument(what);
      case FailureKind::timeout: throw Timeout(what);
      default: throw Aborted(what);
    }
  }

  /// The ranks disagree: every rank gathers every rank's call, then names
  /// itself and the first rank whose call differs from its own.
  [[noreturn]] void disagree(std::chrono::nanoseconds timeout) {
    State& s = *s_;
    s.spoken = true;  // every rank reaches this verdict on its own
    const std::string mine = "gradsync: ranks disagree on a collective: rank " + std::to_string(s.rank) + " called " +
                             describe(s.call);
    s.calls.assign(static_cast<std::size_t>(s.size), WireCall{});
    bool done = MPI_Iallgather(&s.wire, sizeof(WireCall), MPI_BYTE, s.calls.data(), sizeof(WireCall), MPI_BYTE, s.comm,
                               &s.gather) == MPI_SUCCESS;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (int flag = 0; done && !flag;) {
      if (MPI_Test(&s.gather, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) done = false;
      if (!flag && std::chrono::steady_clock::now() > deadline) {
        s.abandoned = true;
        done = false;
      }
      if (!flag) std::this_thread::yield();
    }
    if (done) {
      for (int q = 0; q < s.size; ++q) {
        const WireCall& theirs = s.calls[static_cast<std::size_t>(q)];
        if (!(theirs == s.wire)) throw InvalidArgument(mine + ", rank " + std::to_string(q) + " called " + describe(theirs.call()));
      }
    }
    throw InvalidArgument(mine + ", and another rank called something else (which, the ranks could not tell in time)");
  }

  std::unique_ptr<State> s_;
};

}  // namespace gradsync::detail::mpi
