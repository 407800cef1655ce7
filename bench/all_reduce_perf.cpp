// all_reduce_perf: an nccl-tests style all-reduce benchmark over gradsync's
// in-process Threads backend. Run with -h for the options.
//
// Conventions (nccl-tests, doc/PERFORMANCE.md): GB = 1e9 bytes, algbw = bytes
// per rank / time, busbw = algbw * 2(N-1)/N. The time of one size is the
// per-call mean over back-to-back calls, the maximum over ranks of it, and
// the median of that over repeats.

#include <gradsync/gradsync.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using Comm = gradsync::Communicator<gradsync::Threads>;
using Clock = std::chrono::steady_clock;

constexpr std::string_view usage_text = R"(usage: all_reduce_perf [options]
  -b BYTES   smallest size (default 8); K, M, G suffixes are powers of 1024
  -e BYTES   largest size (default 64M)
  -f FACTOR  size multiplication factor, an integer >= 2 (default 2)
  -n ITERS   timed calls per repeat (default 0: auto, about 0.2 s per size
             and placement over all repeats, at least 3, at most 100000)
  -w ITERS   warm-up calls per size and placement (default 5)
  -r REPEATS repeats; the reported time is their median (default 5)
  -c 0|1     check every rank's result against the exact one (default 1)
  -d TYPE    float, double, int32, int64, bfloat16 or float16 (default float)
  -o OP      sum, avg, min, max or prod (default sum)
  -t RANKS   in-process ranks (default 2)
  --algo A   ring, tree, rhd, native, auto or all (default auto)
  -J FILE    also write every figure, with p50 and p99 over repeats, as JSON
  -h         show this text
Exits with status 1 if any result was wrong, 2 on a usage or run error.
)";

constexpr double time_budget_s = 0.2;  // per size and placement, with -n 0
constexpr int min_auto_iters = 3;
constexpr int max_auto_iters = 100000;

// ---------------------------------------------------------------- options

struct Config {
  std::size_t min_bytes = 8;
  std::size_t max_bytes = std::size_t{64} << 20;
  std::size_t factor = 2;
  int iters = 0;
  int warmup = 5;
  int repeats = 5;
  bool check = true;
  std::string type = "float";
  std::string op = "sum";
  int ranks = 2;
  std::vector<std::string> algorithms{"auto"};
  std::string json_path;
};

const std::vector<std::string> type_names{"float", "double", "int32", "int64", "bfloat16", "float16"};
const std::vector<std::string> op_names{"sum", "avg", "min", "max", "prod"};
const std::vector<std::string> all_algorithm_names{"ring", "tree", "rhd", "native", "auto"};

[[noreturn]] void usage_error(const std::string& what) {
  throw std::invalid_argument(what + " (run with -h for usage)");
}

long long parse_int(std::string_view flag, const std::string& text, long long lo, long long hi) {
  std::size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    usage_error(std::string(flag) + " expects an integer, got '" + text + "'");
  }
  if (used != text.size() || v < lo || v > hi) {
    usage_error(std::string(flag) + " expects an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                "], got '" + text + "'");
  }
  return v;
}

/// "64M" -> 67108864: an integer with an optional binary K, M or G suffix.
std::size_t parse_bytes(std::string_view flag, std::string text) {
  int shift = 0;
  if (!text.empty()) {
    switch (text.back()) {
      case 'K': case 'k': shift = 10; break;
      case 'M': case 'm': shift = 20; break;
      case 'G': case 'g': shift = 30; break;
      default: break;
    }
    if (shift) text.pop_back();
  }
  const long long v = parse_int(flag, text, 0, (1LL << 40) >> shift);
  return static_cast<std::size_t>(v) << shift;
}

std::string pick(std::string_view flag, const std::string& value, const std::vector<std::string>& allowed) {
  if (std::find(allowed.begin(), allowed.end(), value) == allowed.end()) {
    std::string list;
    for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
    usage_error(std::string(flag) + " expects one of " + list + ", got '" + value + "'");
  }
  return value;
}

Config parse_args(int argc, char** argv) {
  Config cfg;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") {
      std::fputs(usage_text.data(), stdout);
      std::exit(0);
    }
    if (i + 1 >= argc) usage_error("unknown option or missing value: " + flag);
    const std::string value = argv[++i];
    if (flag == "-b") cfg.min_bytes = parse_bytes(flag, value);
    else if (flag == "-e") cfg.max_bytes = parse_bytes(flag, value);
    else if (flag == "-f") cfg.factor = static_cast<std::size_t>(parse_int(flag, value, 2, 1 << 20));
    else if (flag == "-n") cfg.iters = static_cast<int>(parse_int(flag, value, 0, 1 << 30));
    else if (flag == "-w") cfg.warmup = static_cast<int>(parse_int(flag, value, 0, 1 << 30));
    else if (flag == "-r") cfg.repeats = static_cast<int>(parse_int(flag, value, 1, 1000));
    else if (flag == "-c") cfg.check = parse_int(flag, value, 0, 1) != 0;
    else if (flag == "-d") cfg.type = pick(flag, value, type_names);
    else if (flag == "-o") cfg.op = pick(flag, value, op_names);
    else if (flag == "-t") cfg.ranks = static_cast<int>(parse_int(flag, value, 1, 1024));
    else if (flag == "-J") cfg.json_path = value;
    else if (flag == "--algo") {
      std::vector<std::string> choices = all_algorithm_names;
      choices.push_back("all");
      const std::string a = pick(flag, value, choices);
      cfg.algorithms = a == "all" ? all_algorithm_names : std::vector<std::string>{a};
    } else {
      usage_error("unknown option " + flag);
    }
  }
  if (cfg.min_bytes > cfg.max_bytes) usage_error("-b must not exceed -e");
  return cfg;
}

/// The sizes swept: min, min*f, ... up to max.
std::vector<std::size_t> sizes(const Config& cfg) {
  std::vector<std::size_t> out;
  for (std::size_t b = cfg.min_bytes; b <= cfg.max_bytes; b = std::max<std::size_t>(b * cfg.factor, 1)) {
    out.push_back(b);
  }
  return out;
}

double busbw_factor(int n) { return 2.0 * (n - 1) / n; }

// ------------------------------------------------------------ statistics

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<std::size_t>(pos);
  const std::size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

double gb_per_s(std::size_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0;
}

/// Where the copied buffer escapes to, so that the copy cannot be elided.
char* volatile memcpy_sink = nullptr;

/// Single-thread memcpy bandwidth on 64 MiB, best of 5, counting the bytes
/// read plus the bytes written: the ceiling any shared-memory copy can reach.
double memcpy_gb_per_s() {
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
  std::size_t bytes = 0;
  std::size_t count = 0;
  Timing out_of_place, in_place;
  double predicted = 0;            // explain()'s prediction for this algorithm
  std::string auto_pick;           // what Auto would run at this size
};

struct Table {
  std::string algorithm;
  std::vector<Row> rows;
  /// The footer's figure: mean out-of-place busbw over all sizes.
  double avg_busbw(double factor) const {
    double sum = 0;
    for (const Row& r : rows) sum += gb_per_s(r.bytes, r.out_of_place.seconds) * factor;
    return rows.empty() ? 0 : sum / static_cast<double>(rows.size());
  }
};

struct Report {
  Config cfg;
  double memcpy_gbps = 0;
  std::vector<Table> tables;  // in cfg.algorithms order
};

/// Hands a number from every rank to every rank, without going through the
/// all-reduce under test: the ranks share memory, and the barriers order each
/// write before the reads, and the reads before the next write.
class Board {
 public:
  explicit Board(int ranks) : slots_(static_cast<std::size_t>(ranks)) {}
  std::vector<double> gather(Comm& comm, double mine) {
    slots_[static_cast<std::size_t>(comm.rank())] = mine;
    comm.barrier();
    std::vector<double> all = slots_;
    comm.barrier();
    return all;
  }
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

// ------------------------------------------------------------- test data

/// Small integers in [-3, 3], varying with rank and index (hashed, so a block
/// landing at the wrong offset shows), such that sums over a few ranks are
/// exact in every type, bfloat16 included (|sum| <= 3N <= 256 for N <= 85).
int pattern(int rank, std::size_t i) {
  const auto h = static_cast<std::uint32_t>(i) * 2654435761u;
  return static_cast<int>(((h >> 13) + 3u * static_cast<std::uint32_t>(rank)) % 7u) - 3;
}

/// Rank `rank`'s input at index i; products stay exact with inputs of +-1.
template <class Op>
int input_value(int rank, std::size_t i) {
  const int v = pattern(rank, i);
  if constexpr (std::is_same_v<Op, gradsync::Prod>) return v < 0 ? -1 : 1;
  return v;
}

/// 16-bit floats: stored as such, computed in float.
template <class T>
constexpr bool is_half = std::is_same_v<T, gradsync::bfloat16> || std::is_same_v<T, gradsync::float16>;

template <class T>
T from_int(long long v) {
  if constexpr (is_half<T>) return T(static_cast<float>(v));
  else return static_cast<T>(v);
}

/// The exact result at index i, written from the ops' definitions rather than
/// with the library's code. Avg is the sum divided by N in T's arithmetic
/// (truncating for integers; for 16-bit floats in float, then rounded).
template <class T, class Op>
T expected_value(int ranks, std::size_t i) {
  long long acc = input_value<Op>(0, i);
  for (int r = 1; r < ranks; ++r) {
    const long long v = input_value<Op>(r, i);
    if constexpr (std::is_same_v<Op, gradsync::Min>) acc = std::min(acc, v);
    else if constexpr (std::is_same_v<Op, gradsync::Max>) acc = std::max(acc, v);
    else if constexpr (std::is_same_v<Op, gradsync::Prod>) acc *= v;
    else acc += v;
  }
  if constexpr (std::is_same_v<Op, gradsync::Avg>) {
    if constexpr (is_half<T>) {
      return T(static_cast<float>(acc) / static_cast<float>(ranks));
    } else {
      return static_cast<T>(from_int<T>(acc) / static_cast<T>(ranks));
    }
  }
  return from_int<T>(acc);
}

template <class T, class Op>
void fill_input(std::span<T> x, int rank) {
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = from_int<T>(input_value<Op>(rank, i));
}

template <class T>
long long count_differences(std::span<const T> got, std::span<const T> want) {
  long long n = 0;
  for (std::size_t i = 0; i < got.size(); ++i) n += !(got[i] == want[i]);
  return n;
}

/// One rank's buffers, allocated once at the largest size and reused for
/// every size: the first touch of fresh memory is far slower than the
/// collective itself. value-initialisation touches every page up front.
template <class T>
struct Buffers {
  explicit Buffers(std::size_t max_count) : send(max_count), recv(max_count), expected(max_count) {}
  std::vector<T> send, recv, expected;
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

/// Checks one call on pattern data; returns the wrong elements summed over
/// ranks. Out of place, a changed input element counts as wrong too.
template <class Algo, class T, class Op>
long long check_once(Comm& comm, Board& board, Buffers<T>& buf, std::size_t count, bool in_place) {
  const std::span<T> send(buf.send.data(), count), recv(buf.recv.data(), count);
  const std::span<const T> want(buf.expected.data(), count);
  long long wrong = 0;
  if (in_place) {
    fill_input<T, Op>(recv, comm.rank());
    gradsync::AllReduce<Algo>{}(comm, recv, Op{});
  } else {
    fill_input<T, Op>(send, comm.rank());
    std::fill(recv.begin(), recv.end(), from_int<T>(101));  // shows unwritten output
    gradsync::AllReduce<Algo>{}(comm, std::span<const T>(send), recv, Op{});
    for (std::size_t i = 0; i < count; ++i) wrong += !(send[i] == from_int<T>(input_value<Op>(comm.rank(), i)));
  }
  wrong += count_differences<T>(recv, want);
  return static_cast<long long>(board.sum(comm, static_cast<double>(wrong)));
}

template <class Algo, class T, class Op>
Timing measure(Comm& comm, Board& board, const Config& cfg, Buffers<T>& buf, std::size_t count, bool in_place) {
  const long long wrong = cfg.check ? check_once<Algo, T, Op>(comm, board, buf, count, in_place) : -1;
  const std::span<T> send(buf.send.data(), count), recv(buf.recv.data(), count);
  Timing t;
  if (in_place) {
    // Zeros: repeated in-place sums of real data would overflow (undefined
    // for signed integers, inf and NaN for floats) and skew the timing.
    std::fill(recv.begin(), recv.end(), from_int<T>(0));
    t = time_calls(comm, board, cfg, [&] { gradsync::AllReduce<Algo>{}(comm, recv, Op{}); });
  } else {
    fill_input<T, Op>(send, comm.rank());
    t = time_calls(comm, board, cfg,
                   [&] { gradsync::AllReduce<Algo>{}(comm, std::span<const T>(send), recv, Op{}); });
  }
  t.wrong = wrong;
  return t;
}

using Algorithms = std::tuple<gradsync::Ring, gradsync::Tree, gradsync::RecursiveHalvingDoubling, gradsync::Native,
                              gradsync::Auto>;

/// The cost model's prediction for `algo` at `bytes`; for auto, its pick's.
double predicted_seconds(const gradsync::Explanation& e, std::string_view algo) {
  const std::string_view name = algo == "auto" ? e.chosen : algo;
  for (const auto& c : e.candidates)
    if (c.algorithm == name) return c.seconds;
  return NAN;
}

/// Every rank runs this. Sizes are the outer loop and algorithms the inner
/// one, so that all algorithms see the machine in the same state at each
/// size: on a noisy machine that matters more than streaming the output.
template <class T, class Op>
void run_rank(Comm& comm, Board& board, Report& report) {
  const Config& cfg = report.cfg;
  const auto swept = sizes(cfg);
  Buffers<T> buf(swept.back() / sizeof(T));
  for (const std::size_t requested : swept) {
    Row row;
    row.count = requested / sizeof(T);
    row.bytes = row.count * sizeof(T);
    if (cfg.check) {
      for (std::size_t i = 0; i < row.count; ++i) buf.expected[i] = expected_value<T, Op>(comm.size(), i);
    }
    const gradsync::Explanation e = gradsync::explain(comm, gradsync::Collective::all_reduce, row.bytes);
    row.auto_pick = e.chosen;
    std::apply(
        [&](auto... algos) {
          auto one = [&](auto algo) {
            using Algo = decltype(algo);
            const auto& wanted = cfg.algorithms;
            const auto table = std::find(wanted.begin(), wanted.end(), Algo::name);
            if (table == wanted.end()) return;
            Row r = row;
            r.out_of_place = measure<Algo, T, Op>(comm, board, cfg, buf, r.count, false);
            r.in_place = measure<Algo, T, Op>(comm, board, cfg, buf, r.count, true);
            r.predicted = predicted_seconds(e, Algo::name);
            if (comm.rank() == 0) report.tables[static_cast<std::size_t>(table - wanted.begin())].rows.push_back(r);
          };
          (one(algos), ...);
        },
        Algorithms{});
  }
}

// ---------------------------------------------------------------- output

std::string format_time_us(double seconds) {
  const double us = seconds * 1e6;
  char text[32];
  std::snprintf(text, sizeof text, us < 1e4 ? "%8.2f" : "%8.0f", us);
  return text;
}

std::string format_side(const Timing& t, std::size_t bytes, double factor) {
  const double algbw = gb_per_s(bytes, t.seconds);
  char text[96];
  std::snprintf(text, sizeof text, "%s  %6.2f  %6.2f  %6s", format_time_us(t.seconds).c_str(), algbw,
                algbw * factor, t.wrong < 0 ? "N/A" : std::to_string(t.wrong).c_str());
  return text;
}

void print_header(const Report& rep) {
  const Config& cfg = rep.cfg;
  const int n = cfg.ranks;
  std::printf("# memcpy bandwidth: %.2f GB/s (read+write)\n", rep.memcpy_gbps);
  std::printf("# gradsync all_reduce_perf: world size %d (Threads backend, one thread per rank)\n", n);
  std::string algorithms;
  for (const auto& a : cfg.algorithms) algorithms += " " + a;
  std::printf("# algorithm:%s\n", algorithms.c_str());
  std::printf("# type %s, op %s, sizes %zu to %zu bytes, factor %zu\n", cfg.type.c_str(), cfg.op.c_str(),
              cfg.min_bytes, cfg.max_bytes, cfg.factor);
  std::printf("# busbw factor 2(N-1)/N = %.4f\n", busbw_factor(n));
  std::printf("# time: per-call mean of back-to-back calls, MAX over ranks, median of %d repeats;", cfg.repeats);
  if (cfg.iters) std::printf(" %d calls per repeat;", cfg.iters);
  else std::printf(" calls per repeat auto (~%.1f s per size and placement);", time_budget_s);
  std::printf(" %d warm-up calls\n", cfg.warmup);
  std::printf("# check: %s\n", cfg.check ? "on (#wrong = elements not exactly as expected, summed over ranks)" : "off");
  std::printf("# GB = 1e9 bytes; predicted = gradsync::explain() for the algorithm measured (auto: its pick)\n");
}

void print_table(const Table& t, const Config& cfg) {
  const double factor = busbw_factor(cfg.ranks);
  std::printf("#\n# algorithm: %s\n", t.algorithm.c_str());
  std::printf("#%67s%38s\n", "out-of-place", "in-place");
  std::printf("#%11s  %12s  %8s  %6s  %6s  %8s  %6s  %6s  %6s  %8s  %6s  %6s  %6s  %9s\n", "size", "count", "type",
              "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong", "predicted");
  std::printf("#%11s  %12s  %8s  %6s  %6s  %8s  %6s  %6s  %6s  %8s  %6s  %6s  %6s  %9s\n", "(B)", "(elements)", "",
              "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)");
  for (const Row& r : t.rows) {
    std::printf("%12zu  %12zu  %8s  %6s  %6d  %s  %s  %9s\n", r.bytes, r.count, cfg.type.c_str(), cfg.op.c_str(), -1,
                format_side(r.out_of_place, r.bytes, factor).c_str(), format_side(r.in_place, r.bytes, factor).c_str(),
                format_time_us(r.predicted).c_str());
  }
  std::printf("# Avg bus bandwidth    : %g\n", t.avg_busbw(factor));
}

/// With several algorithms: the fastest measured one at each size (out of
/// place), next to what Auto would pick and how Auto's own time compares.
void print_summary(const Report& rep) {
  const Table* auto_table = nullptr;
  std::vector<const Table*> fixed;
  for (const Table& t : rep.tables) {
    if (t.algorithm == "auto") auto_table = &t;
    else fixed.push_back(&t);
  }
  if (fixed.size() + (auto_table != nullptr) < 2) return;
  std::printf("#\n# Summary: winner at each size (out-of-place time in us; auto/best = Auto's time / winner's)\n");
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
      std::printf("  %s", format_time_us(t->rows[i].out_of_place.seconds).c_str());
      if (!best || t->rows[i].out_of_place.seconds < best->rows[i].out_of_place.seconds) best = t;
    }
    if (auto_table) std::printf("  %s", format_time_us(auto_table->rows[i].out_of_place.seconds).c_str());
    std::printf("  %7s  %9s", best ? best->algorithm.c_str() : "-", first.auto_pick.c_str());
    if (auto_table && best) {
      std::printf("  %9.2f", auto_table->rows[i].out_of_place.seconds / best->rows[i].out_of_place.seconds);
    }
    std::printf("\n");
  }
}

// ------------------------------------------------------------------ JSON

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char text[32];
  std::snprintf(text, sizeof text, "%.6g", v);
  return text;
}

std::string json_string(std::string_view s) { return "\"" + std::string(s) + "\""; }  // names only: no escapes needed

std::string json_timing(const Timing& t, std::size_t bytes, double factor) {
  std::string repeats;
  for (double s : t.repeats) repeats += (repeats.empty() ? "" : ", ") + json_number(s * 1e6);
  const double algbw = gb_per_s(bytes, t.seconds);
  return "{\"time_us\": " + json_number(t.seconds * 1e6) + ", \"algbw_GBps\": " + json_number(algbw) +
         ", \"busbw_GBps\": " + json_number(algbw * factor) +
         ", \"wrong\": " + (t.wrong < 0 ? "null" : std::to_string(t.wrong)) + ", \"iters\": " + std::to_string(t.iters) +
         ", \"p50_us\": " + json_number(percentile(t.repeats, 0.5) * 1e6) +
         ", \"p99_us\": " + json_number(percentile(t.repeats, 0.99) * 1e6) + ", \"repeats_us\": [" + repeats + "]}";
}

void write_json(const Report& rep) {
  const Config& cfg = rep.cfg;
  const double factor = busbw_factor(cfg.ranks);
  std::ofstream out(cfg.json_path);
  if (!out) throw std::runtime_error("cannot write " + cfg.json_path);
  out << "{\n  \"benchmark\": \"all_reduce_perf\", \"backend\": \"threads\", \"world_size\": " << cfg.ranks
      << ", \"type\": " << json_string(cfg.type) << ", \"op\": " << json_string(cfg.op)
      << ", \"busbw_factor\": " << json_number(factor) << ",\n  \"time\": "
      << json_string("per-call mean of back-to-back calls, max over ranks, median over repeats")
      << ", \"repeats\": " << cfg.repeats << ", \"warmup\": " << cfg.warmup
      << ", \"memcpy_GBps\": " << json_number(rep.memcpy_gbps) << ",\n  \"tables\": [";
  for (std::size_t k = 0; k < rep.tables.size(); ++k) {
    const Table& t = rep.tables[k];
    out << (k ? "," : "") << "\n    {\"algorithm\": " << json_string(t.algorithm)
        << ", \"avg_busbw_GBps\": " << json_number(t.avg_busbw(factor)) << ", \"rows\": [";
    for (std::size_t i = 0; i < t.rows.size(); ++i) {
      const Row& r = t.rows[i];
      out << (i ? "," : "") << "\n      {\"size\": " << r.bytes << ", \"count\": " << r.count
          << ", \"predicted_us\": " << json_number(r.predicted * 1e6) << ", \"auto_pick\": " << json_string(r.auto_pick)
          << ",\n       \"out_of_place\": " << json_timing(r.out_of_place, r.bytes, factor)
          << ",\n       \"in_place\": " << json_timing(r.in_place, r.bytes, factor) << "}";
    }
    out << "\n    ]}";
  }
  out << "\n  ]\n}\n";
}

// ------------------------------------------------------------- dispatch

template <class F>
void with_type(const std::string& name, F&& f) {
  if (name == "float") f(std::type_identity<float>{});
  else if (name == "double") f(std::type_identity<double>{});
  else if (name == "int32") f(std::type_identity<std::int32_t>{});
  else if (name == "int64") f(std::type_identity<std::int64_t>{});
  else if (name == "bfloat16") f(std::type_identity<gradsync::bfloat16>{});
  else f(std::type_identity<gradsync::float16>{});
}

template <class F>
void with_op(const std::string& name, F&& f) {
  if (name == "sum") f(gradsync::Sum{});
  else if (name == "avg") f(gradsync::Avg{});
  else if (name == "min") f(gradsync::Min{});
  else if (name == "max") f(gradsync::Max{});
  else f(gradsync::Prod{});
}

long long total_wrong(const Report& rep) {
  long long n = 0;
  for (const Table& t : rep.tables)
    for (const Row& r : t.rows) n += std::max(0LL, r.out_of_place.wrong) + std::max(0LL, r.in_place.wrong);
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Report rep;
    rep.cfg = parse_args(argc, argv);
    for (const auto& a : rep.cfg.algorithms) rep.tables.push_back(Table{a, {}});
    rep.memcpy_gbps = memcpy_gb_per_s();
    print_header(rep);
    std::fflush(stdout);
    with_type(rep.cfg.type, [&](auto type) {
      using T = typename decltype(type)::type;
      with_op(rep.cfg.op, [&](auto op) {
        Board board(rep.cfg.ranks);
        gradsync::run_threads(rep.cfg.ranks, [&](Comm& comm) { run_rank<T, decltype(op)>(comm, board, rep); });
      });
    });
    for (const Table& t : rep.tables) print_table(t, rep.cfg);
    print_summary(rep);
    if (!rep.cfg.json_path.empty()) write_json(rep);
    const long long wrong = total_wrong(rep);
    if (wrong > 0) std::printf("# FAILED: %lld wrong elements\n", wrong);
    return wrong > 0 ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "all_reduce_perf: %s\n", e.what());
    return 2;
  }
}
