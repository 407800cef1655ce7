#pragma once
/// \file Control: the side channel on which Mpi ranks check that they agree
/// on each call, and tell each other that they failed or left.

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gradsync/backend/mpi/agreement_steps.hpp"
#include "gradsync/backend/mpi/idle_backoff.hpp"
#include "gradsync/backend/mpi/peer_watch.hpp"
#include "gradsync/backend/mpi/shared_slots.hpp"
#include "gradsync/backend/mpi/wire.hpp"
#include "gradsync/core/call_info.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/rank_names.hpp"

namespace gradsync::detail::mpi {

/// A second private duplicate of the user's communicator, apart from the one
/// the data moves on, so that nothing here can match an algorithm's message.
///
/// Agreement: the ranks all-reduce (bitwise and) {h, ~h}, h the hash of
/// each one's CallInfo. The result is {h, ~h} again on every rank exactly
/// when all hashes are equal, so every rank reaches the same verdict without
/// a second round. Only when they differ do the ranks gather their calls, to
/// name who called what. Nothing blocks: the waits advance it.
///
/// When every rank runs on one host, the all-reduce is read off shared
/// memory: each rank writes its hash and call number into a cache line of
/// its own, and reads the others' (two slots, by the call number's parity:
/// no rank can be two calls ahead of a reader). That costs no message,
/// where a 16-byte exchange costs a tiny call half its time again.
/// Otherwise (or with GRADSYNC_MPI_AGREEMENT=messages in every rank's
/// environment) it is recursive doubling written out in MPI_Isend/MPI_Irecv
/// of 16 bytes (lg p rounds; for other p, the first 2r ranks fold in pairs
/// first and unfold last, r = p - the largest power of two <= p), not
/// MPI_Iallreduce, whose non-blocking machinery costs more than the
/// messages. Its receives for the next call are posted when a call's
/// verdict is in, so that a round costs a send and a test.
///
/// Notices: a rank that fails sends each other rank a fixed-size Notice, and
/// waits that run long look for them, so a failure anywhere ends the call
/// everywhere within a poll, not at the deadline. On one host a rank also
/// raises a flag in its slot before its notices leave, and a call starts
/// without probing for notices while no peer's flag is up. Waits probe
/// regardless: that also keeps MPI moving for the peers (see poll).
///
/// Release: a failed rank's unfinished sends may still be read by a peer
/// that matched them (see Endpoint::let_sends_go), so once a rank has taken
/// back its own receives it says so (a notice marked `released`, or its
/// goodbye), and may_read tells a rank whose sends wait which peers can no
/// longer read them.
class Control {
 public:
  Control() = default;
  /// Collective over `comm`, like MPI_Comm_dup. `one_host`: every rank of
  /// `comm` runs on this host (MPI_COMM_TYPE_SHARED says so).
  Control(MPI_Comm comm, bool check_calls, bool one_host) : s_(std::make_unique<State>()) {
    s_->check = check_calls;
    if (MPI_Comm_dup(comm, &s_->comm) != MPI_SUCCESS) throw Error("gradsync: MPI_Comm_dup of the control channel failed");
    MPI_Comm_set_errhandler(s_->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(s_->comm, &s_->rank);
    MPI_Comm_size(s_->comm, &s_->size);
    s_->gone.assign(static_cast<std::size_t>(s_->size), never);
    s_->heard.resize(static_cast<std::size_t>(s_->size));
    s_->released.assign(static_cast<std::size_t>(s_->size), 0);
    // A notice sent on an earlier communicator could still be in flight when
    // MPI hands its context to a new one: a nonce per communicator tells it.
    if (s_->rank == 0) {
      std::random_device rd;
      s_->nonce = (std::uint64_t{rd()} << 32) ^ rd() ^
                  static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    }
    MPI_Bcast(&s_->nonce, 1, MPI_UINT64_T, 0, s_->comm);
    // Mapped even when calls are not checked: the slots also say who has
    // sent notices, which spares every call its probes for them, and which
    // process each rank is. Otherwise the agreement goes by messages.
    s_->slots = map_shared_slots(s_->comm, s_->rank, s_->size, s_->nonce, one_host, s_->slots_bytes);
    if (s_->slots) s_->watch = PeerWatch(s_->slots, s_->size, s_->rank);
    // Without the slots the agreement goes by messages; set up even when
    // calls are not checked, since labelled calls are checked regardless.
    if (s_->slots) return;
    s_->steps = agreement_steps(s_->rank, s_->size);
    const std::size_t n = s_->steps.size();
    s_->in.resize(n);
    s_->out.resize(n);
    s_->recvs.assign(n, MPI_REQUEST_NULL);
    s_->sends.assign(n, MPI_REQUEST_NULL);
    arm();
  }
  Control(Control&&) noexcept = default;
  Control& operator=(Control&&) noexcept = default;
  Control(const Control&) = delete;
  Control& operator=(const Control&) = delete;
  /// Says goodbye to the peers (see leave).
  ~Control() {
    if (!s_) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    // Before unmapping: sending raises this rank's flag in its slot.
    if (!finalized) leave();
    // The peers keep their own mappings: the segment lives while any does.
    unmap_shared_slots(s_->slots, s_->slots_bytes);
    if (finalized) {
      // MPI is gone, and with it every request: nothing to free.
      s_.release();  // NOLINT: buffers MPI may have held; the process is ending
      return;
    }
    bool busy = s_->abandoned;
    for (auto& o : s_->outbox) busy = drop(o.request) || busy;
    // Receives posted for a call that never comes are taken back; a peer's
    // message for it stays unmatched on this never-freed communicator.
    for (auto& r : s_->recvs) {
      if (r == MPI_REQUEST_NULL) continue;
      MPI_Cancel(&r);
      // A cancelled, unmatched receive completes at once (Open MPI), but a
      // destructor must not trust that with an unbounded MPI_Wait: give it a
      // second, then free the request and keep its buffer (busy).
      const IdleBackoff backoff;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
      int done = 0;
      while (MPI_Test(&r, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done &&
             std::chrono::steady_clock::now() < deadline) {
        backoff.idle();
      }
      if (!done) busy = drop(r) || busy;
    }
    for (auto& r : s_->sends) busy = drop(r) || busy;
    // Kept, not freed, for the reason the data duplicate is (see ~Endpoint):
    // the notices just sent are exactly such late messages for the peers.
    // A request MPI still holds writes into these buffers when it ends; a
    // few hundred bytes are left behind rather than risk that.
    if (busy) s_.release();  // NOLINT
  }

  bool checking() const noexcept { return s_->check; }

  /// How errors name this communicator's ranks (set by split).
  const RankNames& names() const noexcept { return s_ ? s_->names : RankNames::world(); }
  void set_names(RankNames names) noexcept { s_->names = std::move(names); }

  /// Starts `call`: fails at once if a peer is known not to join it, then
  /// sends this rank's part of the agreement. `wire` and `hash` are the
  /// call's WireCall and its hash, which the endpoint has made already;
  /// `timeout` bounds the wait for a notice whose flag is up.
  void begin(const CallInfo& call, const WireCall& wire, std::uint64_t hash, std::chrono::nanoseconds timeout) {
    State& s = *s_;
    s.call = call;
    // On one host this rank says it is in the call before it looks for the
    // peers' flags, and a failed peer raises its flag before it reads this
    // slot (may_read), all sequentially consistent: so either that peer
    // sees this rank in the call and keeps its sends until this rank lets
    // go, or this rank sees its flag here and refuses the call below.
    if (s.slots) {
      Slot& mine = s.slots[s.rank];
      const std::size_t b = call.seq & 1;
      std::atomic_ref<std::uint64_t>(mine.h[b]).store(hash, std::memory_order_relaxed);
      std::atomic_ref<std::uint64_t>(mine.seq[b]).store(call.seq, std::memory_order_seq_cst);
    }
    // Notices already here first: a peer that gave up on this call (or an
    // earlier one) may have let go of sends that a receive posted now would
    // match. Two MPI_Iprobes when there are none: Open MPI's probe matches
    // first and advances the transport after, so one probe misses a notice
    // that has already arrived but is not yet taken off the shared-memory
    // queue. On one host the slots say whether any peer has sent one at all:
    // the probes cost a small call more than the rest of its setup.
    if (notice_unheard()) {
      for (int round = 0; round < 2; ++round) {
        for (Notice n; receive(n);) {
        }
      }
      await_flagged(timeout);
    }
    for (int q = 0; q < s.size; ++q) {
      if (s.gone[static_cast<std::size_t>(q)] < call.seq) throw_notice(q, std::chrono::nanoseconds::zero(), -1);
    }
    // A labelled call is checked even where calls are not: its label is what
    // tells ranks that would train different models apart (a trainer's
    // step, unit, learning rate), which no other field of the call does.
    if ((!s.check && call.label.empty()) || s.size == 1) return;
    // Armed at the end of the previous call, unless posting failed there.
    if (!s.slots && !s.armed && !arm()) {
      throw Error("gradsync: " + s.names.who(s.rank) + ": MPI_Irecv of the call agreement failed in " +
                  describe(call));
    }
    s.armed = false;
    s.wire = wire;
    const std::uint64_t h = hash;
    s.value = {h, ~h};
    s.step = 0;
    s.sent = 0;
    s.seen = 0;
    s.pending = true;
    // (On one host, the hash is in the slot already.)
    if (s.slots) return;
    send_step();
  }

  /// True once the ranks' verdict on the current call is in and they agree
  /// (at once when calls are not checked); throws InvalidArgument naming
  /// both calls when they disagree. Never blocks.
  bool agreed(std::chrono::nanoseconds timeout) {
    State& s = *s_;
    if (!s.pending) return true;
    if (!(s.slots ? read_slots() : advance())) return false;
    s.pending = false;
    if ((s.value.h ^ s.value.not_h) != ~std::uint64_t{0}) disagree(timeout);
    if (!s.slots) arm();
    return true;
  }

  /// The slow part of a wait: the agreement, then notices from peers.
  /// Throws if the current call cannot complete. `waiting_for` is the peer
  /// the wait is for (-1: none in particular), passed on to the others.
  void poll(std::chrono::nanoseconds timeout, int waiting_for) {
    agreed(timeout);
    State& s = *s_;
    // Probed even while no peer's flag is up (unlike begin): the probe is
    // also this wait's call into MPI, and Open MPI moves messages only inside
    // MPI calls. A peer's large send can need this rank's MPI to run after
    // this rank's receive is done, while this rank waits for that peer's
    // next call: a wait on the shared slots alone would never let it finish.
    for (Notice n; receive(n);) {
      if (s.gone[static_cast<std::size_t>(n.rank)] < s.call.seq) throw_notice(n.rank, timeout, waiting_for);
    }
  }

  /// After an MPI error or a message of the wrong size: waits a while for
  /// the verdict, so that ranks calling different things are told so rather
  /// than shown what it did to MPI. Returns when they agree or cannot tell.
  void explain(std::chrono::nanoseconds timeout) {
    const IdleBackoff backoff;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!agreed(timeout)) {
      if (std::chrono::steady_clock::now() > deadline) return abandon();
      progress();
      backoff.idle();
    }
  }

  /// Whether the agreement for the current call is still in flight.
  bool pending() const noexcept { return s_->pending; }

  /// The ranks whose shared-memory slot does not show the current call yet,
  /// for a timeout's message. Empty across hosts, where the agreement's
  /// messages fold many ranks into one and cannot name them.
  std::vector<int> not_joined() {
    State& s = *s_;
    std::vector<int> missing;
    if (!s.slots) return missing;
    const std::size_t b = s.call.seq & 1;
    for (int q = 0; q < s.size; ++q) {
      if (q == s.rank) continue;
      // A rank already past this call (its other half holds a later one)
      // has joined it: compare, do not test for equality.
      if (std::atomic_ref<std::uint64_t>(s.slots[q].seq[b]).load(std::memory_order_acquire) < s.call.seq)
        missing.push_back(q);
    }
    return missing;
  }

  /// Gives up on the agreement in flight; the destructor takes back its
  /// receives.
  void abandon() noexcept { s_->pending = false; }

  /// Tells every other rank that this one failed, unless they know already
  /// (it failed because of them, or said so before). Never blocks. `seq` is
  /// the call that fails: the current one, or, for a communicator failed
  /// while idle (for a failure on another one), the next, which the peers
  /// may be waiting in already.
  /// `released`: this rank has taken back its receives on the data channel
  /// and posts none again; said once, alone if the peers heard of the
  /// failure already.
  void tell(FailureKind kind, std::string_view why, int waiting_for = -1, std::uint64_t seq = 0,
            bool released = false) noexcept {
    if (!s_) return;
    if (s_->spoken) {
      if (released) send_released();
      return;
    }
    abandon();
    send(false, kind, std::max(seq, s_->call.seq), why, waiting_for, false, seq <= s_->call.seq, released);
  }

  /// Says goodbye to the peers (unless this rank's failure already did), so
  /// that a peer still waiting for it fails at once, naming it. Only once
  /// this rank's receives are taken back: a goodbye also says `released`.
  void leave() noexcept {
    if (!s_) return;
    if (s_->spoken) return send_released();
    send(true, FailureKind::aborted, s_->call.seq, "", -1, std::uncaught_exceptions() > 0, true, true);
  }

  /// Whether rank q may still read a send this rank posted in call `seq`
  /// (once this rank has told the peers it failed or left): yes unless q
  /// said it released (see tell), or, on one host, q has not begun that
  /// call, and so will see this rank's flag before it posts a receive (see
  /// begin), or q's process is gone (PeerWatch: killed ranks say nothing).
  /// Across hosts only q's word counts. Takes the notices that have arrived.
  bool may_read(int q, std::uint64_t seq) noexcept {
    State& s = *s_;
    for (Notice n; receive(n);) {
    }
    if (s.released[static_cast<std::size_t>(q)]) return false;
    if (!s.slots) return true;
    if (std::atomic_ref<std::uint64_t>(s.slots[q].seq[seq & 1]).load(std::memory_order_seq_cst) < seq) return false;
    return !gone(q);
  }

  /// Whether q's process is known to be gone: on one host, where the slots
  /// say which process it is (see PeerWatch); never across hosts.
  bool gone(int q) noexcept { return s_->slots && s_->watch.gone(q); }

  /// What the others say after this rank timed out: tells them first, then
  /// listens for up to `grace`, and returns a sentence to append naming those
  /// that failed too and those that said nothing (dead, stuck, elsewhere).
  std::string after_timeout(std::string_view what, std::chrono::nanoseconds grace, int waiting_for) {
    State& s = *s_;
    tell(FailureKind::timeout, what, waiting_for);
    const IdleBackoff backoff;
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
        backoff.idle();
      }
    }
    std::string said;
    std::vector<int> silent;
    int answered = 0;
    for (int q = 0; q < s.size; ++q) {
      if (q == s.rank) continue;
      if (!heard[static_cast<std::size_t>(q)]) {
        silent.push_back(q);
        continue;
      }
      ++answered;
      const Notice& n = s.heard[static_cast<std::size_t>(q)];
      if (n.left) {
        said += "; " + account(q);
      } else if (n.waiting_for >= 0) {
        said += "; " + s.names.who(q) + " gave up too, waiting for " + s.names.who(n.waiting_for);
      } else {
        said += "; " + s.names.who(q) + " gave up too";
      }
    }
    // Only when some answered does silence single a rank out.
    if (answered && !silent.empty()) {
      said += "; no word from " + s.names.list(silent) + " (dead, stuck or not in this call)";
    }
    return said;
  }

 private:
  static constexpr std::uint64_t never = std::numeric_limits<std::uint64_t>::max();
  static constexpr int notice_tag = 1;

  struct Outgoing {
    MPI_Request request = MPI_REQUEST_NULL;
    std::unique_ptr<Notice> notice;
  };
  /// What the agreement reduces: {h, ~h}, and together {and h, and ~h}.
  struct Word {
    std::uint64_t h = 0;
    std::uint64_t not_h = 0;
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
    std::vector<AgreementStep> steps;
    std::vector<Word> in;   ///< per step, what its peer sent
    std::vector<Word> out;  ///< per step, what this rank sent
    std::vector<MPI_Request> recvs;
    std::vector<MPI_Request> sends;
    Word value;
    std::size_t step = 0;    ///< the first step whose receive is not in
    std::size_t sent = 0;    ///< steps whose send is posted
    Slot* slots = nullptr;   ///< the shared segment, one slot per rank
    std::size_t slots_bytes = 0;
    PeerWatch watch;         ///< the peers' processes, with the slots
    int seen = 0;            ///< ranks whose slot this call has read
    bool armed = false;      ///< the next call's receives are posted
    bool pending = false;    ///< agreement started, verdict not yet read
    bool abandoned = false;  ///< a collective request was given up
    bool spoken = false;     ///< the peers know this rank failed or left
    bool released_sent = false;  ///< the peers know this rank posts no receive again
    Notice said{};               ///< this rank's notice, if it sent one
    bool said_any = false;       ///< whether it did
    RankNames names;         ///< how errors name the ranks
    std::vector<WireCall> calls;  ///< every rank's call, gathered on disagreement
    MPI_Request gather = MPI_REQUEST_NULL;
    /// Per rank: the number of calls after which it is gone (never: here).
    std::vector<std::uint64_t> gone;
    std::vector<Notice> heard;
    /// Per rank: it said it holds no receive on the data channel (see tell).
    std::vector<std::uint8_t> released;
    std::vector<Outgoing> outbox;
  };

  /// Lets MPI advance, as every wait must (see poll); the notice, if one
  /// is there, stays for receive() to take.
  void progress() noexcept {
    int flag = 0;
    MPI_Iprobe(MPI_ANY_SOURCE, notice_tag, s_->comm, &flag, MPI_STATUS_IGNORE);
  }

  /// Whether a peer's notice may be waiting to be taken: always without the
  /// shared segment; with it, only once a peer that this rank has not heard
  /// from yet has raised its flag (each rank sends one notice at most).
  bool notice_unheard() const noexcept { return !s_->slots || flagged() >= 0; }

  /// A peer whose flag is up and whose first notice has not been taken yet;
  /// -1 if none (or no shared segment). A peer that said only `released`
  /// failed for a reason every rank hears of otherwise: it counts as heard.
  int flagged() const noexcept {
    const State& s = *s_;
    if (!s.slots) return -1;
    for (int q = 0; q < s.size; ++q) {
      const auto i = static_cast<std::size_t>(q);
      if (q == s.rank || s.gone[i] != never || s.released[i]) continue;
      if (std::atomic_ref<std::uint64_t>(s.slots[q].spoke).load(std::memory_order_seq_cst) != 0) return q;
    }
    return -1;
  }

  /// Waits until every peer whose flag is up has been heard: its notice
  /// leaves just after the flag goes up, and it may have let go of sends
  /// that a receive posted before then would match (see begin). Past
  /// `timeout` the call is refused, naming that peer.
  void await_flagged(std::chrono::nanoseconds timeout) {
    const IdleBackoff backoff;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (int q = flagged(); q >= 0; q = flagged()) {
      Notice n;
      if (receive(n)) continue;
      if (std::chrono::steady_clock::now() > deadline) {
        const State& s = *s_;
        throw Aborted("gradsync: " + s.names.who(s.rank) + " refused " + describe(s.call) + ": " + s.names.who(q) +
                      " says it failed or left, but its notice did not arrive within the deadline");
      }
      backoff.idle();
    }
  }

  /// Reads the other ranks' slots for the current call, as far as they have
  /// written them. True once every rank's hash is in.
  bool read_slots() noexcept {
    State& s = *s_;
    const std::size_t b = s.call.seq & 1;
    for (; s.seen < s.size; ++s.seen) {
      if (s.seen == s.rank) continue;
      Slot& q = s.slots[s.seen];
      if (std::atomic_ref<std::uint64_t>(q.seq[b]).load(std::memory_order_acquire) != s.call.seq) return false;
      const std::uint64_t h = std::atomic_ref<std::uint64_t>(q.h[b]).load(std::memory_order_relaxed);
      s.value.h &= h;
      s.value.not_h &= ~h;
    }
    return true;
  }

  /// Posts the receives of the next call's agreement. False if MPI refused.
  bool arm() noexcept {
    State& s = *s_;
    for (std::size_t i = 0; i < s.steps.size(); ++i) {
      const AgreementStep& st = s.steps[i];
      if (st.from < 0 || s.recvs[i] != MPI_REQUEST_NULL) continue;
      if (MPI_Irecv(&s.in[i], 2, MPI_UINT64_T, st.from, st.tag, s.comm, &s.recvs[i]) != MPI_SUCCESS) return false;
    }
    s.armed = true;
    return true;
  }

  /// Posts the send of the current step, if it has one and it is not posted.
  void send_step() {
    State& s = *s_;
    if (s.sent > s.step) return;
    const AgreementStep& st = s.steps[s.step];
    s.sent = s.step + 1;
    if (st.to < 0) return;
    s.out[s.step] = s.value;
    if (MPI_Isend(&s.out[s.step], 2, MPI_UINT64_T, st.to, st.tag, s.comm, &s.sends[s.step]) != MPI_SUCCESS) {
      s.pending = false;
      throw Error("gradsync: " + s.names.who(s.rank) + ": MPI_Isend of the call agreement failed in " +
                  describe(s.call));
    }
  }

  /// Takes the agreement as far as the messages in allow. True when every
  /// step is done, its sends included (their buffers serve the next call).
  bool advance() {
    State& s = *s_;
    for (; s.step < s.steps.size(); ++s.step) {
      send_step();
      const AgreementStep& st = s.steps[s.step];
      if (st.from < 0) continue;
      int done = 0;
      if (MPI_Test(&s.recvs[s.step], &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
        s.pending = false;
        throw Error("gradsync: " + s.names.who(s.rank) + ": MPI_Test of the call agreement failed in " +
                    describe(s.call));
      }
      if (!done) return false;
      s.value.h &= s.in[s.step].h;
      s.value.not_h &= s.in[s.step].not_h;
    }
    int done = 0;
    if (MPI_Testall(static_cast<int>(s.sends.size()), s.sends.data(), &done, MPI_STATUSES_IGNORE) != MPI_SUCCESS) {
      s.pending = false;
      throw Error("gradsync: " + s.names.who(s.rank) + ": MPI_Testall of the call agreement failed in " +
                  describe(s.call));
    }
    return done != 0;
  }

  /// Lets go of a request: done, or freed while MPI still holds its buffer
  /// (then true: the buffer must outlive this object).
  static bool drop(MPI_Request& r) noexcept {
    if (r == MPI_REQUEST_NULL) return false;
    int done = 0;
    MPI_Test(&r, &done, MPI_STATUS_IGNORE);
    if (done) return false;
    MPI_Request_free(&r);
    return true;
  }

  void send(bool left, FailureKind kind, std::uint64_t seq, std::string_view why, int waiting_for,
            bool unwound = false, bool joined = true, bool released = false) noexcept {
    State& s = *s_;
    s.spoken = true;
    s.said = Notice::make(s.rank, s.nonce, left, kind, seq, why, waiting_for, unwound, joined, released);
    s.said_any = true;
    s.released_sent = released;
    post(s.said);
  }

  /// The notice already sent again, now saying `released` (see tell), or
  /// where none was sent, one that says only that.
  void send_released() noexcept {
    State& s = *s_;
    if (s.released_sent) return;
    s.released_sent = true;
    Notice n = s.said_any ? s.said
                          : Notice::make(s.rank, s.nonce, false, FailureKind::aborted, s.call.seq, "", -1, false, true, true);
    n.released = 1;
    n.only_released = s.said_any ? 0 : 1;
    post(n);
  }

  void post(const Notice& said) noexcept {
    State& s = *s_;
    // Raised before any notice leaves: a peer that finds it down has no
    // notice of this rank's to probe for. Sequentially consistent: see begin.
    if (s.slots) std::atomic_ref<std::uint64_t>(s.slots[s.rank].spoke).store(1, std::memory_order_seq_cst);
    std::erase_if(s.outbox, [](Outgoing& o) {
      int done = 0;
      MPI_Test(&o.request, &done, MPI_STATUS_IGNORE);
      return done != 0;
    });
    try {
      for (int q = 0; q < s.size; ++q) {
        if (q == s.rank) continue;
        Outgoing o{MPI_REQUEST_NULL, std::make_unique<Notice>(said)};
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
      // A goodbye is sent only once the receives are taken back.
      if (n.released || n.left) s.released[static_cast<std::size_t>(n.rank)] = 1;
      if (n.only_released) return true;
      auto& gone = s.gone[static_cast<std::size_t>(n.rank)];
      // Failing in call k means it completes no call from k on.
      gone = std::min(gone, n.left || n.seq == 0 ? n.seq : n.seq - 1);
      s.heard[static_cast<std::size_t>(n.rank)] = n;
      return true;
    }
  }

  /// What rank q's notice said, as part of a sentence.
  std::string account(int q) const {
    const State& s = *s_;
    const Notice& n = s.heard[static_cast<std::size_t>(q)];
    if (n.left) {
      const std::string calls = std::to_string(n.seq) + (n.seq == 1 ? " call" : " calls");
      if (n.unwound) {
        return s.names.who(q) + " will never join it: an exception on that rank destroyed its communicator after " +
               calls;
      }
      return s.names.who(q) + " left after " + calls + " (its communicator was destroyed), so it will never join it";
    }
    return s.names.failed(q, n.what());
  }

  /// This rank cannot finish its call because of rank q's notice.
  [[noreturn]] void throw_notice(int q, std::chrono::nanoseconds timeout, int waiting_for) {
    State& s = *s_;
    const Notice& n = s.heard[static_cast<std::size_t>(q)];
    // A disagreement is best named from this rank's own view of it: the
    // agreement of the call the peer refused is complete, or about to be.
    // Not so for a peer that failed before it began this call (for a
    // disagreement on another communicator): that agreement never ends.
    if (!n.left && n.joined && n.kind == FailureKind::invalid_argument && s.pending) explain(timeout);
    std::string what = "gradsync: " + s.names.who(s.rank) + " abandoned " + describe(s.call) + " because " + account(q);
    if (n.left) {
      s.spoken = true;
      abandon();
      throw Aborted(what);
    }
    // Whom this rank was waiting for is news to the others: with it, a
    // timeout elsewhere can name the rank that is really missing.
    if (waiting_for >= 0) what += "; " + s.names.who(s.rank) + " was waiting for " + s.names.who(waiting_for);
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
    const std::string mine = "gradsync: ranks disagree on a collective: " + s.names.who(s.rank) + " called " +
                             describe(s.call);
    s.calls.assign(static_cast<std::size_t>(s.size), WireCall{});
    bool done = MPI_Iallgather(&s.wire, sizeof(WireCall), MPI_BYTE, s.calls.data(), sizeof(WireCall), MPI_BYTE, s.comm,
                               &s.gather) == MPI_SUCCESS;
    const IdleBackoff backoff;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (int flag = 0; done && !flag;) {
      if (MPI_Test(&s.gather, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) done = false;
      if (!flag && std::chrono::steady_clock::now() > deadline) {
        s.abandoned = true;
        done = false;
      }
      if (!flag) backoff.idle();
    }
    if (done) {
      if (auto what = disagreement(s.rank, s.wire, s.calls, s.names, s.call.label.names)) throw InvalidArgument(*what);
    }
    throw InvalidArgument(mine + ", and another rank called something else (which, the ranks could not tell in time)");
  }

  std::unique_ptr<State> s_;
};

}  // namespace gradsync::detail::mpi
