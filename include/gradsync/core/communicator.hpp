#pragma once
/// \file Communicator<Backend>: what every primitive takes.

#include <atomic>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "gradsync/core/backend.hpp"
#include "gradsync/core/backend_traits.hpp"
#include "gradsync/core/call_info.hpp"
#include "gradsync/core/call_view.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/flight_recorder.hpp"
#include "gradsync/core/flight_signal.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/rank_names.hpp"
#include "gradsync/core/trace_recorder.hpp"
#include "gradsync/core/types.hpp"

namespace gradsync {

namespace detail {
struct RunCall;
struct EndpointAccess;
struct FailAccess;
struct RankNamesAccess;
struct TraceAccess;
struct TrainerOrdinalAccess;
template <Backend B>
class LabelScope;
}  // namespace detail

/// The color that puts a rank in no sub-communicator: its split() returns
/// std::nullopt (MPI's MPI_UNDEFINED, whose MPI_Comm_split gives MPI_COMM_NULL).
inline constexpr int no_color = -1;

/// One rank's handle on a group of ranks, over backend `B`.
///
/// It owns the backend's endpoint, the deadline every wait uses, and the
/// sequence number of the current call (for diagnostics). Its public face is
/// what a user needs; the primitives run each call through it, and the
/// algorithms see only that call (detail::CallView). It hands out no
/// implementation type: gradsync's own code that drives the endpoint
/// directly reaches it through detail::endpoint_of.
template <Backend B>
class Communicator {
  using endpoint_type = typename B::Endpoint;

 public:
  using backend_type = B;
  using duration = std::chrono::nanoseconds;

  static constexpr duration default_timeout = detail::default_timeout;

  /// Builds the backend's endpoint from `args`: an endpoint itself, or what
  /// the endpoint is made from (`Communicator<Mpi> comm(MPI_COMM_WORLD)`,
  /// optionally followed by the backend's options).
  template <class... Args>
    requires std::constructible_from<endpoint_type, Args&&...>
  explicit Communicator(Args&&... args) : ep_(std::forward<Args>(args)...) {
    detail::install_flight_signal_from_env();
    if (std::string dir = detail::trace_dir_from_env(); !dir.empty()) trace_to(std::move(dir));
  }
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  /// Movable while idle, so factories can return several (one per GPU).
  Communicator(Communicator&& o) noexcept(std::is_nothrow_move_constructible_v<endpoint_type>)
      : ep_(std::move(o.ep_)),
        timeout_(o.timeout_),
        seq_(o.seq_),
        call_(o.call_),
        label_(o.label_),
        scratch_(std::move(o.scratch_)),
        failure_(std::move(o.failure_)),
        flight_(std::move(o.flight_)),
        trace_(std::move(o.trace_)),
        trainers_(o.trainers_) {}

  int rank() const noexcept { return ep_.rank(); }
  int size() const noexcept { return ep_.size(); }

  /// Rank among the ranks on this host, where the backend knows hosts
  /// (backend_traits<B>::knows_hosts: Mpi).
  int local_rank() const noexcept
    requires(backend_traits<B>::knows_hosts)
  {
    return ep_.local_rank();
  }

  /// The deadline of every wait inside a collective on this communicator.
  duration timeout() const noexcept { return timeout_; }
  template <class Rep, class Period>
  void set_timeout(std::chrono::duration<Rep, Period> t) {
    if (t <= t.zero()) throw InvalidArgument("gradsync: set_timeout expects a positive duration");
    timeout_ = std::chrono::duration_cast<duration>(t);
  }

  /// Blocks until every rank has called barrier().
  void barrier() {
    run(detail::CallInfo{}, [&](const detail::CallView<B>& c) { ep_.barrier(c.call(), timeout_); });
  }

  /// Number of collectives started on this communicator.
  std::uint64_t sequence() const noexcept { return seq_; }

  /// A communicator of the ranks that pass the same `color`, ordered by
  /// `key`, ties in this communicator's rank order (as MPI_Comm_split does).
  /// Collective: every rank of this communicator calls it, as one numbered
  /// call ("Split #n"), so a rank that calls something else or never comes
  /// is named like in any collective, within the deadline. A rank passing
  /// `no_color` joins none and gets std::nullopt; any other negative color
  /// throws InvalidArgument before anything is sent.
  ///
  /// The new communicator starts at call #1, with this one's timeout and
  /// backend options, and is a group of its own: a failure in it fails its
  /// later calls, not this communicator's (nor the reverse). It may outlive
  /// this communicator. Backends declare it in their Capabilities (split):
  /// Threads, Mpi and Nccl.
  ///
  /// Its errors name each rank by its rank in the root communicator (the
  /// one not made by split), then within the group: "world rank 5 (rank 1
  /// of shard group 2)". `name` is the group's name there; empty, it is
  /// "group of color 2" (and "… in <this group>" when this one was split).
  std::optional<Communicator> split(int color, int key = 0, std::string_view name = {}) {
    if constexpr (!backend_traits<B>::split) {
      static_assert(backend_traits<B>::split,
                    "gradsync: this backend cannot split a communicator (its Capabilities leave split = false); "
                    "Threads, Mpi and Nccl can");
      return std::nullopt;
    } else {
      static_assert(requires(endpoint_type& e, const endpoint_type& ce, const detail::CallInfo& call, int c,
                             duration t, std::string_view n) {
        { e.split(c, c, call, t, n) } -> std::same_as<std::optional<endpoint_type>>;
        { ce.names() } -> std::same_as<const detail::RankNames&>;
      }, "gradsync: a backend that declares split = true needs Endpoint::split(color, key, call, timeout, name) "
         "returning std::optional<Endpoint>, and Endpoint::names() naming its ranks (detail::RankNames)");
      if (color < 0 && color != no_color) {
        throw InvalidArgument("gradsync: " + who() + ": split expects a color >= 0 or gradsync::no_color, got " +
                              std::to_string(color));
      }
      std::optional<Communicator> child;
      detail::CallInfo call{};
      call.collective = Collective::split;
      run(call, [&](const detail::CallView<B>& c) {
        std::optional<endpoint_type> ep = ep_.split(color, key, c.call(), timeout_, name);
        if (!ep) return;
        child.emplace(std::move(*ep));
        child->timeout_ = timeout_;
        // The same rank's timeline: one file per rank, its groups' calls in it.
        child->trace_ = trace_;
      });
      return child;
    }
  }

  /// Whether a collective on this communicator has failed; it then refuses
  /// every later call at once (see run()).
  bool failed() const noexcept { return !failure_.empty(); }

  /// Writes this rank's flight record now: its last calls (256 unless
  /// GRADSYNC_FLIGHT_ENTRIES says otherwise), what each was and how far it
  /// got, as gradsync writes it by itself when a call fails. Into `dir`,
  /// else $GRADSYNC_FLIGHT_DIR, else the working directory; returns the
  /// file's path. Not collective. docs/DEBUGGING.md describes the file and
  /// tools/flight-analyze reads the files of all ranks.
  std::string write_flight_record(std::string dir = {}) const {
    if (dir.empty()) dir = detail::flight_dir();
    if (dir.empty()) dir = ".";
    return flight_.write(dir, flight_context("requested", "", label_.names));
  }

  /// Records this rank's timeline from now on (GRADSYNC_TRACE=`dir` does
  /// it at construction): every collective on this communicator and on
  /// those split from it later, and the phases of the trainers on them,
  /// the first `max_events` (0: GRADSYNC_TRACE_EVENTS, else 65536) kept.
  /// Written into `dir` as gradsync-trace-rank<world rank>.json when the
  /// last of these communicators goes, when a trainer on it is destroyed,
  /// or by write_trace(). Call it between collectives; a timeline already
  /// recorded is written first. docs/DEBUGGING.md describes the file.
  void trace_to(std::string dir, std::size_t max_events = 0) {
    if (dir.empty()) throw InvalidArgument("gradsync: " + who() + ": trace_to expects a directory");
    if (trace_) trace_->flush();
    const int world = rank_names().world_rank(rank());
    trace_ = std::make_shared<detail::TraceRecorder>(std::move(dir), world >= 0 ? world : rank(),
                                                     detail::short_type_name<B>(),
                                                     max_events ? max_events : detail::trace_capacity());
    trace_->describe_writer(rank(), size());
  }
  /// Whether this communicator records a timeline.
  bool tracing() const noexcept { return trace_ != nullptr; }
  /// Writes this rank's timeline now into `dir`, else the directory it
  /// records for; returns the file's path. Not collective. Throws
  /// InvalidArgument when no timeline is recorded.
  std::string write_trace(std::string dir = {}) const {
    if (!trace_) {
      throw InvalidArgument("gradsync: " + who() +
                            ": write_trace, but no timeline is recorded: set GRADSYNC_TRACE=DIR or call trace_to(DIR)");
    }
    return trace_->write(dir.empty() ? trace_->dir() : dir, rank(), size());
  }

 private:
  friend struct detail::RunCall;
  friend struct detail::EndpointAccess;
  friend struct detail::FailAccess;
  friend struct detail::RankNamesAccess;
  friend struct detail::TraceAccess;
  friend struct detail::TrainerOrdinalAccess;
  friend class detail::LabelScope<B>;

  /// Runs one collective: stamps it with the next sequence number, and if it
  /// throws, abandons what is in flight and tells the other ranks, so they
  /// fail fast instead of waiting out the deadline. A communicator whose call
  /// failed refuses the next ones at once (Aborted, naming that failure): its
  /// peers may be anywhere in the sequence, so nothing later can match.
  /// `body` gets the algorithms' view of the call.
  template <class F>
  void run(detail::CallInfo call, F&& body) {
    if (!failure_.empty()) {
      throw Aborted("gradsync: " + who() + ": " + describe_next(call) +
                    " refused: this communicator failed earlier and cannot be used again (" + failure_ + ")");
    }
    // Two threads in one communicator would interleave sequence numbers and
    // messages; one atomic exchange per call says so instead of a confusing
    // mismatch or a hang later.
    if (busy_.exchange(true, std::memory_order_acquire)) {
      // The other thread owns the sequence number; this call gets none.
      throw InvalidArgument("gradsync: " + who() + ": Communicator used from two threads at once (" +
                            describe(call) +
                            " started while another call was in progress); a communicator serves one thread at a "
                            "time: give each thread its own communicator");
    }
    struct Release {
      std::atomic<bool>& busy;
      ~Release() { busy.store(false, std::memory_order_release); }
    } release{busy_};
    call.seq = ++seq_;
    // A collective that names no label of its own moves what the caller's
    // LabelScope says; barrier and split move nothing.
    if (call.label.empty() && call.collective != Collective::barrier && call.collective != Collective::split) {
      call.label = label_;
    }
    call_ = call;
    detail::FlightEntry& flight = flight_.issue(call_);
    // A dump signal that arrives while this call waits writes this ring.
    const detail::FlightSignalScope on_signal(&Communicator::write_signal_record, this);
    // Off, the timeline costs this test of a pointer at each mark.
    detail::TraceRecorder* const trace = trace_.get();
    std::int64_t issued = 0, started = 0, moved = 0, waited = -1;
    if (trace) issued = detail::TraceRecorder::now_ns();
    // A backend that can tell its waits for peers apart from moving data
    // times them while a timeline is recorded (a hook, as begin_call).
    if constexpr (requires { ep_.peer_waits(); }) ep_.peer_waits().enable(trace != nullptr);
    try {
      // begin_call/end_call are protocol hooks, not capabilities: a backend
      // brackets a call with them to check that ranks agree on it, and code
      // above the backends never asks whether they exist.
      if constexpr (requires { ep_.begin_call(call_, timeout_); }) ep_.begin_call(call_, timeout_);
      detail::FlightRecorder::start(flight);
      if (trace) started = detail::TraceRecorder::now_ns();
      if constexpr (requires { ep_.peer_waits(); }) {
        if (trace) ep_.peer_waits().take();  // the agreement's waits are agree_us
      }
      detail::CallView<B> view(ep_, call_, timeout_, scratch_);
      std::forward<F>(body)(view);
      if (trace) moved = detail::TraceRecorder::now_ns();
      if constexpr (requires { ep_.peer_waits(); }) {
        if (trace) waited = ep_.peer_waits().take();
      }
      if constexpr (requires { ep_.end_call(call_, timeout_); }) ep_.end_call(call_, timeout_);
      detail::FlightRecorder::end(flight, detail::FlightState::completed);
      if (trace) trace->collective(call_, issued, started, moved, detail::TraceRecorder::now_ns(), false, waited);
    } catch (const std::exception& e) {
      detail::FlightRecorder::end(flight, detail::FlightState::failed);
      trace_failed(trace, issued, started, moved);
      const detail::FailureKind kind = detail::current_failure_kind();
      // The record first: under a backend policy that ends the job on a
      // failure (Mpi's abort_job), record_failure does not return.
      write_failure_record(kind, e.what());
      record_failure(kind, e.what());
      throw;
    } catch (...) {
      detail::FlightRecorder::end(flight, detail::FlightState::failed);
      trace_failed(trace, issued, started, moved);
      write_failure_record(detail::FailureKind::error, "unknown exception");
      record_failure(detail::FailureKind::error, "unknown exception");
      throw;
    }
  }

  /// A call that threw ends its timeline slice where it threw.
  void trace_failed(detail::TraceRecorder* trace, std::int64_t issued, std::int64_t started,
                    std::int64_t moved) const noexcept {
    if (!trace) return;
    const std::int64_t now = detail::TraceRecorder::now_ns();
    if (!started) started = now;
    trace->collective(call_, issued, started, moved ? moved : now, now, true);
  }

  detail::FlightRecorder::Context flight_context(std::string_view reason, std::string_view message,
                                                 const LabelNames* live) const noexcept {
    return {.rank = rank(), .size = size(), .names = &rank_names(), .reason = reason, .message = message,
            .live_names = live};
  }

  /// The flight record a dump signal asks for (flight_signal.hpp), written
  /// by the thread inside the call.
  static void write_signal_record(const void* self) noexcept {
    static_cast<const Communicator*>(self)->write_record("signal", "a dump signal arrived while this call waited");
  }

  /// The flight record of the call that just failed.
  void write_failure_record(detail::FailureKind kind, const char* what) const noexcept {
    write_record(detail::name(kind), what);
  }

  /// This rank's flight record, where flight_dir() says, with `reason`. A
  /// record that cannot be written is reported on stderr: a failure being
  /// thrown is the news and must not be replaced, and a signal's record
  /// must not end the call it describes.
  void write_record(std::string_view reason, const char* what) const noexcept {
    try {
      const std::string dir = detail::flight_dir();
      if (!dir.empty() && flight_.capacity() != 0)
        flight_.write(dir, flight_context(reason, what, call_.label.names));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
    } catch (...) {
    }
  }

  /// Fails this idle communicator for a failure elsewhere (`what`, of
  /// `kind`): its peers, waiting here or calling next, fail with the same
  /// words and kind instead of seeing this rank leave. The call it names is
  /// the next one, which no rank has made alike.
  void fail_because(detail::FailureKind kind, const std::string& what) noexcept {
    if (!failure_.empty()) return;
    try {
      failure_ = what;
    } catch (...) {
      failure_ = "a call failed";
    }
    detail::CallInfo next{};
    next.seq = seq_ + 1;
    ep_.fail(next, what, kind);
  }
  /// How errors name this communicator's ranks: a backend without split
  /// has only the world's names.
  const detail::RankNames& rank_names() const noexcept {
    if constexpr (requires { ep_.names(); }) {
      return ep_.names();
    } else {
      return detail::RankNames::world();
    }
  }
  /// This rank as errors name it ("rank 3", "world rank 5 (rank 1 of shard group 2)").
  std::string who() const { return rank_names().who(rank()); }

  std::string describe_next(detail::CallInfo call) const {
    call.seq = seq_ + 1;
    return describe(call);
  }

  void record_failure(detail::FailureKind kind, const char* what) noexcept {
    try {
      failure_ = describe(call_) + " failed: " + what;
    } catch (...) {
      failure_ = "a call failed";
    }
    ep_.fail(call_, what, kind);
  }

  endpoint_type ep_;
  duration timeout_ = default_timeout;
  std::uint64_t seq_ = 0;
  detail::CallInfo call_{};
  CallLabel label_{};  ///< set by detail::LabelScope around a caller's collectives
  detail::ScratchPool scratch_;
  std::string failure_;  ///< empty until a call fails
  detail::FlightRecorder flight_{detail::flight_capacity()};
  /// This rank's timeline, shared with the communicators split from it; null: off.
  std::shared_ptr<detail::TraceRecorder> trace_;
  std::atomic<bool> busy_{false};
  /// Trainers constructed on this communicator so far (TrainerOrdinalAccess).
  std::uint32_t trainers_ = 0;
};

namespace detail {
/// The one friend of Communicator that reads how its errors name ranks.
struct RankNamesAccess {
  template <Backend B>
  static const RankNames& get(const Communicator<B>& comm) noexcept {
    return comm.rank_names();
  }
};

/// The one friend of Communicator that numbers the trainers (and standalone
/// GradSyncs) made on it, in the order every rank makes them (their
/// construction is collective): a trainer's labels carry its number, so
/// ranks that step two trainers in a different order fail at once instead
/// of mixing one's data into the other's.
struct TrainerOrdinalAccess {
  template <Backend B>
  static std::uint32_t next(Communicator<B>& comm) noexcept {
    return comm.trainers_++;
  }
};

/// A trainer number already taken (TrainerOrdinalAccess::next), handed to
/// what the trainer owns so that its labels carry the trainer's number.
struct LabelOrdinal {
  std::uint32_t value = 0;
};

/// The one friend of Communicator that reaches its timeline.
struct TraceAccess {
  template <Backend B>
  static TraceRecorder* get(const Communicator<B>& comm) noexcept {
    return comm.trace_.get();
  }
};

/// `comm`'s timeline, null when it records none: what the trainers'
/// TraceScope marks their phases on.
template <Backend B>
TraceRecorder* trace_recorder(const Communicator<B>& comm) noexcept {
  return TraceAccess::get(comm);
}

/// How errors name `comm`'s ranks, for the layers above the communicator.
template <Backend B>
const RankNames& rank_names(const Communicator<B>& comm) noexcept {
  return RankNamesAccess::get(comm);
}

/// `comm`'s own rank as errors name it: "rank 3" on the world, "world rank 5
/// (rank 1 of shard group 2)" on a communicator made by split.
template <Backend B>
std::string who(const Communicator<B>& comm) {
  return rank_names(comm).who(comm.rank());
}

/// Whether C is a Communicator, and over which backend: what the trainers
/// and integrations templated on a communicator type check first.
template <class C>
struct CommunicatorTraits : std::false_type {};
template <class B>
struct CommunicatorTraits<Communicator<B>> : std::true_type {
  using backend = B;
};
}  // namespace detail

}  // namespace gradsync
