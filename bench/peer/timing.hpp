#pragma once
/// \file What the all-reduce peers of bench/compare.py (mpi_allreduce_peer,
/// gloo_allreduce_peer) share: their arguments, how one size is timed (the
/// way all_reduce_perf times gradsync) and the line rank 0 prints.
/// Standard library only: each peer links its own transport and no gradsync.

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace bench::peer {

struct Args {
  int repeats = 5;
  int warmup = 5;
  std::vector<std::size_t> sizes;  ///< bytes

  std::size_t max_bytes() const { return sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end()); }
};

/// A whole size in bytes, with an optional K, M or G (binary, either case)
/// suffix, as bench/compare.py writes them; anything else ends the program.
inline std::size_t parse_bytes(const std::string& s) {
  char* end = nullptr;
  std::size_t v = static_cast<std::size_t>(std::strtoull(s.c_str(), &end, 10));
  const std::string suffix = end ? end : "";
  if (end == s.c_str() || suffix.size() > 1 || (suffix.size() == 1 && !std::strchr("KkMmGg", suffix[0]))) {
    std::fprintf(stderr, "not a size in bytes: '%s' (a whole number, then K, M or G if you like)\n", s.c_str());
    std::exit(2);
  }
  if (!suffix.empty()) v <<= suffix[0] == 'K' || suffix[0] == 'k' ? 10 : suffix[0] == 'M' || suffix[0] == 'm' ? 20 : 30;
  return v;
}

/// `[-r REPEATS] [-w WARMUP] BYTES...`, from argv[first] on.
inline Args parse_args(int argc, char** argv, int first) {
  Args a;
  for (int i = first; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "-r" && i + 1 < argc) a.repeats = std::max(1, std::atoi(argv[++i]));
    else if (s == "-w" && i + 1 < argc) a.warmup = std::max(0, std::atoi(argv[++i]));
    else a.sizes.push_back(parse_bytes(s));
  }
  return a;
}

/// Floats in a message of `bytes` (at least one).
inline int float_count(std::size_t bytes) { return static_cast<int>(std::max<std::size_t>(bytes / sizeof(float), 1)); }

/// Seconds per call: `batch(n)` runs n calls back to back and returns the
/// per-call mean, maximum over ranks. n grows until a batch takes 10 ms, then
/// each repeat runs enough calls to fill about 0.2 s over all repeats; the
/// result is the median over repeats.
template <class Batch>
double median_per_call(Batch&& batch, int repeats) {
  double per_call = 0;
  for (int n = 1;; n *= 2) {
    per_call = batch(n);
    if (per_call * n >= 0.01 || n >= 100000) break;
  }
  const int iters = static_cast<int>(std::clamp(0.2 / repeats / std::max(per_call, 1e-9), 3.0, 100000.0));
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) t.push_back(batch(iters));
  std::sort(t.begin(), t.end());
  return t.size() % 2 ? t[t.size() / 2] : (t[t.size() / 2 - 1] + t[t.size() / 2]) / 2;
}

/// Whether the first `count` values of an all-reduce's result are all
/// `expected`; if not, says on stderr which element is not, so that a peer
/// whose timed calls moved nothing (or the wrong data) is not reported as fast.
inline bool check_result(const char* peer, const float* v, int count, float expected, int rank) {
  for (int i = 0; i < count; ++i) {
    if (v[i] != expected) {
      std::fprintf(stderr, "%s: rank %d: element %d of %d is %g after the all-reduce, expected %g\n", peer, rank, i,
                   count, static_cast<double>(v[i]), static_cast<double>(expected));
      return false;
    }
  }
  return true;
}

/// Rank 0's line for one size: <bytes> <time_us> <busbw_GBps>, busbw with
/// all-reduce's factor 2(N-1)/N.
inline void print_row(int count, double seconds, int world) {
  const double b = static_cast<double>(count) * sizeof(float);
  std::printf("%zu %.3f %.4f\n", static_cast<std::size_t>(b), seconds * 1e6, b / seconds / 1e9 * 2.0 * (world - 1) / world);
  std::fflush(stdout);
}

}  // namespace bench::peer
