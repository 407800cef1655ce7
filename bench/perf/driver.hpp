#pragma once
/// \file The nccl-tests style driver shared by the *_perf tools: timing,
/// checking, the algorithm loop, tables, summary and JSON. A tool describes
/// its collective in a small descriptor (PerfCollective) and calls
/// bench::perf_main<Descriptor>(argc, argv).
///
/// Conventions (nccl-tests, doc/PERFORMANCE.md): GB = 1e9 bytes, algbw =
/// size / time, busbw = algbw * the collective's factor. The time of one size
/// is the per-call mean over back-to-back calls, the maximum over ranks of it,
/// and the median of that over repeats.

#include <gradsync/collectives.hpp>
#ifdef GRADSYNC_BENCH_MPI
#include <gradsync/backend/mpi.hpp>
#endif
#include "shared_launches.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <iterator>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "args.hpp"
#include "data.hpp"

namespace bench {

#ifdef GRADSYNC_BENCH_MPI
using Backend = gradsync::Mpi;
#else
using Backend = gradsync::Threads;
#endif
using Comm = gradsync::Communicator<Backend>;
using Clock = std::chrono::steady_clock;

/// What a tool says about its collective. Sizes: count_for turns the
/// requested elements into the count column, size_elements turns that into
/// the size column's elements, send_count and recv_count size the buffers.
/// Beside these, static member templates (checked where used):
/// - `input<T, Op>(shape, i)`: this rank's send element i;
/// - `expect<T, Op>(shape, out)`: the exact result, recv_count elements;
/// - `fill_in_place<T, Op>(shape, buf, timing)`: the in-place buffer before
///   a call (only if in_place);
/// - `run<Algo, T, Op>(comm, shape, send, recv, in_place)`: one call.
template <class D>
concept PerfCollective = requires(int n, std::size_t c) {
  { D::name } -> std::convertible_to<std::string_view>;
  { D::collective } -> std::convertible_to<gradsync::Collective>;
  { D::reduces } -> std::convertible_to<bool>;       // -o applies; else redop "none"
  { D::rooted } -> std::convertible_to<bool>;        // --root applies; else root -1
  { D::model_modes } -> std::convertible_to<bool>;   // --calibrate and --model accepted
  { D::out_of_place } -> std::convertible_to<bool>;  // placements the primitive supports
  { D::in_place } -> std::convertible_to<bool>;
  { D::busbw_formula } -> std::convertible_to<std::string_view>;
  { D::usage_note } -> std::convertible_to<std::string_view>;
  { D::header_note } -> std::convertible_to<std::string_view>;
  { D::size_convention } -> std::convertible_to<std::string_view>;
  { D::busbw_factor(n) } -> std::same_as<double>;
  { D::count_for(c, n) } -> std::same_as<std::size_t>;
  { D::size_elements(c, n) } -> std::same_as<std::size_t>;
  { D::send_count(c, n) } -> std::same_as<std::size_t>;
  { D::recv_count(c, n) } -> std::same_as<std::size_t>;
};

/// Each collective's tool, as its binary is named: the usage text, the
/// table's header, the JSON's "benchmark" and the error prefix say it.
constexpr std::string_view perf_tool_name(gradsync::Collective c) {
  switch (c) {
    case gradsync::Collective::all_reduce: return "all_reduce_perf";
    case gradsync::Collective::reduce_scatter: return "reduce_scatter_perf";
    case gradsync::Collective::all_gather: return "all_gather_perf";
    case gradsync::Collective::broadcast: return "broadcast_perf";
    default: return "";
  }
}

/// What a descriptor inherits unless it says otherwise: its collective C and
/// the tool's name, no reduction, no root, no model modes, both placements,
/// no notes, sizes per rank (the size column is each rank's buffer of count
/// elements), and as input this rank's pattern under the op (Sum where the
/// collective does not reduce).
template <gradsync::Collective C>
struct PerfDefaults {
  static_assert(!perf_tool_name(C).empty(), "the *_perf tools time all_reduce, reduce_scatter, all_gather and broadcast");
  static constexpr gradsync::Collective collective = C;
  static constexpr std::string_view name = perf_tool_name(C);
  static constexpr bool reduces = false;
  static constexpr bool rooted = false;
  static constexpr bool model_modes = false;
  static constexpr bool out_of_place = true;
  static constexpr bool in_place = true;
  static constexpr std::string_view usage_note = "";
  static constexpr std::string_view header_note = "";
  static constexpr std::string_view size_convention = "";
  static std::size_t count_for(std::size_t elements, int) { return elements; }
  static std::size_t size_elements(std::size_t count, int) { return count; }
  static std::size_t send_count(std::size_t count, int) { return count; }
  static std::size_t recv_count(std::size_t count, int) { return count; }

  template <class T, class Op>
  static T input(const Shape& s, std::size_t i) {
    return from_int<T>(input_value<Op>(s.rank, i));
  }
};

/// Collectives whose size column is the whole array of N per-rank blocks, as
/// nccl-tests counts reduce-scatter and all-gather; count is per rank. Each
/// rank sends or receives all blocks but its own, so busbw = algbw * (N-1)/N.
template <gradsync::Collective C>
struct PerfBlocks : PerfDefaults<C> {
  static constexpr std::string_view size_convention = "N x per-rank bytes (count is elements per rank)";
  static constexpr std::string_view busbw_formula = "(N-1)/N";
  static double busbw_factor(int n) { return static_cast<double>(n - 1) / n; }
  static std::size_t count_for(std::size_t elements, int n) { return elements / static_cast<std::size_t>(n); }
  static std::size_t size_elements(std::size_t count, int n) { return count * static_cast<std::size_t>(n); }
};

/// -n 0's bounds on calls per repeat.
inline constexpr int min_auto_iters = 3;
inline constexpr int max_auto_iters = 100000;

// ------------------------------------------------------------ statistics

inline double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<std::size_t>(pos);
  const std::size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

inline double gb_per_s(std::size_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0;
}

/// Where the copied buffer escapes to, so that the copy cannot be elided.
inline char* volatile memcpy_sink = nullptr;

/// Single-thread memcpy bandwidth on 64 MiB, best of 5, counting the bytes
/// read plus the bytes written: the ceiling any shared-memory copy can reach.
inline double memcpy_gb_per_s() {
  constexpr std::size_t bytes = std::size_t{64} << 20;
  std::vector<char> src(bytes, 1), dst(bytes, 0);  // touched: first touch is slow
  double best = HUGE_VAL;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(dst.data(), src.data(), bytes);
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
    memcpy_sink = dst.data();
  }
  return gb_per_s(2 * bytes, best);
}

// ---------------------------------------------------------------- results

/// One placement (out of place or in place) at one size.
struct Timing {
  double seconds = 0;              // median over repeats
  std::vector<double> repeats;     // per repeat: max over ranks of the per-call mean
  long long wrong = 0;             // summed over ranks; -1 when not checked
  int iters = 0;
};

struct Row {
  std::size_t bytes = 0;           // the size column
  std::size_t count = 0;           // the count column
  Timing out_of_place, in_place;
  double predicted = 0;            // explain()'s prediction for this algorithm
  std::string auto_pick;           // what Auto would run at this size
};

struct Table {
  std::string algorithm;
  std::vector<Row> rows;
};

struct Report {
  Config cfg;
  double memcpy_gbps = 0;
  std::vector<Table> tables;  // in cfg.algorithms order
};

/// The placement the footer and the summary report: out of place where the
/// primitive has it (as nccl-tests' tables lead with it), else in place.
template <class Desc>
const Timing& primary(const Row& r) {
  if constexpr (Desc::out_of_place) return r.out_of_place;
  else return r.in_place;
}

template <class Desc>
constexpr const char* primary_name() {
  return Desc::out_of_place ? "out-of-place" : "in-place";
}

/// The footer's figure: mean busbw of the primary placement over all sizes.
template <class Desc>
double avg_busbw(const Table& t, double factor) {
  double sum = 0;
  for (const Row& r : t.rows) sum += gb_per_s(r.bytes, primary<Desc>(r).seconds) * factor;
  return t.rows.empty() ? 0 : sum / static_cast<double>(t.rows.size());
}

/// Hands a number from every rank to every rank, without going through the
/// collective under test: the ranks share memory, and the barriers order each
/// write before the reads, and the reads before the next write.
///
/// Over MPI the ranks are processes: MPI_Allgather on MPI_COMM_WORLD, which
/// the communicator under test has duplicated, so the two never mix.
class Board {
 public:
  explicit Board(int ranks) : slots_(static_cast<std::size_t>(ranks)) {}
#ifdef GRADSYNC_BENCH_MPI
  std::vector<double> gather(Comm&, double mine) {
    std::vector<double> all = slots_;
    MPI_Allgather(&mine, 1, MPI_DOUBLE, all.data(), 1, MPI_DOUBLE, MPI_COMM_WORLD);
    return all;
  }
#else
  std::vector<double> gather(Comm& comm, double mine) {
    slots_[static_cast<std::size_t>(comm.rank())] = mine;
    comm.barrier();
    std::vector<double> all = slots_;
    comm.barrier();
    return all;
  }
#endif
  double max(Comm& comm, double mine) {
    const auto all = gather(comm, mine);
    return *std::max_element(all.begin(), all.end());
  }
  double sum(Comm& comm, double mine) {
    const auto all = gather(comm, mine);
    double s = 0;
    for (double v : all) s += v;
    return s;
  }

 private:
  std::vector<double> slots_;
};

/// The ranks of one run: threads of this process, or the MPI processes.
/// The body is type-erased so that run_threads (threads, exceptions,
/// deadlines) is compiled once, not once per (type, op) the tool sweeps.
class Ranks {
 public:
  using Body = std::function<void(Comm&, Board&)>;
#ifdef GRADSYNC_BENCH_MPI
  explicit Ranks(Config& cfg) : world_(MPI_COMM_WORLD) { cfg.ranks = world_.size(); }
  bool printer() const { return world_.rank() == 0; }
  void run(const Body& body) {
    Board board(world_.size());
    body(world_, board);
  }

 private:
  Comm world_;
#else
  explicit Ranks(const Config& cfg) : ranks_(cfg.ranks) {}
  bool printer() const { return true; }
  void run(const Body& body) {
    Board board(ranks_);
    gradsync::run_threads(ranks_, [&](Comm& comm) { body(comm, board); });
  }

 private:
  int ranks_;
#endif
};

// ----------------------------------------------------------- measurement

/// Every rank: warm up, pick an iteration count (agreed across ranks), then
/// time `repeats` batches of back-to-back calls.
template <class Call>
Timing time_calls(Comm& comm, Board& board, const Config& cfg, Call&& call) {
  for (int i = 0; i < cfg.warmup; ++i) call();
  auto batch = [&](int n) {
    comm.barrier();
    const auto t0 = Clock::now();
    for (int i = 0; i < n; ++i) call();
    const double mean = std::chrono::duration<double>(Clock::now() - t0).count() / n;
    return board.max(comm, mean);  // the slowest rank's view of the call
  };
  Timing t;
  t.iters = cfg.iters;
  if (t.iters == 0) {
    // Calibrate: double the batch until it takes 10 ms, then size each repeat
    // so that all repeats together fill the time budget.
    double per_call = 0;
    for (int n = 1;; n *= 2) {
      per_call = batch(n);
      if (per_call * n >= 0.01 || n >= max_auto_iters) break;
    }
    const double want = time_budget_s / cfg.repeats / std::max(per_call, 1e-9);
    t.iters = static_cast<int>(std::clamp(want, double{min_auto_iters}, double{max_auto_iters}));
  }
  for (int r = 0; r < cfg.repeats; ++r) t.repeats.push_back(batch(t.iters));
  t.seconds = percentile(t.repeats, 0.5);
  return t;
}

/// One rank's spans for a call of `s`'s shape.
template <class Desc, class T>
struct Spans {
  Spans(Buffers<T>& buf, const Shape& s)
      : send(buf.send.data(), Desc::send_count(s.count, s.ranks)),
        recv(buf.recv.data(), Desc::recv_count(s.count, s.ranks)),
        want(buf.expected.data(), recv.size()) {}
  std::span<T> send, recv;
  std::span<const T> want;
};

/// Out of place: every rank's input in send, and recv all unwritten.
template <class Desc, class T, class Op>
void fill_out_of_place(const Shape& s, const Spans<Desc, T>& x) {
  for (std::size_t i = 0; i < x.send.size(); ++i) x.send[i] = Desc::template input<T, Op>(s, i);
  std::fill(x.recv.begin(), x.recv.end(), unwritten<T>());
}

/// One call of the collective under test with its algorithm bound. The
/// checking and timing code below takes it by pointer, so it is compiled
/// once per (type, op, placement) rather than once per algorithm as well:
/// five times less code in every *_perf tool, for one indirect call per
/// timed call (a nanosecond against the microsecond a small call takes).
template <class T>
using CallFn = void (*)(Comm&, const Shape&, std::span<const T>, std::span<T>, bool);

/// Checks one call on pattern data; returns the wrong elements summed over
/// ranks. Out of place, a changed input element counts as wrong too.
template <class Desc, bool InPlace, class T, class Op>
long long check_once(Comm& comm, Board& board, Buffers<T>& buf, const Shape& s, CallFn<T> call) {
  const Spans<Desc, T> x(buf, s);
  long long wrong = 0;
  if constexpr (InPlace) {
    Desc::template fill_in_place<T, Op>(s, x.recv, false);
    call(comm, s, x.send, x.recv, true);
  } else {
    fill_out_of_place<Desc, T, Op>(s, x);
    call(comm, s, x.send, x.recv, false);
    for (std::size_t i = 0; i < x.send.size(); ++i) wrong += !(x.send[i] == Desc::template input<T, Op>(s, i));
  }
  wrong += count_differences<T>(x.recv, x.want);
  return static_cast<long long>(board.sum(comm, static_cast<double>(wrong)));
}

template <class Desc, bool InPlace, class T, class Op>
Timing measure(Comm& comm, Board& board, const Config& cfg, Buffers<T>& buf, const Shape& s, CallFn<T> call) {
  const long long wrong = cfg.check ? check_once<Desc, InPlace, T, Op>(comm, board, buf, s, call) : -1;
  const Spans<Desc, T> x(buf, s);
  if constexpr (InPlace) Desc::template fill_in_place<T, Op>(s, x.recv, true);
  else fill_out_of_place<Desc, T, Op>(s, x);
  Timing t = time_calls(comm, board, cfg, [&] { call(comm, s, x.send, x.recv, InPlace); });
  t.wrong = wrong;
  return t;
}

using Algorithms = std::tuple<gradsync::Ring, gradsync::Tree, gradsync::RecursiveHalvingDoubling, gradsync::Native,
                              gradsync::Auto>;

/// The cost model's prediction for `algo` at `bytes`; for auto, its pick's.
inline double predicted_seconds(const gradsync::Explanation& e, std::string_view algo) {
  const std::string_view name = algo == "auto" ? e.chosen : algo;
  for (const auto& c : e.candidates)
    if (c.algorithm == name) return c.seconds;
  return NAN;
}

/// Every rank runs this. Sizes are the outer loop and algorithms the inner
/// one, so that all algorithms see the machine in the same state at each
/// size: on a noisy machine that matters more than streaming the output.
template <class Desc, class T, class Op>
void run_rank(Comm& comm, Board& board, Report& report) {
  const Config& cfg = report.cfg;
  const auto swept = sizes(cfg);
  Buffers<T> buf(swept.back() / sizeof(T));
  for (const std::size_t requested : swept) {
    Row row;
    row.count = Desc::count_for(requested / sizeof(T), comm.size());
    // A size below one element per rank (8 B of floats over 4 ranks, for a
    // collective of N blocks) leaves nothing to move: no row, rather than a
    // row of 0 bytes that counts in the footer's mean. Alike on every rank.
    if (row.count == 0 && requested > 0) continue;
    row.bytes = Desc::size_elements(row.count, comm.size()) * sizeof(T);
    const Shape shape{comm.rank(), comm.size(), row.count, Desc::rooted ? cfg.root : -1};
    if (cfg.check) {
      Desc::template expect<T, Op>(shape, std::span<T>(buf.expected.data(), Desc::recv_count(row.count, comm.size())));
    }
    const gradsync::Explanation e = gradsync::explain(comm, Desc::collective, row.bytes);
    row.auto_pick = e.chosen;
    std::apply(
        [&](auto... algos) {
          auto one = [&](auto algo) {
            using Algo = decltype(algo);
            const auto& wanted = cfg.algorithms;
            const auto table = std::find(wanted.begin(), wanted.end(), Algo::name);
            if (table == wanted.end()) return;
            Row r = row;
            const CallFn<T> call = &Desc::template run<Algo, T, Op>;
            if constexpr (Desc::out_of_place) r.out_of_place = measure<Desc, false, T, Op>(comm, board, cfg, buf, shape, call);
            if constexpr (Desc::in_place) r.in_place = measure<Desc, true, T, Op>(comm, board, cfg, buf, shape, call);
            r.predicted = predicted_seconds(e, Algo::name);
            if (comm.rank() == 0) report.tables[static_cast<std::size_t>(table - wanted.begin())].rows.push_back(r);
          };
          (one(algos), ...);
        },
        Algorithms{});
  }
}

// ---------------------------------------------------------------- output

inline std::string format_time_us(double seconds) {
  const double us = seconds * 1e6;
  char text[32];
  std::snprintf(text, sizeof text, us < 1e4 ? "%8.2f" : "%8.0f", us);
  return text;
}

/// time algbw busbw #wrong of one placement; all "-" where not measured.
inline std::string format_side(const Timing& t, std::size_t bytes, double factor, bool measured) {
  char text[96];
  if (!measured) {
    std::snprintf(text, sizeof text, "%8s  %6s  %6s  %6s", "-", "-", "-", "-");
    return text;
  }
  const double algbw = gb_per_s(bytes, t.seconds);
  std::snprintf(text, sizeof text, "%s  %6.2f  %6.2f  %6s", format_time_us(t.seconds).c_str(), algbw,
                algbw * factor, t.wrong < 0 ? "N/A" : std::to_string(t.wrong).c_str());
  return text;
}

template <class Desc>
std::string redop(const Config& cfg) {
  return Desc::reduces ? cfg.op : "none";
}

template <class Desc>
void print_header(const Report& rep) {
  const Config& cfg = rep.cfg;
  const int n = cfg.ranks;
  std::printf("# memcpy bandwidth: %.2f GB/s (read+write)\n", rep.memcpy_gbps);
  std::printf("# gradsync %s: world size %d (%s)\n", std::string(Desc::name).c_str(), n,
              backend_name == "mpi" ? "Mpi backend, one MPI process per rank" : "Threads backend, one thread per rank");
  std::string algorithms;
  for (const auto& a : cfg.algorithms) algorithms += " " + a;
  std::printf("# algorithm:%s\n", algorithms.c_str());
  std::printf("# type %s, op %s, sizes %zu to %zu bytes, factor %zu\n", cfg.type.c_str(), redop<Desc>(cfg).c_str(),
              cfg.min_bytes, cfg.max_bytes, cfg.factor);
  std::printf("# busbw factor %s = %.4f\n", std::string(Desc::busbw_formula).c_str(), Desc::busbw_factor(n));
  if (Desc::rooted) std::printf("# root %d (--root)\n", cfg.root);
  std::fputs(std::string(Desc::header_note).c_str(), stdout);
  std::printf("# time: per-call mean of back-to-back calls, MAX over ranks, median of %d repeats;", cfg.repeats);
  if (cfg.iters) std::printf(" %d calls per repeat;", cfg.iters);
  else std::printf(" calls per repeat auto (~%.1f s per size and placement);", time_budget_s);
  std::printf(" %d warm-up calls\n", cfg.warmup);
  std::printf("# check: %s\n", cfg.check ? "on (#wrong = elements not exactly as expected, summed over ranks)" : "off");
  std::printf("# GB = 1e9 bytes; predicted = gradsync::explain() for the algorithm measured (auto: its pick)\n");
}

template <class Desc>
void print_table(const Table& t, const Config& cfg) {
  const double factor = Desc::busbw_factor(cfg.ranks);
  const int root = Desc::rooted ? cfg.root : -1;
  std::printf("#\n# algorithm: %s\n", t.algorithm.c_str());
  std::printf("#%67s%38s\n", "out-of-place", "in-place");
  std::printf("#%11s  %12s  %8s  %6s  %6s  %8s  %6s  %6s  %6s  %8s  %6s  %6s  %6s  %9s\n", "size", "count", "type",
              "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong", "predicted");
  std::printf("#%11s  %12s  %8s  %6s  %6s  %8s  %6s  %6s  %6s  %8s  %6s  %6s  %6s  %9s\n", "(B)", "(elements)", "",
              "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)");
  for (const Row& r : t.rows) {
    std::printf("%12zu  %12zu  %8s  %6s  %6d  %s  %s  %9s\n", r.bytes, r.count, cfg.type.c_str(),
                redop<Desc>(cfg).c_str(), root, format_side(r.out_of_place, r.bytes, factor, Desc::out_of_place).c_str(),
                format_side(r.in_place, r.bytes, factor, Desc::in_place).c_str(), format_time_us(r.predicted).c_str());
  }
  std::printf("# Avg bus bandwidth    : %g\n", avg_busbw<Desc>(t, factor));
}

/// With several algorithms: the fastest measured one at each size (primary
/// placement), next to what Auto would pick and how Auto's own time compares.
template <class Desc>
void print_summary(const Report& rep) {
  const Table* auto_table = nullptr;
  std::vector<const Table*> fixed;
  for (const Table& t : rep.tables) {
    if (t.algorithm == "auto") auto_table = &t;
    else fixed.push_back(&t);
  }
  if (fixed.size() + (auto_table != nullptr) < 2) return;
  auto seconds = [](const Table* t, std::size_t i) { return primary<Desc>(t->rows[i]).seconds; };
  std::printf("#\n# Summary: winner at each size (%s time in us; auto/best = Auto's time / winner's)\n",
              primary_name<Desc>());
  std::printf("#%11s", "size");
  for (const Table* t : fixed) std::printf("  %8s", t->algorithm.c_str());
  if (auto_table) std::printf("  %8s", "auto");
  std::printf("  %7s  %9s  %9s\n", "winner", "auto-pick", "auto/best");
  const std::size_t rows = rep.tables.front().rows.size();
  for (std::size_t i = 0; i < rows; ++i) {
    const Row& first = rep.tables.front().rows[i];
    std::printf("%12zu", first.bytes);
    const Table* best = nullptr;
    for (const Table* t : fixed) {
      std::printf("  %s", format_time_us(seconds(t, i)).c_str());
      if (!best || seconds(t, i) < seconds(best, i)) best = t;
    }
    if (auto_table) std::printf("  %s", format_time_us(seconds(auto_table, i)).c_str());
    std::printf("  %7s  %9s", best ? best->algorithm.c_str() : "-", first.auto_pick.c_str());
    if (auto_table && best) std::printf("  %9.2f", seconds(auto_table, i) / seconds(best, i));
    std::printf("\n");
  }
}

// ------------------------------------------------------------------ JSON

inline std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char text[32];
  std::snprintf(text, sizeof text, "%.6g", v);
  return text;
}

inline std::string json_string(std::string_view s) { return "\"" + std::string(s) + "\""; }  // names only: no escapes needed

/// One placement's figures; null where the placement is not measured.
inline std::string json_timing(const Timing& t, std::size_t bytes, double factor, bool measured) {
  if (!measured) return "null";
  std::string repeats;
  for (double s : t.repeats) repeats += (repeats.empty() ? "" : ", ") + json_number(s * 1e6);
  const double algbw = gb_per_s(bytes, t.seconds);
  return "{\"time_us\": " + json_number(t.seconds * 1e6) + ", \"algbw_GBps\": " + json_number(algbw) +
         ", \"busbw_GBps\": " + json_number(algbw * factor) +
         ", \"wrong\": " + (t.wrong < 0 ? "null" : std::to_string(t.wrong)) + ", \"iters\": " + std::to_string(t.iters) +
         ", \"p50_us\": " + json_number(percentile(t.repeats, 0.5) * 1e6) +
         ", \"p99_us\": " + json_number(percentile(t.repeats, 0.99) * 1e6) + ", \"repeats_us\": [" + repeats + "]}";
}

template <class Desc>
void write_json(const Report& rep) {
  const Config& cfg = rep.cfg;
  const double factor = Desc::busbw_factor(cfg.ranks);
  std::ofstream out(cfg.json_path);
  if (!out) throw std::runtime_error("cannot write " + cfg.json_path);
  out << "{\n  \"benchmark\": " << json_string(Desc::name) << ", \"backend\": " << json_string(backend_name)
      << ", \"world_size\": " << cfg.ranks << ", \"type\": " << json_string(cfg.type)
      << ", \"op\": " << json_string(redop<Desc>(cfg));
  if (Desc::rooted) out << ", \"root\": " << cfg.root;
  if (!Desc::size_convention.empty()) out << ", \"size_convention\": " << json_string(Desc::size_convention);
  out << ", \"busbw_factor\": " << json_number(factor) << ",\n  \"time\": "
      << json_string("per-call mean of back-to-back calls, max over ranks, median over repeats")
      << ", \"repeats\": " << cfg.repeats << ", \"warmup\": " << cfg.warmup
      << ", \"memcpy_GBps\": " << json_number(rep.memcpy_gbps) << ",\n  \"tables\": [";
  for (std::size_t k = 0; k < rep.tables.size(); ++k) {
    const Table& t = rep.tables[k];
    out << (k ? "," : "") << "\n    {\"algorithm\": " << json_string(t.algorithm)
        << ", \"avg_busbw_GBps\": " << json_number(avg_busbw<Desc>(t, factor)) << ", \"rows\": [";
    for (std::size_t i = 0; i < t.rows.size(); ++i) {
      const Row& r = t.rows[i];
      out << (i ? "," : "") << "\n      {\"size\": " << r.bytes << ", \"count\": " << r.count
          << ", \"predicted_us\": " << json_number(r.predicted * 1e6) << ", \"auto_pick\": " << json_string(r.auto_pick)
          << ",\n       \"out_of_place\": " << json_timing(r.out_of_place, r.bytes, factor, Desc::out_of_place)
          << ",\n       \"in_place\": " << json_timing(r.in_place, r.bytes, factor, Desc::in_place) << "}";
    }
    out << "\n    ]}";
  }
  out << "\n  ]\n}\n";
}

// ------------------------------------------------------------- dispatch

/// -d's and -o's names as values (parse_args accepts only names these know).
inline gradsync::DataType data_type_named(const std::string& name) {
  for (std::size_t i = 0; i < std::size(gradsync::data_type_names); ++i)
    if (gradsync::data_type_names[i] == name) return static_cast<gradsync::DataType>(i);
  return gradsync::DataType::float32;
}
inline gradsync::OpKind op_kind_named(const std::string& name) {
  using K = gradsync::OpKind;
  for (K k : {K::sum, K::avg, K::min, K::max, K::prod})
    if (gradsync::detail::name(k) == name) return k;
  return K::sum;
}

/// Calls f with -o's op; a collective that does not reduce gets Sum, unused,
/// so that it is compiled once rather than once per op.
template <class Desc, class F>
void with_op(const std::string& name, F&& f) {
  if constexpr (!Desc::reduces) {
    f(gradsync::Sum{});
  } else {
    gradsync::visit(op_kind_named(name), f);
  }
}

inline long long total_wrong(const Report& rep) {
  long long n = 0;
  for (const Table& t : rep.tables)
    for (const Row& r : t.rows) n += std::max(0LL, r.out_of_place.wrong) + std::max(0LL, r.in_place.wrong);
  return n;
}

/// The table mode: every algorithm in cfg.algorithms over the sizes, then
/// the tables, the summary and the JSON. Returns the exit status.
template <PerfCollective Desc>
int run_benchmark(Config cfg) {
  static_assert(Desc::out_of_place || Desc::in_place, "a descriptor must measure at least one placement");
  Report rep;
  rep.cfg = std::move(cfg);
  for (const auto& a : rep.cfg.algorithms) rep.tables.push_back(Table{a, {}});
  rep.memcpy_gbps = memcpy_gb_per_s();
  Ranks ranks(rep.cfg);
  if (Desc::rooted && rep.cfg.root >= rep.cfg.ranks) {
    usage_error("--root " + std::to_string(rep.cfg.root) + " is not a rank of a world of size " +
                std::to_string(rep.cfg.ranks) + "; pass a root in [0, " + std::to_string(rep.cfg.ranks) + ")");
  }
  const bool printer = ranks.printer();
  if (printer) print_header<Desc>(rep);
  std::fflush(stdout);
  gradsync::visit(data_type_named(rep.cfg.type), [&]<class T>(T) {
    with_op<Desc>(rep.cfg.op, [&](auto op) {
      ranks.run([&](Comm& comm, Board& board) { run_rank<Desc, T, decltype(op)>(comm, board, rep); });
    });
  });
  if (!printer) return 0;
  for (const Table& t : rep.tables) print_table<Desc>(t, rep.cfg);
  print_summary<Desc>(rep);
  if (!rep.cfg.json_path.empty()) write_json<Desc>(rep);
  const long long wrong = total_wrong(rep);
  if (wrong > 0) std::printf("# FAILED: %lld wrong elements\n", wrong);
  return wrong > 0 ? 1 : 0;
}

/// Runs body, turning an exception into "tool: what" on stderr and status 2.
template <PerfCollective Desc, class Body>
int guarded(Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", std::string(Desc::name).c_str(), e.what());
    return 2;
  }
}

/// A tool's whole main: parse, run, report.
template <PerfCollective Desc>
int perf_main(int argc, char** argv) {
  return guarded<Desc>([&] { return run_benchmark<Desc>(parse_args<Desc>(argc, argv)); });
}

}  // namespace bench
