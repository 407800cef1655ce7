// optim_step: one optimizer step on n float parameters against the memory
// bound, beside memcpy in the same run.
//
//   optim_step [--sizes 64K,1M,4M,16M,64M] [--repeats R] [--bound-bytes B] [--threads T]
//
// --threads T: each step shared by T threads (the options' `threads`); the
// bound stays one thread's, so "/bound" above 1 is what the threads add.
//
// An optimizer step on more parameters than the caches hold can go no faster
// than its traffic: the bytes it must read and write per parameter, at the
// machine's copy bandwidth. Counted per float parameter, in steady state:
//
//   Sgd plain               reads p, g;       writes p      12 B
//   Sgd momentum, nesterov  reads p, g, v;    writes p, v   20 B
//   Adam, AdamW             reads p, g, m, v; writes p, m, v 28 B
//
// (Weight decay, dampening and nesterov change the arithmetic, not the bytes.)
// Two bounds over --bound-bytes per array (default 256 MiB, 8x this
// machine's 32 MiB L3), both counted as bytes read plus bytes written:
// memcpy (8 B per float, 4 read and 4 written: glibc's large copies use
// streaming stores, so no write-allocate read), and
// the in-place update a += s * b (12 B per float: reads a and b, writes a),
// which is how every optimizer touches memory, with no write-allocate. The
// bound is the faster of the two; "/bound" is the optimizer's GB/s over it,
// and passes 1 at sizes in cache.

#include <gradsync/gradsync.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

/// The median over `repeats` rounds of seconds per call of f, after one
/// call that faults the pages in (and, for an optimizer, makes its state).
template <class F>
double seconds_per_call(F&& f, std::size_t bytes, int repeats) {
  f();
  const int iters = static_cast<int>(std::clamp(5e8 / static_cast<double>(bytes), 1.0, 100000.0));
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) f();
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / iters);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// a += s * b over n floats, in blocks that vectorize at -O2 as the optimizers' loops do.
[[gnu::noinline]] void update_in_place(float* __restrict a, const float* __restrict b, float s, std::size_t n) {
  gradsync::detail::for_each_blocked<float>(n, [=](std::size_t i) { a[i] += s * b[i]; });
}

/// "64K", "1M", "300": elements.
std::size_t parse_count(const std::string& s) {
  char* end = nullptr;
  std::size_t n = std::strtoull(s.c_str(), &end, 10);
  if (*end == 'K' || *end == 'k') n <<= 10;
  if (*end == 'M' || *end == 'm') n <<= 20;
  return n;
}

std::vector<std::size_t> parse_list(const std::string& s) {
  std::vector<std::size_t> out;
  std::size_t pos = 0;
  while (pos <= s.size()) {
    const std::size_t comma = std::min(s.find(',', pos), s.size());
    out.push_back(parse_count(s.substr(pos, comma - pos)));
    pos = comma + 1;
  }
  return out;
}

template <class Opt>
void row(const char* name, Opt opt, std::size_t n, double bytes_per_param, int repeats, double bound_gbs) {
  std::vector<float> p(n), g(n);
  // Gradients of a trained layer's size; steady values, so no step meets subnormals.
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::size_t i = 0; i < n; ++i) {
    p[i] = 0.05f * normal(rng);
    g[i] = 1e-3f * normal(rng);
  }
  const double bytes = bytes_per_param * static_cast<double>(n);
  const double s = seconds_per_call(
      [&] { opt.step(std::span<float>(p), std::span<const float>(g)); }, static_cast<std::size_t>(bytes), repeats);
  const double gbs = bytes / s / 1e9;
  std::printf("%-14s %10zu %5.0f %10.3f %8.2f %7.2f\n", name, n, bytes_per_param, 1e3 * s, gbs, gbs / bound_gbs);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::size_t> sizes{std::size_t{64} << 10, std::size_t{1} << 20, std::size_t{4} << 20,
                                 std::size_t{16} << 20, std::size_t{64} << 20};
  int repeats = 5;
  std::size_t bound_bytes = std::size_t{256} << 20;
  unsigned threads = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--sizes" && i + 1 < argc) {
      sizes = parse_list(argv[++i]);
    } else if (a == "--repeats" && i + 1 < argc) {
      repeats = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--bound-bytes" && i + 1 < argc) {
      bound_bytes = std::max<std::size_t>(parse_count(argv[++i]), 1);
    } else if (a == "--threads" && i + 1 < argc) {
      threads = static_cast<unsigned>(std::max(1, std::atoi(argv[++i])));
    } else {
      std::fprintf(stderr,
                   "usage: optim_step [--sizes 64K,1M,4M,16M,64M] [--repeats R] [--bound-bytes B] [--threads T]\n");
      return 2;
    }
  }
  double copy_gbs = 0, update_gbs = 0;
  {
    std::vector<char> a(bound_bytes, 1), b(bound_bytes, 2);
    const double s = seconds_per_call([&] { std::memcpy(a.data(), b.data(), bound_bytes); }, 2 * bound_bytes, repeats);
    copy_gbs = 2.0 * static_cast<double>(bound_bytes) / s / 1e9;
  }
  {
    const std::size_t n = bound_bytes / sizeof(float);
    std::vector<float> a(n, 1.0f), b(n, 1e-3f);
    const double bytes = 12.0 * static_cast<double>(n);
    const double s = seconds_per_call([&] { update_in_place(a.data(), b.data(), 1e-3f, n); },
                                      static_cast<std::size_t>(bytes), repeats);
    update_gbs = bytes / s / 1e9;
  }
  const double bound_gbs = std::max(copy_gbs, update_gbs);
  std::printf("# optimizer step on float parameters, %u thread(s) per step; GB = 1e9; %zu bytes per array: memcpy "
              "%.2f GB/s, a += s * b %.2f GB/s (read + written, one thread); bound %.2f GB/s\n",
              threads, bound_bytes, copy_gbs, update_gbs, bound_gbs);
  std::printf("# %-12s %10s %5s %10s %8s %7s\n", "optimizer", "params", "B/p", "ms/step", "GB/s", "/bound");
  for (const std::size_t n : sizes) {
    const unsigned t = threads;
    row("sgd", gradsync::Sgd<float>({.lr = 1e-3, .threads = t}), n, 12, repeats, bound_gbs);
    row("sgd_momentum", gradsync::Sgd<float>({.lr = 1e-3, .momentum = 0.9, .threads = t}), n, 20, repeats, bound_gbs);
    row("sgd_nesterov", gradsync::Sgd<float>({.lr = 1e-3, .momentum = 0.9, .nesterov = true, .threads = t}), n, 20,
        repeats, bound_gbs);
    row("adam", gradsync::Adam<float>({.lr = 1e-3, .threads = t}), n, 28, repeats, bound_gbs);
    row("adamw", gradsync::AdamW<float>({.lr = 1e-3, .weight_decay = 0.01, .threads = t}), n, 28, repeats,
        bound_gbs);
  }
}
