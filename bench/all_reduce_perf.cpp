// all_reduce_perf: an nccl-tests style all-reduce benchmark over gradsync's
// in-process Threads backend, or, built with -DGRADSYNC_BENCH_MPI (the
// all_reduce_perf_mpi target), over the Mpi backend under mpirun. Run with -h
// for the options. Besides timing, it fits the cost model (--calibrate) and
// predicts without communicating (--model).
//
// Conventions (nccl-tests, doc/PERFORMANCE.md): GB = 1e9 bytes, size = the
// buffer each rank holds, algbw = size / time, busbw = algbw * 2(N-1)/N. The
// driver (perf/driver.hpp) is shared with the other *_perf tools.

#include "perf/driver.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <fstream>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace {

using bench::Board;
using bench::Clock;
using bench::Comm;
using bench::Config;
using bench::Shape;

/// All-reduce: every rank ends with op over all ranks' buffers. size = count
/// elements = the buffer of each rank.
struct AllReducePerf : bench::PerfDefaults<gradsync::Collective::all_reduce> {
  static constexpr bool reduces = true;
  static constexpr bool model_modes = true;
  static constexpr std::string_view busbw_formula = "2(N-1)/N";

  static double busbw_factor(int n) { return 2.0 * (n - 1) / n; }

  template <class T, class Op>
  static void expect(const Shape& s, std::span<T> out) {
    bench::fill_expected<T, Op>(s.ranks, 0, out);
  }
  /// Timed in place, zeros: repeated in-place sums of real data would
  /// overflow (undefined for signed integers, inf and NaN for floats) and
  /// skew the timing.
  template <class T, class Op>
  static void fill_in_place(const Shape& s, std::span<T> buf, bool timing) {
    for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = timing ? bench::from_int<T>(0) : input<T, Op>(s, i);
  }
  template <class Algo, class T, class Op>
  static void run(Comm& comm, const Shape&, std::span<const T> send, std::span<T> recv, bool in_place) {
    if (in_place) gradsync::AllReduce<Algo>{}(comm, recv, Op{});
    else gradsync::AllReduce<Algo>{}(comm, send, recv, Op{});
  }
};

using bench::Backend;
using bench::backend_name;
using bench::format_time_us;
using bench::gb_per_s;
using bench::json_number;
using bench::json_string;
using bench::sizes;
using bench::time_calls;

double busbw_factor(int n) { return AllReducePerf::busbw_factor(n); }

// ------------------------------------------------------------ calibrate

/// The fitted constants and the measurements they came from.
struct Fit {
  gradsync::CostModel model;
  double small_ring_s = 0, big_ring_s = 0, reduce_s = 0, native_s = 0, big_native_s = 0;
  std::size_t big_bytes = 0;
};

/// Every rank: fits alpha, beta, gamma and native_alpha for this backend at
/// this world size, by inverting the model's own formulas (core/cost_model.hpp):
/// - alpha: an 8-byte Ring all-reduce is 2(p-1) messages of ~nothing, so
///   alpha = t / (2(p-1)) (at 2 ranks: half of a ping-pong round trip);
/// - gamma: reduce_into<Sum> of 64 MiB of floats on every rank at once, per byte;
/// - beta: a 64 MiB Ring all-reduce, less its alpha and gamma terms, per
///   byte moved (2(p-1)/p·n);
/// - native_alpha: an 8-byte Native all-reduce / (2·ceil(log2 p));
/// - native_beta: a 64 MiB Native all-reduce, less its sync and gamma
///   terms, per byte (Native is the backend's own code: MPI's or NCCL's
///   algorithms, or the Threads shared-memory path).
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
    fit.big_native_s = time_calls(comm, board, cfg, [&] {
                         gradsync::AllReduce<gradsync::Native>{}(comm, std::span<float>(acc), gradsync::Sum{});
                       }).seconds;
    const double rest = fit.big_native_s - 2.0 * m.native_alpha * gradsync::detail::ceil_log2(p) - frac * n * m.gamma;
    m.native_beta = (rest > 0.1 * fit.big_native_s ? rest : fit.big_native_s) / n;
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
  std::printf("# Native all-reduce %zu B %10.1f us -> native_beta = (t - sync, gamma terms)/n\n", f.big_bytes,
              f.big_native_s * 1e6);
  std::printf("# use: export the line below, then rerun all_reduce_perf --algo all to see predicted vs measured\n");
  std::printf("GRADSYNC_COST_MODEL=alpha=%.4g,beta=%.4g,gamma=%.4g,native_alpha=%.4g,native_beta=%.4g\n", f.model.alpha,
              f.model.beta, f.model.gamma, f.model.native_alpha, f.model.native_beta);
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


}  // namespace

int main(int argc, char** argv) {
  return bench::guarded<AllReducePerf>([&] {
    Config cfg = bench::parse_args<AllReducePerf>(argc, argv);
    if (cfg.model) {
      run_model(cfg);
      return 0;
    }
    if (!cfg.calibrate) return bench::run_benchmark<AllReducePerf>(cfg);
    bench::Ranks ranks(cfg);
    Fit fit;
    ranks.run([&](Comm& comm, Board& board) {
      Fit f = calibrate_rank(comm, board, cfg);
      if (comm.rank() == 0) fit = f;
    });
    if (ranks.printer()) print_fit(fit, cfg.ranks);
    return 0;
  });
}
