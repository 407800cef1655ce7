// The examples' MLP spends its forward and backward in three matrix products
// per layer. This times each of them, with the expressions eigen_mlp.hpp
// uses, on one thread, against the machine's own peak: a loop of
// independent fused multiply-adds on the widest vectors the build targets,
// measured in the same run (not a datasheet figure).
//
//   mlp_gemm [--sizes 784,1024,1024,10] [--batch 64] [--repeats 30]
//
// Per layer l (in -> out, batch n, column-major as Eigen stores it):
//   forward   Y  = W X          2·out·in·n flops
//   weights   G += D Aᵀ         2·out·in·n
//   input     E  = Wᵀ D         2·in·out·n (not for the first layer)
// GFLOP/s is 1e9 flops per second, median of the repeats. bench/peer/torch_gemm.py
// times the same products with PyTorch for comparison.

#include "../examples/eigen_dense.hpp"
#include "int_list.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic>;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/// Seconds of each of `repeats` timed calls of f, after two untimed.
template <class F>
std::vector<double> call_seconds(int repeats, F&& f) {
  f();
  f();
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return t;
}

template <class F>
double seconds_per_call(int repeats, F&& f) {
  return median(call_seconds(repeats, f));
}

#if defined(__FMA__) && defined(__AVX__)
/// `iters` rounds of 12 independent multiply-add chains on 8-float vectors,
/// enough to cover the latency of two FMA pipes. Its own function, with its
/// accumulators local, so that they stay in registers. Without -ffast-math
/// the compiler may not fold a chain of roundings, so every multiply-add is
/// executed; the returned sum keeps them live.
__attribute__((noinline)) float fma_chains(long iters, float x) {
  __m256 c0 = _mm256_set1_ps(x), c1 = _mm256_set1_ps(x + 1), c2 = _mm256_set1_ps(x + 2), c3 = _mm256_set1_ps(x + 3);
  __m256 c4 = _mm256_set1_ps(x + 4), c5 = _mm256_set1_ps(x + 5), c6 = _mm256_set1_ps(x + 6), c7 = _mm256_set1_ps(x + 7);
  __m256 c8 = _mm256_set1_ps(x + 8), c9 = _mm256_set1_ps(x + 9), c10 = _mm256_set1_ps(x + 10);
  __m256 c11 = _mm256_set1_ps(x + 11);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (long i = 0; i < iters; ++i) {
    c0 = _mm256_fmadd_ps(c0, a, b), c1 = _mm256_fmadd_ps(c1, a, b), c2 = _mm256_fmadd_ps(c2, a, b);
    c3 = _mm256_fmadd_ps(c3, a, b), c4 = _mm256_fmadd_ps(c4, a, b), c5 = _mm256_fmadd_ps(c5, a, b);
    c6 = _mm256_fmadd_ps(c6, a, b), c7 = _mm256_fmadd_ps(c7, a, b), c8 = _mm256_fmadd_ps(c8, a, b);
    c9 = _mm256_fmadd_ps(c9, a, b), c10 = _mm256_fmadd_ps(c10, a, b), c11 = _mm256_fmadd_ps(c11, a, b);
  }
  const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)),
                                 _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(c4, c5), _mm256_add_ps(c6, c7)),
                                               _mm256_add_ps(_mm256_add_ps(c8, c9), _mm256_add_ps(c10, c11))));
  return _mm256_cvtss_f32(s);
}
#endif

/// Single-precision flops per second one core reaches on independent
/// multiply-adds (2 flops per lane each).
double peak_flops(const char** how) {
#if defined(__FMA__) && defined(__AVX__)
  *how = "AVX2 FMA, 8 floats, 12 chains";
  constexpr long iters = 2'000'000;
  float sink = 0;
  // A peak is the best the core does: the fastest of the rounds.
  const std::vector<double> t = call_seconds(9, [&] { sink += fma_chains(iters, sink); });
  const double s = *std::min_element(t.begin(), t.end());
  if (sink == 12345.0f) std::puts("");
  return static_cast<double>(iters) * 12 * 8 * 2 / s;
#else
  *how = "no FMA in this build (-march=native where the machine has it)";
  return 0;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> sizes = {784, 1024, 1024, 10};
  int batch = 64, repeats = 30;
  const char* usage = "usage: mlp_gemm [--sizes 784,1024,1024,10] [--batch 64] [--repeats 30]\n";
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      const bool has_value = i + 1 < argc;
      if (a == "--sizes" && has_value) {
        sizes = bench::parse_list(argv[++i], "--sizes");
      } else if (a == "--batch" && has_value) {
        batch = bench::parse_list(argv[++i], "--batch").at(0);
      } else if (a == "--repeats" && has_value) {
        repeats = bench::parse_list(argv[++i], "--repeats").at(0);
      } else {
        std::fprintf(stderr, "%s", usage);
        return 2;
      }
    }
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "mlp_gemm: not a list of positive integers: %s\n%s", e.what(), usage);
    return 2;
  }
  if (sizes.size() < 2) {
    std::fprintf(stderr, "mlp_gemm: --sizes needs two widths or more\n");
    return 2;
  }
  Eigen::setNbThreads(1);
  const char* how = "";
  const double peak = peak_flops(&how);
  std::printf("# one core's peak: %.1f GFLOP/s (%s)\n", peak / 1e9, how);
  std::printf("# Eigen %d.%d.%d, SIMD: %s, batch %d, median of %d\n", EIGEN_WORLD_VERSION, EIGEN_MAJOR_VERSION,
              EIGEN_MINOR_VERSION, Eigen::SimdInstructionSetsInUse(), batch, repeats);
  std::printf("%-7s %-8s %6s %6s %6s %10s %9s %7s\n", "layer", "product", "M", "N", "K", "us", "GFLOP/s", "of peak");
  double total_s = 0, total_flops = 0;
  for (std::size_t l = 0; l + 1 < sizes.size(); ++l) {
    const int in = sizes[l], out = sizes[l + 1], n = batch;
    const Matrix w = Matrix::Random(out, in), x = Matrix::Random(in, n), d = Matrix::Random(out, n);
    Matrix y(out, n), g = Matrix::Zero(out, in), e(in, n);
    struct Product {
      const char* name;
      int m, n, k;
      double s;
    };
    std::vector<Product> products = {
        {"forward", out, n, in, seconds_per_call(repeats, [&] { y.noalias() = w * x; })},
        {"weights", out, in, n, seconds_per_call(repeats, [&] { g.noalias() += d * x.transpose(); })},
    };
    if (l > 0) products.push_back({"input", in, n, out, seconds_per_call(repeats, [&] { e.noalias() = w.transpose() * d; })});
    for (const Product& p : products) {
      const double flops = 2.0 * p.m * p.n * p.k;
      total_s += p.s;
      total_flops += flops;
      std::printf("fc%-5zu %-8s %6d %6d %6d %10.1f %9.1f %6.0f%%\n", l + 1, p.name, p.m, p.n, p.k, p.s * 1e6,
                  flops / p.s / 1e9, peak > 0 ? 100 * flops / p.s / peak : 0.0);
    }
  }
  std::printf("%-7s %-8s %6s %6s %6s %10.1f %9.1f %6.0f%%\n", "all", "", "", "", "", total_s * 1e6,
              total_flops / total_s / 1e9, peak > 0 ? 100 * total_flops / total_s / peak : 0.0);
  return 0;
}
