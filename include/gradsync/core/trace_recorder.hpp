#pragma once
/// \file TraceRecorder: one rank's timeline (collectives and trainer phases), written as a Chrome trace for Perfetto.
///
/// The flight recorder keeps the last calls to say who hung; the timeline
/// keeps the first N calls and phases with their times, to say where a
/// step's time went: which collectives ran on which thread, and how much of
/// them the rank's compute hid. Off unless GRADSYNC_TRACE names a directory
/// or Communicator::trace_to is called; off, a call pays one test of a null
/// pointer. On, each event is a slot of a buffer allocated once: one atomic
/// increment claims it, two to four clock reads time it, nothing locks or
/// allocates. The file is the Chrome trace-event JSON object form, one
/// process per rank (pid = world rank), which ui.perfetto.dev and
/// chrome://tracing open; docs/DEBUGGING.md describes it and
/// tools/trace-summary reads the files of all ranks.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gradsync/core/call_info.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/json_string.hpp"
#include "gradsync/core/local_reduce.hpp"

namespace gradsync::detail {

/// What a timeline event is: a collective call, or a phase of a trainer.
enum class TraceKind : std::uint8_t {
  collective,
  step,
  forward,
  backward,
  gather,
  reduce_scatter,
  all_reduce,
  bucket,
  optimizer,
  clip,
  checkpoint_save,
  checkpoint_load,
  /// AsyncCheckpointer: the caller waiting for the writer and the commit,
  /// and the writer thread's own work on its track.
  checkpoint_wait,
  checkpoint_write,
};

/// A phase's name, what its index counts ("forward", "unit"), and the
/// category tools/trace-summary sums: compute, communication, step or checkpoint.
struct TraceKindWords {
  std::string_view name, index_word, category;
};
constexpr TraceKindWords words(TraceKind k) noexcept {
  constexpr std::string_view names[] = {"collective",     "step",           "forward",        "backward",
                                        "gather",         "reduce-scatter", "all-reduce",     "all-reduce",
                                        "optimizer step", "clip_grad_norm", "checkpoint save", "checkpoint load",
                                        "checkpoint wait", "checkpoint write"};
  const auto i = static_cast<std::size_t>(k);
  if (i >= std::size(names)) return {"?", "", "?"};
  if (k == TraceKind::collective) return {names[i], "", "communication"};
  if (k == TraceKind::step) return {names[i], "", "step"};
  if (k == TraceKind::forward || k == TraceKind::backward) return {names[i], "unit", "compute"};
  if (k == TraceKind::bucket) return {names[i], "bucket", "communication"};
  if (k >= TraceKind::gather && k <= TraceKind::all_reduce) return {names[i], "wrapped unit", "communication"};
  if (k == TraceKind::optimizer || k == TraceKind::clip) return {names[i], "", "compute"};
  return {names[i], "", "checkpoint"};
}

/// The name of the calling thread's track; a ProgressWorker names its own.
inline const char*& trace_thread_name() noexcept {
  thread_local const char* name = "caller";
  return name;
}

/// A small number for the calling thread, unique in the process: the
/// track (Chrome's tid) its events go on.
inline std::uint32_t trace_thread_id() noexcept {
  static std::atomic<std::uint32_t> next{1};
  thread_local const std::uint32_t id = next.fetch_add(1, std::memory_order_relaxed);
  return id;
}

/// `T`'s name without its namespaces ("Threads"), from the compiler's
/// name of this function: what a timeline calls the backend.
template <class T>
constexpr std::string_view short_type_name() noexcept {
  const std::string_view f = __PRETTY_FUNCTION__;
  const std::size_t at = f.find("T = ");
  if (at == std::string_view::npos) return "?";
  std::string_view name = f.substr(at + 4);
  name = name.substr(0, name.find_first_of(";]"));
  const std::size_t colon = name.rfind("::");
  return colon == std::string_view::npos ? name : name.substr(colon + 2);
}

/// The directory GRADSYNC_TRACE names; empty (off) when unset, empty or "off".
inline std::string trace_dir_from_env() {
  const char* env = std::getenv("GRADSYNC_TRACE");
  if (env == nullptr || *env == '\0' || std::string_view(env) == "off") return {};
  return env;
}

/// Events a rank keeps: $GRADSYNC_TRACE_EVENTS, else 65536 (about 9 MiB);
/// later ones are counted as dropped.
inline std::size_t trace_capacity() noexcept {
  const char* env = std::getenv("GRADSYNC_TRACE_EVENTS");
  const unsigned long long n = env ? std::strtoull(env, nullptr, 10) : 0;
  return n ? static_cast<std::size_t>(std::min<unsigned long long>(n, 1u << 24)) : std::size_t{1} << 16;
}

/// One slot of the timeline.
struct TraceEvent {
  /// A collective: entered Communicator::run, ranks agreed and data moves,
  /// the algorithm returned, the call returned (steady clock, ns). A
  /// phase: begin and end only.
  std::int64_t issued_ns = 0, started_ns = 0, moved_ns = 0, ended_ns = 0;
  /// A collective: of [started, moved], the time its waits for peers'
  /// messages found nothing to do (-1: the backend does not tell).
  std::int64_t waited_ns = -1;
  CallInfo call{};  ///< a collective's; a phase's index is call.count
  const char* thread = nullptr;
  std::uint32_t tid = 0;
  /// 1 + the index of the label's words kept when its names went (forget_names); 0: none kept.
  std::uint32_t label_text = 0;
  TraceKind kind = TraceKind::collective;
  bool failed = false;
  /// Written whole: a writer reads no slot still being filled.
  std::atomic<bool> ready{false};
};

/// One rank's timeline; shared by a communicator and those split from it.
class TraceRecorder {
 public:
  /// Records up to `capacity` events for world rank `pid` of backend
  /// `backend`, written into `dir` (the last owner writes it, see ~TraceRecorder).
  TraceRecorder(std::string dir, int pid, std::string_view backend, std::size_t capacity)
      : dir_(std::move(dir)), pid_(pid), backend_(backend), capacity_(std::max<std::size_t>(capacity, 1)),
        events_(std::make_unique<TraceEvent[]>(capacity_)) {}
  TraceRecorder(const TraceRecorder&) = delete;
  TraceRecorder& operator=(const TraceRecorder&) = delete;
  /// Writes what was recorded since the last write; a file that cannot be
  /// written is reported on stderr (a destructor has no one to tell).
  ~TraceRecorder() { flush(); }

  static std::int64_t now_ns() noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  /// A collective `call` (its times as TraceEvent says).
  void collective(const CallInfo& call, std::int64_t issued, std::int64_t started, std::int64_t moved,
                  std::int64_t ended, bool failed, std::int64_t waited = -1) noexcept {
    TraceEvent* e = claim();
    if (e == nullptr) return;
    e->call = call;
    e->kind = TraceKind::collective;
    e->failed = failed;
    e->issued_ns = issued;
    e->started_ns = started;
    e->moved_ns = moved;
    e->ended_ns = ended;
    e->waited_ns = waited;
    e->ready.store(true, std::memory_order_release);
  }
  /// A phase `kind` of index `index` from `begin` to `end`.
  void phase(TraceKind kind, std::uint64_t index, std::int64_t begin, std::int64_t end) noexcept {
    TraceEvent* e = claim();
    if (e == nullptr) return;
    e->call = CallInfo{};
    e->call.count = static_cast<std::size_t>(index);
    e->kind = kind;
    e->failed = false;
    e->issued_ns = e->started_ns = e->moved_ns = begin;
    e->ended_ns = end;
    e->ready.store(true, std::memory_order_release);
  }

  /// `names` is alive and describes labels: the file says "step 3,
  /// all-gather of wrapped unit 1 ('fc2')" rather than the label's number.
  void keep_names(const LabelNames* names) {
    if (names && std::find(live_.begin(), live_.end(), names) == live_.end()) live_.push_back(names);
  }
  /// `names` goes: the labels it describes are put into words now. Called
  /// where nothing is in flight (a trainer's destructor).
  void forget_names(const LabelNames* names) noexcept {
    const auto it = std::find(live_.begin(), live_.end(), names);
    if (it == live_.end()) return;
    live_.erase(it);
    try {
      for (std::size_t i = 0; i < held(); ++i) {
        TraceEvent& e = events_[i];
        if (!e.ready.load(std::memory_order_acquire) || e.call.label.names != names || e.label_text) continue;
        texts_.push_back(e.call.label.describe(names));
        e.label_text = static_cast<std::uint32_t>(texts_.size());
      }
    } catch (...) {
    }
  }

  const std::string& dir() const noexcept { return dir_; }
  std::size_t capacity() const noexcept { return capacity_; }
  /// Events claimed since construction, kept or not.
  std::uint64_t recorded() const noexcept { return claimed_.load(std::memory_order_relaxed); }
  std::uint64_t dropped() const noexcept { return recorded() - held(); }

  /// The timeline as one Chrome trace-event JSON object (docs/DEBUGGING.md).
  /// `rank` and `size`: of the communicator that writes it.
  std::string to_json(int rank, int size) const {
    std::vector<const TraceEvent*> kept;
    kept.reserve(held());
    for (std::size_t i = 0; i < held(); ++i) {
      if (events_[i].ready.load(std::memory_order_acquire)) kept.push_back(&events_[i]);
    }
    // Per track by start, an enclosing span before what it encloses: the
    // order Chrome's readers nest slices in.
    std::sort(kept.begin(), kept.end(), [](const TraceEvent* a, const TraceEvent* b) {
      if (a->tid != b->tid) return a->tid < b->tid;
      if (a->issued_ns != b->issued_ns) return a->issued_ns < b->issued_ns;
      return a->ended_ns > b->ended_ns;
    });
    const std::string pid = std::to_string(pid_);
    std::string s = "{\"traceEvents\": [\n";
    s += R"({"ph": "M", "pid": )" + pid + R"(, "tid": 0, "name": "process_name", "args": {"name": "rank )" + pid +
         "\"}},\n";
    s += R"({"ph": "M", "pid": )" + pid + R"(, "tid": 0, "name": "process_sort_index", "args": {"sort_index": )" +
         pid + "}},\n";
    s += R"({"ph": "M", "pid": )" + pid + R"(, "tid": 0, "name": "gradsync_trace", "args": {"capacity": )" +
         std::to_string(capacity_) + ", \"recorded\": " + std::to_string(recorded()) +
         ", \"dropped\": " + std::to_string(dropped()) + "}}";
    std::uint32_t named = 0;
    for (const TraceEvent* e : kept) {
      if (e->tid != named) {
        named = e->tid;
        const std::string tid = std::to_string(e->tid);
        s += ",\n{\"ph\": \"M\", \"pid\": " + pid + ", \"tid\": " + tid + R"(, "name": "thread_name", "args": {"name": )";
        append_json_string(s, e->thread ? e->thread : "?");
        s += "}}";
        s += ",\n{\"ph\": \"M\", \"pid\": " + pid + ", \"tid\": " + tid +
             R"(, "name": "thread_sort_index", "args": {"sort_index": )" + tid + "}}";
      }
      append_event(s, *e);
    }
    char host[256] = {};
    if (gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
    s += "\n],\n\"displayTimeUnit\": \"ms\",\n\"otherData\": {\"format\": \"gradsync trace\", \"version\": 1, "
         "\"world_rank\": " + pid + ", \"rank\": " + std::to_string(rank) + ", \"size\": " + std::to_string(size) +
         ", \"backend\": ";
    append_json_string(s, backend_);
    s += ", \"host\": ";
    append_json_string(s, host);
    s += ", \"capacity\": " + std::to_string(capacity_) + ", \"recorded\": " + std::to_string(recorded()) +
         ", \"dropped\": " + std::to_string(dropped()) + "}}\n";
    return s;
  }

  /// Writes the timeline to `dir`/gradsync-trace-rank<pid>.json, replacing
  /// an earlier one whole (written beside it, then renamed), and returns
  /// the path. Throws Error naming the path if it cannot be written.
  std::string write(const std::string& dir, int rank, int size) {
    const std::string path = dir + "/gradsync-trace-rank" + std::to_string(pid_) + ".json";
    const std::string tmp = path + ".tmp" + std::to_string(static_cast<long long>(getpid()));
    const std::uint64_t upto = recorded();
    const std::string text = to_json(rank, size);
    // The directory is made if missing (one level), as GRADSYNC_TRACE may name a new one.
    if (::mkdir(dir.c_str(), 0777) != 0 && errno != EEXIST) throw Error("gradsync: could not make " + dir + " for the trace");
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    bool ok = fd >= 0;
    for (std::size_t at = 0; ok && at < text.size();) {
      const ssize_t n = ::write(fd, text.data() + at, text.size() - at);
      ok = n > 0 || (n < 0 && errno == EINTR);
      if (n > 0) at += static_cast<std::size_t>(n);
    }
    if (fd >= 0 && ::close(fd) != 0) ok = false;
    if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
      ::unlink(tmp.c_str());
      throw Error("gradsync: could not write the trace " + path);
    }
    written_ = upto;
    return path;
  }
  /// Sets what write() says of the communicator (its rank and size).
  void describe_writer(int rank, int size) noexcept {
    rank_ = rank;
    size_ = size;
  }
  /// Writes into dir() if anything was recorded since the last write.
  void flush() noexcept {
    if (dir_.empty() || recorded() == written_) return;
    try {
      write(dir_, rank_, size_);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
    } catch (...) {
    }
  }

 private:
  std::size_t held() const noexcept {
    return static_cast<std::size_t>(std::min<std::uint64_t>(claimed_.load(std::memory_order_acquire), capacity_));
  }
  TraceEvent* claim() noexcept {
    const std::uint64_t i = claimed_.fetch_add(1, std::memory_order_relaxed);
    if (i >= capacity_) return nullptr;
    TraceEvent* e = &events_[i];
    e->thread = trace_thread_name();
    e->tid = trace_thread_id();
    return e;
  }

  static void append_us(std::string& s, std::int64_t ns) {
    const bool negative = ns < 0;
    const std::uint64_t v = negative ? static_cast<std::uint64_t>(-ns) : static_cast<std::uint64_t>(ns);
    char buf[32];
    std::snprintf(buf, sizeof buf, "%s%llu.%03llu", negative ? "-" : "", static_cast<unsigned long long>(v / 1000),
                  static_cast<unsigned long long>(v % 1000));
    s += buf;
  }
  /// One complete ("X") event; a collective's waits for its peers to
  /// agree (before and after the data moved) are slices within it.
  void append_slice(std::string& s, const TraceEvent& e, std::string_view name, std::string_view category,
                    std::int64_t begin, std::int64_t end) const {
    s += ",\n{\"ph\": \"X\", \"pid\": " + std::to_string(pid_) + ", \"tid\": " + std::to_string(e.tid) + ", \"ts\": ";
    append_us(s, begin);
    s += ", \"dur\": ";
    append_us(s, std::max<std::int64_t>(end - begin, 0));
    s += ", \"cat\": ";
    append_json_string(s, category);
    s += ", \"name\": ";
    append_json_string(s, name);
  }
  void append_event(std::string& s, const TraceEvent& e) const {
    const TraceKindWords w = words(e.kind);
    if (e.kind != TraceKind::collective) {
      std::string name(w.name);
      if (!w.index_word.empty()) name += " " + std::string(w.index_word) + " " + std::to_string(e.call.count);
      if (e.kind == TraceKind::step) name += " " + std::to_string(e.call.count);
      append_slice(s, e, name, w.category, e.issued_ns, e.ended_ns);
      s += ", \"args\": {\"index\": " + std::to_string(e.call.count) + "}}";
      return;
    }
    const CallInfo& k = e.call;
    append_slice(s, e, name(k.collective), w.category, e.issued_ns, e.ended_ns);
    s += ", \"args\": {\"seq\": " + std::to_string(k.seq) + ", \"bytes\": " + std::to_string(k.count * size_of(k.type)) +
         ", \"count\": " + std::to_string(k.count) + ", \"dtype\": ";
    append_json_string(s, name(k.type));
    s += ", \"op\": ";
    append_json_string(s, name(k.op));
    s += ", \"algorithm\": ";
    append_json_string(s, k.algorithm);
    s += ", \"backend\": ";
    append_json_string(s, backend_);
    s += ", \"label\": ";
    const bool live = std::find(live_.begin(), live_.end(), k.label.names) != live_.end();
    append_json_string(s, e.label_text ? texts_[e.label_text - 1] : k.label.describe(live ? k.label.names : nullptr));
    s += ", \"agree_us\": ";
    append_us(s, (e.started_ns - e.issued_ns) + (e.ended_ns - e.moved_ns));
    if (e.waited_ns >= 0) {
      s += ", \"peer_wait_us\": ";
      append_us(s, e.waited_ns);
    }
    s += std::string(", \"state\": ") + (e.failed ? "\"failed\"" : "\"completed\"") + "}}";
    // The slices are there only where the wait is long enough to see (1 us).
    if (e.started_ns - e.issued_ns >= 1000) {
      append_slice(s, e, "agree (before)", "wait", e.issued_ns, e.started_ns);
      s += "}";
    }
    if (e.ended_ns - e.moved_ns >= 1000) {
      append_slice(s, e, "agree (after)", "wait", e.moved_ns, e.ended_ns);
      s += "}";
    }
  }

  std::string dir_;
  int pid_;
  std::string backend_;
  std::size_t capacity_;
  std::unique_ptr<TraceEvent[]> events_;
  std::atomic<std::uint64_t> claimed_{0};
  std::uint64_t written_ = 0;
  int rank_ = 0, size_ = 1;
  std::vector<const LabelNames*> live_;
  std::vector<std::string> texts_;
};

}  // namespace gradsync::detail
