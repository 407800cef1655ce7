// all_reduce_perf: an nccl-tests style all-reduce benchmark over gradsync's
// in-process Threads backend, or, built with -DGRADSYNC_BENCH_MPI (the
// all_reduce_perf_mpi target), over the Mpi backend under mpirun. Run with -h
// for the options. Besides timing, it fits the cost model (--calibrate) and
// predicts without communicating (--model).
//
// Conventions (nccl-tests, doc/PERFORMANCE.md): GB = 1e9 bytes, algbw = bytes
// per rank / time, busbw = algbw * 2(N-1)/N. The time of one size is the
// per-call mean over back-to-back calls, the maximum over ranks of it, and
// the median of that over repeats.

#include <gradsync/gradsync.hpp>
#ifdef GRADSYNC_BENCH_MPI
#include <gradsync/backend/mpi.hpp>
#endif

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

#ifdef GRADSYNC_BENCH_MPI
using Backend = gradsync::Mpi;
constexpr std::string_view backend_name = "mpi";
#else
using Backend = gradsync::Threads;
constexpr std::string_view backend_name = "threads";
#endif
using Comm = gradsync::Communicator<Backend>;
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
  -t RANKS   in-process ranks (default 2; threads backend only)
  --backend B  threads (all_reduce_perf) or mpi (all_reduce_perf_mpi, run under
             mpirun; the world size is mpirun's -np). Default: the one built in
  --algo A   ring, tree, rhd, native, auto or all (default auto)
  -J FILE    also write every figure, with p50 and p99 over repeats, as JSON
  --calibrate  fit the cost model on this backend and world size (>= 2 ranks)
             and print GRADSYNC_COST_MODEL=... in the format Auto reads
  --model    predict only, no communication: time per algorithm per size
             (-b -e -f) and the winner, for each world size in --ranks
  --ranks LIST       comma-separated world sizes for --model (default 8,64,512,4096)
  --alpha S --beta S --gamma S --native-alpha S   link figures for --model
             (seconds per message, per byte moved, per byte reduced, per Native
             synchronisation; native-alpha 0 = no Native)
  --preset P nvlink or infiniband: published link figures for --model
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
  bool ranks_given = false;
  bool calibrate = false;
  bool model = false;
  std::vector<int> model_ranks{8, 64, 512, 4096};
  std::string preset;
  gradsync::CostModel link;  // --model's figures; preset, then flags
  bool link_given = false;
};

/// Presets for --model, from published figures:
/// - nvlink: NVLink 4 (H100 SXM), 18 links x 25 GB/s = 450 GB/s per direction
///   per GPU (NVIDIA H100 Tensor Core GPU Architecture whitepaper, 2022);
///   NCCL's small-message all-reduce latency within an NVLink node is a few
///   microseconds (NCCL tuning model, src/graph/tuning.cc: ~0.6-5 us per step
///   for LL/Simple), so alpha = 3 us; gamma from HBM3 at 3.35 TB/s (reduce
///   reads two bytes and writes one: ~1e-12 s/B).
/// - infiniband: NDR 400 Gb/s = 50 GB/s per port per direction (NVIDIA
///   ConnectX-7 / Quantum-2 datasheets); MPI point-to-point latency over IB
///   is about 1-2 us (OSU micro-benchmarks, osu_latency), so alpha = 1.5 us;
///   gamma = host reduce at ~10 GB/s.
gradsync::CostModel preset_model(const std::string& name) {
  gradsync::CostModel m;
  if (name == "nvlink") {
    m.alpha = 3e-6;
    m.beta = 1.0 / 450e9;
    m.gamma = 1e-12;
  } else {
    m.alpha = 1.5e-6;
    m.beta = 1.0 / 50e9;
    m.gamma = 1e-10;
  }
  m.native_alpha = 0;
  return m;
}

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
    if (flag == "--calibrate") {
      cfg.calibrate = true;
      continue;
    }
    if (flag == "--model") {
      cfg.model = true;
      continue;
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
    else if (flag == "-t") {
      cfg.ranks = static_cast<int>(parse_int(flag, value, 1, 1024));
      cfg.ranks_given = true;
    } else if (flag == "--backend") {
      const std::string b = pick(flag, value, {"threads", "mpi", "nccl"});
      if (b != backend_name) {
        usage_error("--backend " + b + " is not built into this binary (it runs " + std::string(backend_name) +
                    (b == "mpi" ? "; use all_reduce_perf_mpi under mpirun" : b == "threads" ? "; use all_reduce_perf" : "; use nccl_all_reduce_perf") +
                    ")");
      }
    } else if (flag == "--ranks") {
      cfg.model_ranks.clear();
      std::size_t pos = 0;
      while (pos <= value.size()) {
        const std::size_t comma = std::min(value.find(',', pos), value.size());
        cfg.model_ranks.push_back(static_cast<int>(parse_int(flag, value.substr(pos, comma - pos), 1, 1 << 24)));
        pos = comma + 1;
      }
    } else if (flag == "--preset") {
      cfg.preset = pick(flag, value, {"nvlink", "infiniband"});
    } else if (flag == "--alpha" || flag == "--beta" || flag == "--gamma" || flag == "--native-alpha") {
      cfg.link = gradsync::detail::parse_cost_model(flag.substr(2) == "native-alpha" ? "native_alpha=" + value
                                                                                       : flag.substr(2) + "=" + value,
                                                    cfg.link);
      cfg.link_given = true;
    }
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
  if (cfg.model && !cfg.preset.empty()) {
    // The preset first, then any figure given explicitly on top of it.
    gradsync::CostModel m = preset_model(cfg.preset);
    const gradsync::CostModel defaults;
    if (cfg.link.alpha != defaults.alpha) m.alpha = cfg.link.alpha;
    if (cfg.link.beta != defaults.beta) m.beta = cfg.link.beta;
    if (cfg.link.gamma != defaults.gamma) m.gamma = cfg.link.gamma;
    if (cfg.link.native_alpha != defaults.native_alpha) m.native_alpha = cfg.link.native_alpha;
    cfg.link = m;
  } else if (cfg.model && !cfg.link_given) {
    usage_error("--model needs --preset or --alpha/--beta/--gamma");
  }
#ifdef GRADSYNC_BENCH_MPI
  if (cfg.ranks_given) usage_error("-t is for the threads backend; under mpi the world size is mpirun's -np");
#endif
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
  std::printf("# gradsync all_reduce_perf: world size %d (%s)\n", n,
              backend_name == "mpi" ? "Mpi backend, one MPI process per rank" : "Threads backend, one thread per rank");
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
  out << "{\n  \"benchmark\": \"all_reduce_perf\", \"backend\": " << json_string(backend_name) << ", \"world_size\": " << cfg.ranks
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

// ------------------------------------------------------------ calibrate

/// The fitted constants and the measurements they came from.
struct Fit {
  gradsync::CostModel model;
  double small_ring_s = 0, big_ring_s = 0, reduce_s = 0, native_s = 0;
  std::size_t big_bytes = 0;
};

/// Every rank: fits alpha, beta, gamma and native_alpha for this backend at
/// this world size, by inverting the model's own formulas (core/cost_model.hpp):
/// - alpha: an 8-byte Ring all-reduce is 2(p-1) messages of ~nothing, so
///   alpha = t / (2(p-1)) (at 2 ranks: half of a ping-pong round trip);
/// - gamma: reduce_into<Sum> of 64 MiB of floats on every rank at once, per byte;
/// - beta: a 64 MiB Ring all-reduce, less its alpha and gamma terms, per
///   byte moved (2(p-1)/p·n);
/// - native_alpha: an 8-byte Native all-reduce / (2·ceil(log2 p)).
Fit calibrate_rank(Comm& comm, Board& board, const Config& cfg) {
  const int p = comm.size();
  if (p < 2) throw std::invalid_argument("--calibrate needs at least 2 ranks");
  Fit fit;
  fit.model = gradsync::cost_model<Backend>();
  gradsync::CostModel& m = fit.model;
  std::vector<float> small(2, 0.0f);
  fit.small_ring_s =
      time_calls(comm, board, cfg, [&] { gradsync::AllReduce<gradsync::Ring>{}(comm, std::span<float>(small), gradsync::Sum{}); })
          .seconds;
  m.alpha = fit.small_ring_s / (2.0 * (p - 1));

  fit.big_bytes = std::size_t{64} << 20;
  const std::size_t count = fit.big_bytes / sizeof(float);
  std::vector<float> acc(count, 0.0f), src(count, 0.0f);  // zeros: in-place sums stay put
  double best = HUGE_VAL;
  for (int i = 0; i < 5; ++i) {
    board.max(comm, 0);  // start together, as in a collective
    const auto t0 = Clock::now();
    gradsync::detail::reduce_into<gradsync::Sum>(acc.data(), src.data(), count);
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  fit.reduce_s = board.max(comm, best);
  m.gamma = fit.reduce_s / static_cast<double>(fit.big_bytes);

  fit.big_ring_s =
      time_calls(comm, board, cfg, [&] { gradsync::AllReduce<gradsync::Ring>{}(comm, std::span<float>(acc), gradsync::Sum{}); })
          .seconds;
  const double n = static_cast<double>(fit.big_bytes);
  const double frac = static_cast<double>(p - 1) / p;
  const double k = gradsync::detail::chunks(n / p, m);
  const double moved = fit.big_ring_s - 2.0 * (p - 1) * k * m.alpha - frac * n * m.gamma;
  // When the reduce overlaps the transfer the remainder can vanish: then
  // charge the whole time to the bytes moved.
  m.beta = (moved > 0.1 * fit.big_ring_s ? moved : fit.big_ring_s) / (2.0 * frac * n);

  if constexpr (gradsync::detail::HasNative<Backend>) {
    fit.native_s = time_calls(comm, board, cfg, [&] {
                     gradsync::AllReduce<gradsync::Native>{}(comm, std::span<float>(small), gradsync::Sum{});
                   }).seconds;
    m.native_alpha = fit.native_s / (2.0 * gradsync::detail::ceil_log2(p));
  } else {
    m.native_alpha = 0;
  }
  return fit;
}

void print_fit(const Fit& f, int p) {
  std::printf("# gradsync calibrate: %s backend, world size %d\n", backend_name.data(), p);
  std::printf("# 8-byte Ring all-reduce     %10.3f us -> alpha = t/(2(p-1))\n", f.small_ring_s * 1e6);
  std::printf("# reduce_into<Sum> %zu B %10.1f us -> gamma = t/n (%.2f GB/s)\n", f.big_bytes, f.reduce_s * 1e6,
              static_cast<double>(f.big_bytes) / f.reduce_s / 1e9);
  std::printf("# Ring all-reduce %zu B  %10.1f us -> beta = (t - alpha, gamma terms)/(2(p-1)/p n) (%.2f GB/s)\n",
              f.big_bytes, f.big_ring_s * 1e6, 1.0 / f.model.beta / 1e9);
  std::printf("# 8-byte Native all-reduce   %10.3f us -> native_alpha = t/(2 ceil(lg p))\n", f.native_s * 1e6);
  std::printf("# use: export the line below, then rerun all_reduce_perf --algo all to see predicted vs measured\n");
  std::printf("GRADSYNC_COST_MODEL=alpha=%.4g,beta=%.4g,gamma=%.4g,native_alpha=%.4g\n", f.model.alpha, f.model.beta,
              f.model.gamma, f.model.native_alpha);
}

// ---------------------------------------------------------------- model

/// --model: the cost model's prediction per algorithm per size at each world
/// size in --ranks, and the winner. No communication.
void run_model(const Config& cfg) {
  const gradsync::CostModel& m = cfg.link;
  std::vector<std::string> algos{"ring", "tree", "rhd"};
  if (m.native_alpha > 0) algos.push_back("native");
  std::printf("# gradsync all_reduce_perf --model: predictions only, no communication\n");
  std::printf("# link: %s alpha=%g s, beta=%g s/B (%.1f GB/s), gamma=%g s/B, native_alpha=%g s, chunk %zu B\n",
              cfg.preset.empty() ? "(flags)" : cfg.preset.c_str(), m.alpha, m.beta, 1.0 / m.beta / 1e9, m.gamma,
              m.native_alpha, m.chunk_bytes);
  std::printf("GRADSYNC_COST_MODEL=alpha=%.4g,beta=%.4g,gamma=%.4g,native_alpha=%.4g\n", m.alpha, m.beta, m.gamma,
              m.native_alpha);
  std::string json = "{\n  \"benchmark\": \"all_reduce_model\", \"preset\": " + json_string(cfg.preset) +
                     ", \"alpha\": " + json_number(m.alpha) + ", \"beta\": " + json_number(m.beta) +
                     ", \"gamma\": " + json_number(m.gamma) + ", \"native_alpha\": " + json_number(m.native_alpha) +
                     ",\n  \"tables\": [";
  bool first_table = true;
  for (const int p : cfg.model_ranks) {
    std::printf("#\n# world size %d (busbw factor %.4f); predicted time per call (us)\n#%11s", p, busbw_factor(p),
                "size (B)");
    for (const auto& a : algos) std::printf("  %10s", a.c_str());
    std::printf("  %7s  %11s\n", "winner", "busbw(GB/s)");
    json += std::string(first_table ? "" : ",") + "\n    {\"world_size\": " + std::to_string(p) + ", \"rows\": [";
    first_table = false;
    bool first_row = true;
    for (const std::size_t bytes : sizes(cfg)) {
      std::printf("%12zu", bytes);
      std::string best;
      double best_t = HUGE_VAL;
      std::string row = std::string(first_row ? "" : ",") + "\n      {\"size\": " + std::to_string(bytes);
      first_row = false;
      for (const auto& a : algos) {
        const double t = gradsync::detail::predict(a, gradsync::Collective::all_reduce, p, static_cast<double>(bytes), m);
        std::printf("  %s  ", format_time_us(t).c_str());
        row += ", \"" + a + "_us\": " + json_number(t * 1e6);
        if (t < best_t) {
          best_t = t;
          best = a;
        }
      }
      const double busbw = gb_per_s(bytes, best_t) * busbw_factor(p);
      std::printf("  %7s  %11.2f\n", best.c_str(), busbw);
      json += row + ", \"winner\": " + json_string(best) + ", \"winner_busbw_GBps\": " + json_number(busbw) + "}";
    }
    json += "\n    ]}";
  }
  json += "\n  ]\n}\n";
  if (!cfg.json_path.empty()) {
    std::ofstream out(cfg.json_path);
    if (!out) throw std::runtime_error("cannot write " + cfg.json_path);
    out << json;
  }
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
    if (rep.cfg.model) {
      run_model(rep.cfg);
      return 0;
    }
    for (const auto& a : rep.cfg.algorithms) rep.tables.push_back(Table{a, {}});
    rep.memcpy_gbps = memcpy_gb_per_s();
#ifdef GRADSYNC_BENCH_MPI
    Comm world(MPI_COMM_WORLD);
    rep.cfg.ranks = world.size();
    const bool printer = world.rank() == 0;
    auto run_ranks = [&](auto&& body) {
      Board board(world.size());
      body(world, board);
    };
#else
    const bool printer = true;
    auto run_ranks = [&](auto&& body) {
      Board board(rep.cfg.ranks);
      gradsync::run_threads(rep.cfg.ranks, [&](Comm& comm) { body(comm, board); });
    };
#endif
    if (rep.cfg.calibrate) {
      Fit fit;
      run_ranks([&](Comm& comm, Board& board) {
        Fit f = calibrate_rank(comm, board, rep.cfg);
        if (comm.rank() == 0) fit = f;
      });
      if (printer) print_fit(fit, rep.cfg.ranks);
      return 0;
    }
    if (printer) print_header(rep);
    std::fflush(stdout);
    with_type(rep.cfg.type, [&](auto type) {
      using T = typename decltype(type)::type;
      with_op(rep.cfg.op, [&](auto op) {
        run_ranks([&](Comm& comm, Board& board) { run_rank<T, decltype(op)>(comm, board, rep); });
      });
    });
    if (!printer) return 0;
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
