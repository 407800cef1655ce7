// Randomized faults. Each trial runs a short random sequence of
// collectives on N ranks with one fault on one rank: it skips a call,
// disagrees on the call (count, root, op, type, algorithm, chunk size,
// collective), leaves early, throws, sleeps past the deadline, or runs a
// large Native AllReduce under a 1 ms deadline. Every rank must then end
// promptly with the error the promise names, and never return normally with
// wrong data. Built plainly the ranks are threads (run_threads); built with
// GRADSYNC_TEST_MPI they are the processes of an mpirun job.
//
// Each trial prints "trial i seed S: ..."; GRADSYNC_FAULT_SEED=S replays it
// (with the same mpirun -np). GRADSYNC_FAULT_TRIALS sets the count,
// GRADSYNC_FAULT_KINDS=skip,sleep,... draws only those faults,
// GRADSYNC_FAULT_REPEAT=n runs each seed n times (the faults race),
// GRADSYNC_FAULT_LENIENT=1 lets the fault's error end the call before it,
// GRADSYNC_FAULT_LONG=1 runs 10,000, GRADSYNC_FAULT_SLACK_FACTOR scales every
// deadline and limit (sanitizer builds pick a factor of their own). Over MPI
// every trial's communicator stays allocated until MPI ends (about 0.7 MB per
// process; see docs/DESIGN.md), so at np 4 on 24 GiB run the long mode in
// batches (GRADSYNC_FAULT_TRIALS=2000 with a different GRADSYNC_FAULT_SEED each).
// A crash must end the process with its signal: doctest's handler allocates,
// and after heap corruption it deadlocks in malloc (a hang instead of a crash),
// so each case puts the default actions back first (default_crash_actions).
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#include "gradsync/collectives.hpp"
#include "support/common.hpp"
#include "support/fault_watchdog.hpp"
#include "support/sanitizers.hpp"
#include "support/world.hpp"

namespace fault_suite {

namespace gs = gradsync;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

namespace {

using test::sanitized;

/// Doctest catches the fatal signals while a case runs, and its handler
/// reports through the heap; these default actions hold until the case ends.
void default_crash_actions() {
  for (const int sig : {SIGINT, SIGILL, SIGFPE, SIGSEGV, SIGTERM, SIGABRT}) std::signal(sig, SIG_DFL);
}

#ifdef GRADSYNC_TEST_MPI
constexpr const char* backend_name = "mpi";
// 150 at each of np 3 and 4: 300 in all.
constexpr int default_trials = 150;
#else
constexpr const char* backend_name = "threads";
constexpr int default_trials = sanitized ? 100 : 300;
#endif

enum class Coll { all_reduce, reduce_scatter, all_gather, broadcast };
enum class AlgoId { ring, tree, rhd, native, automatic };
enum class TypeId { f32, f64, i32 };
enum class OpId { sum, max };
enum class Fault {
  skip,
  count,
  root,
  op,
  type,
  algorithm,
  chunk,
  collective,
  early_return,
  user_throw,
  sleep,
  tiny_deadline,
};
constexpr int fault_kinds = 12;

const char* name(Coll c) {
  constexpr const char* n[] = {"AllReduce", "ReduceScatter", "AllGather", "Broadcast"};
  return n[static_cast<int>(c)];
}
const char* name(AlgoId a) {
  constexpr const char* n[] = {"Ring", "Tree", "RecursiveHalvingDoubling", "Native", "Auto"};
  return n[static_cast<int>(a)];
}
const char* name(TypeId t) {
  constexpr const char* n[] = {"float", "double", "int32"};
  return n[static_cast<int>(t)];
}
const char* name(OpId o) { return o == OpId::sum ? "sum" : "max"; }
const char* name(Fault f) {
  constexpr const char* n[] = {"skip", "count", "root",         "op",        "type",  "algorithm",
                               "chunk", "collective", "early_return", "throw", "sleep", "tiny_deadline"};
  return n[static_cast<int>(f)];
}
bool is_disagreement(Fault f) { return static_cast<int>(f) <= static_cast<int>(Fault::collective); }

/// One collective as a rank calls it. `count` is AllReduce's and Broadcast's
/// length, ReduceScatter's output block, AllGather's input block.
struct Call {
  Coll coll = Coll::all_reduce;
  AlgoId algo = AlgoId::ring;
  bool det = false;
  TypeId type = TypeId::f32;
  OpId op = OpId::sum;
  std::size_t count = 1;
  int root = 0;
  std::size_t chunk = 0;
  int salt = 0;
};

std::string describe(const Call& c) {
  std::string s = name(c.coll);
  s += "<";
  s += name(c.algo);
  s += "> " + std::to_string(c.count) + " x " + name(c.type);
  if (c.coll == Coll::all_reduce || c.coll == Coll::reduce_scatter) s += std::string(" ") + name(c.op);
  if (c.coll == Coll::broadcast) s += " root " + std::to_string(c.root);
  if (c.chunk) s += " chunk " + std::to_string(c.chunk);
  return s;
}

struct Trial {
  int index = 0;
  std::uint64_t seed = 0;
  int n = 2;
  AlgoId algo = AlgoId::ring;
  bool det = false;
  Fault fault = Fault::skip;
  int f = 0;  ///< the faulty rank
  int j = 0;  ///< the index of the faulty call
  std::vector<Call> calls;
  Call odd;  ///< rank f's call j, for the disagreements
};

std::string describe(const Trial& t) {
  std::string s = "trial " + std::to_string(t.index) + " seed " + std::to_string(t.seed) + ": N=" + std::to_string(t.n) +
                  " backend=" + backend_name + " algo=" + name(t.algo) + (t.det ? " deterministic" : "") +
                  " fault=" + name(t.fault) + " rank=" + std::to_string(t.f) + " call=" + std::to_string(t.j) + " [";
  for (std::size_t i = 0; i < t.calls.size(); ++i) {
    if (i) s += ", ";
    s += describe(t.calls[i]);
  }
  s += "]";
  if (is_disagreement(t.fault) && t.fault != Fault::skip) s += " rank " + std::to_string(t.f) + " calls " + describe(t.odd);
  if (const char* env = std::getenv("GRADSYNC_FAULT_KINDS")) s += std::string(" (GRADSYNC_FAULT_KINDS=") + env + ")";
  return s;
}

/// Every deadline and limit, scaled by one factor (sanitizers are slower).
struct Limits {
  double factor = 1.0;
  double deadline = 1.0;        ///< the communicator's timeout, s
  double sleep_deadline = 0.3;  ///< the timeout in a sleep trial, s
  double sleep = 0.6;           ///< how long the sleeping rank sleeps, s
  double slack = 1.5;           ///< beyond a deadline, s
  double fast = 0.35;           ///< "fast": well before the deadline, s
  /// A refused call, s: local work only (a flag, a message), so it is
  /// bounded by scheduling, not by any peer. Four ranks on two busy cores
  /// can be descheduled for tens of milliseconds (59 ms seen beside the
  /// sanitizer suites), so the limit is far above that, and still below
  /// every deadline a trial sets (sleep_deadline, deadline): a call that
  /// waited for one would exceed it.
  double refuse = 0.25;
  double budget = 15.0;         ///< the watchdog's, per trial, s

  static Limits make() {
    Limits l;
    if (const char* env = std::getenv("GRADSYNC_FAULT_SLACK_FACTOR")) {
      l.factor = std::strtod(env, nullptr);
    } else if (sanitized) {
      l.factor = 4.0;
    }
    if (!(l.factor > 0)) l.factor = 1.0;
    l.deadline *= l.factor;
    l.sleep_deadline *= l.factor;
    l.sleep *= l.factor;
    l.slack *= l.factor;
    l.fast *= l.factor;
    l.refuse *= l.factor;
    l.budget *= l.factor;
    return l;
  }
  double deadline_of(const Trial& t) const { return t.fault == Fault::sleep ? sleep_deadline : deadline; }
};

template <class T>
T pick(std::mt19937_64& rng, std::initializer_list<T> xs) {
  std::uniform_int_distribution<std::size_t> d(0, xs.size() - 1);
  return *(xs.begin() + static_cast<std::ptrdiff_t>(d(rng)));
}
int uniform(std::mt19937_64& rng, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

/// GRADSYNC_FAULT_KINDS=sleep,throw restricts the faults drawn (a replay
/// then needs the same list).
const std::vector<Fault>& only_kinds() {
  static const std::vector<Fault> kinds = [] {
    std::vector<Fault> k;
    const char* env = std::getenv("GRADSYNC_FAULT_KINDS");
    if (!env) return k;
    const std::string list = std::string(",") + env + ",";
    for (int i = 0; i < fault_kinds; ++i) {
      if (list.find(std::string(",") + name(static_cast<Fault>(i)) + ",") != std::string::npos) {
        k.push_back(static_cast<Fault>(i));
      }
    }
    return k;
  }();
  return kinds;
}

/// The trial seeded `seed`: the same on every rank.
Trial make_trial(int index, std::uint64_t seed, int mpi_world) {
  std::seed_seq seq{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32), 0x11u};
  std::mt19937_64 rng(seq);
  Trial t;
  t.index = index;
  t.seed = seed;
  t.n = uniform(rng, 2, 5);
  if (mpi_world) t.n = mpi_world;
  t.algo = static_cast<AlgoId>(uniform(rng, 0, 4));
  t.det = uniform(rng, 0, 2) == 0;
  t.fault = static_cast<Fault>(uniform(rng, 0, fault_kinds - 1));
  if (const auto& only = only_kinds(); !only.empty()) t.fault = only[static_cast<std::size_t>(t.fault) % only.size()];
  const int k = uniform(rng, 3, 6);
  t.f = uniform(rng, 0, t.n - 1);
  t.j = uniform(rng, 0, t.fault == Fault::skip ? k - 2 : k - 1);
  // Distinct counts, so that a skipped call shows as a disagreement.
  std::vector<std::size_t> counts{1, 2, 3, 5, 7, 13, 31, 64, 97, 255, 256, 1000, 1023, 4097, 10007, 65537, 100003};
  std::shuffle(counts.begin(), counts.end(), rng);
  for (int i = 0; i < k; ++i) {
    Call c;
    c.coll = static_cast<Coll>(uniform(rng, 0, 3));
    c.algo = t.algo;
    c.det = t.det;
    c.type = static_cast<TypeId>(uniform(rng, 0, 2));
    c.op = static_cast<OpId>(uniform(rng, 0, 1));
    c.count = counts[static_cast<std::size_t>(i)];
    c.root = uniform(rng, 0, t.n - 1);
    c.chunk = pick<std::size_t>(rng, {0, 0, 4096, 65536});
    c.salt = uniform(rng, 0, 1000);
    t.calls.push_back(c);
  }
  Call& cj = t.calls[static_cast<std::size_t>(t.j)];
  switch (t.fault) {
    case Fault::root: cj.coll = Coll::broadcast; break;
    case Fault::op: cj.coll = pick(rng, {Coll::all_reduce, Coll::reduce_scatter}); break;
    case Fault::tiny_deadline:
      cj.coll = Coll::all_reduce;
      cj.algo = AlgoId::native;
      cj.type = TypeId::f32;
      cj.op = OpId::sum;
      cj.count = pick<std::size_t>(rng, {4, 8, 24}) << 18;  // 4, 8 or 24 MiB of floats
      cj.chunk = 0;
      break;
    default: break;
  }
  Call odd = cj;
  switch (t.fault) {
    case Fault::count: odd.count = cj.count + static_cast<std::size_t>(uniform(rng, 1, 3)); break;
    case Fault::root: odd.root = (cj.root + uniform(rng, 1, t.n - 1)) % t.n; break;
    case Fault::op: odd.op = cj.op == OpId::sum ? OpId::max : OpId::sum; break;
    case Fault::type: odd.type = static_cast<TypeId>((static_cast<int>(cj.type) + uniform(rng, 1, 2)) % 3); break;
    case Fault::algorithm: odd.algo = static_cast<AlgoId>((static_cast<int>(cj.algo) + uniform(rng, 1, 4)) % 5); break;
    case Fault::chunk: {
      // 0 is the default (512 KiB): never pick that one as "different".
      std::vector<std::size_t> others;
      for (std::size_t b : {std::size_t{0}, std::size_t{4096}, std::size_t{65536}, std::size_t{1} << 20}) {
        if (b != cj.chunk) others.push_back(b);
      }
      odd.chunk = others[static_cast<std::size_t>(uniform(rng, 0, static_cast<int>(others.size()) - 1))];
      break;
    }
    case Fault::collective: odd.coll = static_cast<Coll>((static_cast<int>(cj.coll) + uniform(rng, 1, 3)) % 4); break;
    default: break;
  }
  t.odd = odd;
  return t;
}

/// Rank q's input element i: small integers, so sums are exact in any order.
template <class T>
T gen(int q, std::size_t i, int salt) {
  const std::uint64_t v = static_cast<std::uint64_t>(q) * 131 + i * 7 + static_cast<std::uint64_t>(salt) * 17;
  return static_cast<T>(static_cast<int>(v % 23) - 11);
}

template <class T>
T combine(OpId op, T a, T b) {
  return op == OpId::sum ? static_cast<T>(a + b) : std::max(a, b);
}

template <class T>
T reduced(OpId op, int n, std::size_t i, int salt) {
  T acc = gen<T>(0, i, salt);
  for (int q = 1; q < n; ++q) acc = combine(op, acc, gen<T>(q, i, salt));
  return acc;
}

/// "" when out[i] == want(i) for all i, else the first difference.
template <class T, class Want>
std::string compare(std::span<const T> out, Want&& want) {
  for (std::size_t i = 0; i < out.size(); ++i) {
    const T w = want(i);
    if (out[i] != w) {
      return "element " + std::to_string(i) + " of " + std::to_string(out.size()) + " is " +
             std::to_string(static_cast<double>(out[i])) + ", expected " + std::to_string(static_cast<double>(w));
    }
  }
  return "";
}

template <class A, class T, class B, class Op>
std::string exec_op(gs::Communicator<B>& comm, const Call& c, int n, int r, Op op) {
  const gs::Options o{.deterministic = c.det, .chunk_bytes = c.chunk};
  if (c.coll == Coll::all_reduce) {
    std::vector<T> x(c.count);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = gen<T>(r, i, c.salt);
    gs::AllReduce<A>{o}(comm, std::span<T>(x), op);
    return compare<T>(x, [&](std::size_t i) { return reduced<T>(c.op, n, i, c.salt); });
  }
  const std::size_t nn = static_cast<std::size_t>(n);
  std::vector<T> in(c.count * nn), out(c.count, T(-99));
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = gen<T>(r, i, c.salt);
  gs::ReduceScatter<A>{o}(comm, std::span<const T>(in), std::span<T>(out), op);
  const std::size_t base = static_cast<std::size_t>(r) * c.count;
  return compare<T>(out, [&](std::size_t i) { return reduced<T>(c.op, n, base + i, c.salt); });
}

/// Runs `c` on this rank and checks its result: "" when right.
template <class A, class T, class B>
std::string exec(gs::Communicator<B>& comm, const Call& c, int n, int r) {
  const gs::Options o{.deterministic = c.det, .chunk_bytes = c.chunk};
  const std::size_t nn = static_cast<std::size_t>(n);
  switch (c.coll) {
    case Coll::all_reduce:
    case Coll::reduce_scatter:
      return c.op == OpId::sum ? exec_op<A, T>(comm, c, n, r, gs::Sum{}) : exec_op<A, T>(comm, c, n, r, gs::Max{});
    case Coll::all_gather: {
      std::vector<T> in(c.count), out(c.count * nn, T(-99));
      for (std::size_t i = 0; i < in.size(); ++i) in[i] = gen<T>(r, i, c.salt);
      gs::AllGather<A>{o}(comm, std::span<const T>(in), std::span<T>(out));
      return compare<T>(out, [&](std::size_t i) { return gen<T>(static_cast<int>(i / c.count), i % c.count, c.salt); });
    }
    case Coll::broadcast: {
      std::vector<T> buf(c.count, T(-99));
      if (r == c.root) {
        for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = gen<T>(r, i, c.salt);
      }
      gs::Broadcast<A>{o}(comm, std::span<T>(buf), c.root);
      return compare<T>(buf, [&](std::size_t i) { return gen<T>(c.root, i, c.salt); });
    }
  }
  return "unknown collective";
}

template <class B>
std::string run_call(gs::Communicator<B>& comm, const Call& c, int n, int r) {
  auto typed = [&]<class A>() -> std::string {
    switch (c.type) {
      case TypeId::f32: return exec<A, float>(comm, c, n, r);
      case TypeId::f64: return exec<A, double>(comm, c, n, r);
      case TypeId::i32: return exec<A, std::int32_t>(comm, c, n, r);
    }
    return "unknown type";
  };
  switch (c.algo) {
    case AlgoId::ring: return typed.template operator()<gs::Ring>();
    case AlgoId::tree: return typed.template operator()<gs::Tree>();
    case AlgoId::rhd: return typed.template operator()<gs::RecursiveHalvingDoubling>();
    case AlgoId::native: return typed.template operator()<gs::Native>();
    case AlgoId::automatic: return typed.template operator()<gs::Auto>();
  }
  return "unknown algorithm";
}

/// The user's own exception, thrown by the faulty rank.
struct UserBoom : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// How one call ended.
enum class St : int { none, skipped, ok, wrong, invalid, timeout, aborted, error, user, other };
const char* name(St s) {
  constexpr const char* n[] = {"not called", "skipped",         "ok",        "WRONG DATA",       "InvalidArgument",
                               "Timeout",    "Aborted",         "gs::Error", "the user's error", "another exception"};
  return n[static_cast<int>(s)];
}
bool is_error(St s) { return static_cast<int>(s) >= static_cast<int>(St::invalid); }

/// The class of the exception being handled; call only inside a catch block.
St current_status(std::string& what) {
  try {
    throw;
  } catch (const UserBoom& e) {
    what = e.what();
    return St::user;
  } catch (const std::exception& e) {
    what = e.what();
    const std::string kind = test::error_kind(e);
    if (kind == "InvalidArgument") return St::invalid;
    if (kind == "Timeout") return St::timeout;
    if (kind == "Aborted") return St::aborted;
    return kind == "Error" ? St::error : St::other;
  } catch (...) {
    what = "unknown exception";
    return St::other;
  }
}

struct Outcome {
  St st = St::none;
  std::string label;  ///< "AllReduce #3": the call as this rank made it
  std::string what;
  double secs = 0;
};

std::string describe(const Outcome& o) {
  std::string s = o.label.empty() ? std::string("(no call)") : o.label;
  s += ": ";
  s += name(o.st);
  char t[32];
  std::snprintf(t, sizeof t, " after %.3f s", o.secs);
  s += t;
  if (!o.what.empty()) s += ": " + o.what;
  return s;
}

struct RankRun {
  std::vector<Outcome> calls;
  Outcome probe;  ///< a further call after a failure: must be refused at once
  bool left = false;
};

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

/// One rank's part of a trial. A failure is recorded, followed by one further
/// call (which must be refused), and rethrown, as a user's program would.
template <class B>
void rank_body(gs::Communicator<B>& comm, const Trial& t, const Limits& lim, RankRun& run) {
  const int r = comm.rank();
  const auto k = t.calls.size();
  run.calls.assign(k, {});
  for (std::size_t i = 0; i < k; ++i) {
    const bool faulty = r == t.f && static_cast<int>(i) == t.j;
    Call c = t.calls[i];
    if (faulty) {
      switch (t.fault) {
        case Fault::skip: run.calls[i].st = St::skipped; continue;
        case Fault::early_return: run.left = true; return;
        case Fault::user_throw: throw UserBoom("boom from rank " + std::to_string(r));
        case Fault::sleep: std::this_thread::sleep_for(std::chrono::duration<double>(lim.sleep)); break;
        case Fault::tiny_deadline: comm.set_timeout(1ms); break;
        default: c = t.odd; break;
      }
    }
    Outcome& o = run.calls[i];
    o.label = std::string(name(c.coll)) + " #" + std::to_string(comm.sequence() + 1);
    const auto t0 = Clock::now();
    try {
      o.what = run_call(comm, c, t.n, r);
      o.secs = since(t0);
      o.st = o.what.empty() ? St::ok : St::wrong;
    } catch (...) {
      o.secs = since(t0);
      o.st = current_status(o.what);
      std::exception_ptr failure = std::current_exception();
      const auto p0 = Clock::now();
      try {
        float x = 1.0f;
        run.probe.label = "AllReduce #" + std::to_string(comm.sequence() + 1);
        gs::AllReduce<gs::Ring>{}(comm, std::span<float>(&x, 1));
        run.probe.st = St::ok;
      } catch (...) {
        run.probe.st = current_status(run.probe.what);
      }
      run.probe.secs = since(p0);
      std::rethrow_exception(failure);
    }
    if (faulty && t.fault == Fault::tiny_deadline) {
      comm.set_timeout(std::chrono::duration<double>(lim.deadline_of(t)));
    }
  }
}

bool contains(std::string_view hay, std::string_view needle) { return hay.find(needle) != std::string_view::npos; }

std::string secs(double s) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3f s", s);
  return b;
}

/// Whatever rank r did wrong in trial t. `status[q][i]` is rank q's status
/// of call i (all ranks); `run` is rank r's full record.
std::vector<std::string> check_rank(const Trial& t, const Limits& lim, const std::vector<std::vector<int>>& status,
                                    int r, const RankRun& run) {
  std::vector<std::string> v;
  auto bad = [&](const std::string& s) { v.push_back("rank " + std::to_string(r) + ": " + s); };
  const bool is_f = r == t.f;
  const int k = static_cast<int>(t.calls.size());
  const double deadline = lim.deadline_of(t);
  const std::string rank_f = "rank " + std::to_string(t.f);
  auto st = [&](int i) { return i < static_cast<int>(run.calls.size()) ? run.calls[static_cast<std::size_t>(i)].st : St::none; };
  auto out = [&](int i) -> const Outcome& { return run.calls[static_cast<std::size_t>(i)]; };

  if (is_f && (t.fault == Fault::early_return || t.fault == Fault::user_throw)) {
    for (int i = 0; i < t.j; ++i) {
      if (st(i) != St::ok) bad("failed before the fault: " + describe(out(i)));
    }
    return v;
  }
  for (int i = 0; i < k; ++i) {
    if (st(i) == St::wrong) bad("returned normally with wrong data: " + describe(out(i)));
  }
  // GRADSYNC_FAULT_LENIENT=1 accepts the fault's error arriving in the call
  // before it (a rank still finishing call j-1 when call j failed elsewhere),
  // checked then as that rank's call j; by default that call must succeed.
  static const bool lenient = std::getenv("GRADSYNC_FAULT_LENIENT") != nullptr;
  int early = -1;
  for (int i = 0; i < t.j; ++i) {
    if (st(i) == St::ok || st(i) == St::wrong) continue;
    if (lenient && early < 0) {
      early = i;
      continue;
    }
    // A failure at the fault that reaches a rank still finishing an earlier
    // call (which every rank made alike) must not fail that call.
    if (!contains(out(i).what, out(i).label)) {
      bad("an earlier call that all ranks agreed on failed with a later call's error: " + describe(out(i)));
    } else {
      bad("failed before the fault: " + describe(out(i)));
    }
  }
  int first = -1;
  for (int i = 0; i < k; ++i) {
    if (is_error(st(i))) {
      first = i;
      break;
    }
  }
  if (first >= 0) {
    const Outcome& o = out(first);
    // (A call before the fault failed with a later call's error: said above.)
    if (first >= t.j && !contains(o.what, o.label)) {
      bad("the message does not name the call \"" + o.label + "\": " + describe(o));
    }
    if (run.probe.st != St::aborted) {
      bad("after " + o.label + " failed, a further call was not refused with Aborted: " + describe(run.probe));
    } else if (run.probe.secs > lim.refuse) {
      bad("refusing a further call took " + secs(run.probe.secs) + " (limit " + secs(lim.refuse) + ")");
    }
  }

  if (is_disagreement(t.fault)) {
    const int jr = early >= 0 ? early : is_f && t.fault == Fault::skip ? t.j + 1 : t.j;
    if (jr >= k) return v;
    const Outcome& o = out(jr);
    if (o.st != St::invalid) {
      bad("expected InvalidArgument (\"disagree\") where ranks disagreed, got " + describe(o));
    } else {
      const bool named = contains(o.what, "disagree") ||
                         (t.fault == Fault::count && (is_f || contains(o.what, rank_f)));
      if (!named) bad("an InvalidArgument that does not say the ranks disagree: " + describe(o));
    }
    if (o.secs > deadline + lim.slack) bad("took " + secs(o.secs) + ", past deadline + slack: " + describe(o));
    return v;
  }

  // A rank may return normally from call j only where its part did not need
  // the faulty rank (a Broadcast), and then its next call must fail.
  auto check_next_fails = [&](double limit) {
    if (t.j + 1 >= k) return;
    const Outcome& n = out(t.j + 1);
    if (!is_error(n.st)) {
      bad("after returning normally from call " + std::to_string(t.j) + ", the next call did not fail: " + describe(n));
    } else if (n.secs > limit) {
      bad("after returning normally from call " + std::to_string(t.j) + ", the next call took " + secs(n.secs) +
          " to fail (limit " + secs(limit) + "): " + describe(n));
    }
  };
  const Call& cj = t.calls[static_cast<std::size_t>(t.j)];
  const int jf = early >= 0 ? early : t.j;
  switch (t.fault) {
    case Fault::early_return:
    case Fault::user_throw: {
      const Outcome& o = out(jf);
      if (o.st == St::ok && cj.coll == Coll::broadcast) {
        check_next_fails(lim.fast);
      } else if (o.st == St::aborted || (o.st == St::timeout && contains(o.what, rank_f))) {
        if (!contains(o.what, rank_f)) bad("the error does not name " + rank_f + ": " + describe(o));
        if (o.secs > lim.fast) bad("not fast: " + secs(o.secs) + " (limit " + secs(lim.fast) + "): " + describe(o));
      } else {
        bad(std::string("expected Aborted naming ") + rank_f + ", got " + describe(o));
      }
      break;
    }
    case Fault::sleep: {
      const Outcome& o = out(jf);
      if (is_f) {
        if (is_error(o.st)) {
          if (o.st != St::aborted && o.st != St::timeout) bad("the late rank expected Aborted, got " + describe(o));
          if (o.secs > lim.fast) bad("the late rank's call took " + secs(o.secs) + " to fail: " + describe(o));
        }
      } else if (o.st == St::ok) {
        if (cj.coll != Coll::broadcast) bad("returned normally though " + rank_f + " never came: " + describe(o));
        check_next_fails(deadline + lim.slack);
      } else {
        if (o.st != St::timeout && o.st != St::aborted) bad("expected Timeout or Aborted, got " + describe(o));
        if (o.secs > deadline + lim.slack) bad("took " + secs(o.secs) + ", past deadline + slack: " + describe(o));
      }
      break;
    }
    case Fault::tiny_deadline: {
      bool any_failed = false;
      for (const auto& row : status) any_failed |= is_error(static_cast<St>(row[static_cast<std::size_t>(t.j)]));
      if (!any_failed) break;
      const Outcome& o = out(jf);
      if (o.st == St::ok) {
        check_next_fails(lim.fast);
      } else if (is_error(o.st)) {
        if (o.st == St::invalid || o.st == St::other || o.st == St::user) bad("unexpected class: " + describe(o));
        if (o.secs > lim.deadline + lim.slack) bad("took " + secs(o.secs) + ", past deadline + slack: " + describe(o));
      }
      break;
    }
    default: break;
  }
  return v;
}

std::vector<int> statuses(const RankRun& run, std::size_t k) {
  std::vector<int> s(k + 1, static_cast<int>(St::none));
  for (std::size_t i = 0; i < run.calls.size() && i < k; ++i) s[i] = static_cast<int>(run.calls[i].st);
  s[k] = static_cast<int>(run.probe.st);
  return s;
}

struct Plan {
  std::uint64_t base = 0;
  int trials = default_trials;
  int repeat = 1;  ///< GRADSYNC_FAULT_REPEAT: each seed this many times (races)
  std::uint64_t seed_of(int i) const { return base + static_cast<std::uint64_t>(i / repeat); }
};

Plan plan_from_env() {
  Plan p;
  const char* seed = std::getenv("GRADSYNC_FAULT_SEED");
  const char* trials = std::getenv("GRADSYNC_FAULT_TRIALS");
  const char* long_mode = std::getenv("GRADSYNC_FAULT_LONG");
  if (seed) {
    p.base = std::strtoull(seed, nullptr, 0);
    p.trials = 1;  // replay that one trial
  } else {
    std::random_device rd;
    p.base = (std::uint64_t{rd()} << 20) ^ std::uint64_t{rd()};
  }
  if (long_mode && std::string_view(long_mode) == "1") p.trials = 10000;
  if (trials) p.trials = std::atoi(trials);
  if (const char* repeat = std::getenv("GRADSYNC_FAULT_REPEAT")) p.repeat = std::max(1, std::atoi(repeat));
  p.trials *= p.repeat;
  return p;
}

/// Failures by kind, and a few seeds of each.
struct Tally {
  std::array<int, fault_kinds> ran{}, failed{};
  std::array<std::vector<std::uint64_t>, fault_kinds> seeds;
  void add(const Trial& t, bool ok) {
    const auto i = static_cast<std::size_t>(t.fault);
    ++ran[i];
    if (!ok) {
      ++failed[i];
      if (seeds[i].size() < 6) seeds[i].push_back(t.seed);
    }
  }
  int total_failed() const {
    int n = 0;
    for (int x : failed) n += x;
    return n;
  }
  void print(int trials, double secs_total) const {
    std::printf("fault suite (%s): %d trials, %d failed, %.1f s; by kind:", backend_name, trials, total_failed(), secs_total);
    for (int i = 0; i < fault_kinds; ++i) {
      std::printf(" %s %d/%d%s", name(static_cast<Fault>(i)), failed[static_cast<std::size_t>(i)],
                  ran[static_cast<std::size_t>(i)], i + 1 < fault_kinds ? "," : "\n");
    }
    for (int i = 0; i < fault_kinds; ++i) {
      if (seeds[static_cast<std::size_t>(i)].empty()) continue;
      std::printf("  failing %s seeds:", name(static_cast<Fault>(i)));
      for (auto s : seeds[static_cast<std::size_t>(i)]) std::printf(" %llu", static_cast<unsigned long long>(s));
      std::printf("\n");
    }
    std::fflush(stdout);
  }
};

/// GRADSYNC_FAULT_VERBOSE=1: every rank's outcome of every call.
void print_outcomes(int r, const RankRun& run) {
  static const bool verbose = std::getenv("GRADSYNC_FAULT_VERBOSE") != nullptr;
  if (!verbose) return;
  std::string s;
  for (const Outcome& o : run.calls) if (o.st != St::none) s += "    rank " + std::to_string(r) + " " + describe(o) + "\n";
  if (run.probe.st != St::none) s += "    rank " + std::to_string(r) + " then " + describe(run.probe) + "\n";
  if (run.left) s += "    rank " + std::to_string(r) + " left\n";
  std::printf("%s", s.c_str());
  std::fflush(stdout);
}

void print_violations(const std::vector<std::string>& v) {
  const std::size_t shown = std::min<std::size_t>(v.size(), 8);
  for (std::size_t i = 0; i < shown; ++i) std::printf("    %s\n", v[i].c_str());
  if (v.size() > shown) std::printf("    ... and %zu more\n", v.size() - shown);
  std::fflush(stdout);
}

}  // namespace

#ifndef GRADSYNC_TEST_MPI

TEST_CASE("randomized faults on Threads: every rank ends promptly with the promised error") {
  default_crash_actions();
  const Limits lim = Limits::make();
  const Plan plan = plan_from_env();
  test::Watchdog watchdog;
  Tally tally;
  const auto start = Clock::now();
  for (int i = 0; i < plan.trials; ++i) {
    const Trial t = make_trial(i, plan.seed_of(i), 0);
    const std::string line = describe(t);
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
    watchdog.arm(std::chrono::duration<double>(lim.budget + lim.sleep), line);
    std::vector<RankRun> runs(static_cast<std::size_t>(t.n));
    St top = St::none;
    std::string top_what;
    const auto t0 = Clock::now();
    try {
      gs::run_threads(t.n,
                      gs::ThreadsOptions{.timeout = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                             std::chrono::duration<double>(lim.deadline_of(t)))},
                      [&](gs::Communicator<gs::Threads>& comm) {
                        rank_body(comm, t, lim, runs[static_cast<std::size_t>(comm.rank())]);
                      });
    } catch (...) {
      top = current_status(top_what);
    }
    const double took = since(t0);
    watchdog.disarm();

    std::vector<std::vector<int>> status;
    for (const RankRun& run : runs) status.push_back(statuses(run, t.calls.size()));
    std::vector<std::string> v;
    for (int r = 0; r < t.n; ++r) {
      print_outcomes(r, runs[static_cast<std::size_t>(r)]);
      auto vr = check_rank(t, lim, status, r, runs[static_cast<std::size_t>(r)]);
      v.insert(v.end(), vr.begin(), vr.end());
    }
    const std::string boom = "boom from rank " + std::to_string(t.f);
    if (t.fault == Fault::user_throw && (top != St::user || top_what != boom)) {
      v.push_back("run_threads did not rethrow the user's exception \"" + boom + "\"; it ended with " + name(top) +
                  (top_what.empty() ? "" : ": " + top_what));
    }
    const double allowed = lim.deadline_of(t) + lim.slack + (t.fault == Fault::sleep ? lim.sleep : 0.0) +
                           (t.fault == Fault::tiny_deadline ? 2.0 * lim.factor : 0.0) + 0.5 * lim.factor;
    if (took > allowed) v.push_back("the trial took " + secs(took) + " (limit " + secs(allowed) + ")");
    tally.add(t, v.empty());
    if (!v.empty()) {
      std::printf("  FAILED %s\n", line.c_str());
      print_violations(v);
    }
    CHECK_MESSAGE(v.empty(), line, "\n  ", (v.empty() ? std::string() : v.front()));
  }
  tally.print(plan.trials, since(start));
  MESSAGE("fault suite (threads): ", plan.trials, " trials, ", tally.total_failed(), " failed");
}

#else


TEST_CASE("randomized faults on Mpi: every rank ends promptly with the promised error") {
  default_crash_actions();
  const int n = test::mpi_size();
  const int me = test::mpi_rank();
  if (n < 2 || n > 5) {
    MESSAGE("needs 2 to 5 processes, got ", n);
    return;
  }
  const Limits lim = Limits::make();
  Plan plan = plan_from_env();
  std::uint64_t base = plan.base;
  MPI_Bcast(&base, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  plan.base = base;
  test::Watchdog watchdog;
  Tally tally;
  const auto start = Clock::now();
  for (int i = 0; i < plan.trials; ++i) {
    const Trial t = make_trial(i, plan.seed_of(i), n);
    const std::string line = describe(t);
    if (me == 0) {
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    }
    watchdog.arm(std::chrono::duration<double>(lim.budget + lim.sleep), "rank " + std::to_string(me) + ": " + line);
    RankRun run;
    St top = St::none;
    std::string top_what;
    const auto t0 = Clock::now();
    try {
      // A fresh communicator per trial: a failed one stays failed; leaving
      // early destroys it while the others are still calling.
      gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
      comm.set_timeout(std::chrono::duration<double>(lim.deadline_of(t)));
      rank_body(comm, t, lim, run);
    } catch (...) {
      top = current_status(top_what);
    }
    const double took = since(t0);

    const std::size_t k = t.calls.size();
    std::vector<int> mine = statuses(run, k);
    std::vector<int> all(mine.size() * static_cast<std::size_t>(n));
    // Ranks that are done wait here for the faulty one without spinning (support/idle_mpi.hpp).
    MPI_Request gathered;
    MPI_Iallgather(mine.data(), static_cast<int>(mine.size()), MPI_INT, all.data(), static_cast<int>(mine.size()),
                   MPI_INT, MPI_COMM_WORLD, &gathered);
    test::idle_wait(gathered);
    watchdog.disarm();
    std::vector<std::vector<int>> status;
    for (int q = 0; q < n; ++q) {
      status.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(q * mine.size()),
                          all.begin() + static_cast<std::ptrdiff_t>((q + 1) * mine.size()));
    }
    print_outcomes(me, run);
    std::vector<std::string> v = check_rank(t, lim, status, me, run);
    if (me == t.f && t.fault == Fault::user_throw && top != St::user) {
      v.push_back("rank " + std::to_string(me) + ": the user's exception did not come through; got " + name(top));
    }
    const double allowed = lim.deadline_of(t) + lim.slack + (t.fault == Fault::sleep ? lim.sleep : 0.0) +
                           (t.fault == Fault::tiny_deadline ? 2.0 * lim.factor : 0.0) + 0.5 * lim.factor;
    if (took > allowed) {
      v.push_back("rank " + std::to_string(me) + ": its part took " + secs(took) + " (limit " + secs(allowed) + ")");
    }
    const int any_bad = test::idle_max(v.empty() ? 0 : 1);
    tally.add(t, any_bad == 0);
    if (!v.empty()) {
      std::printf("  FAILED (rank %d) %s\n", me, line.c_str());
      print_violations(v);
    }
    CHECK_MESSAGE(v.empty(), line, "\n  ", (v.empty() ? std::string() : v.front()));
    test::idle_barrier();
  }
  if (me == 0) tally.print(plan.trials, since(start));
}

#endif

}  // namespace fault_suite
