// reduce_kernel: throughput of the local reduce every algorithm is built on
// (dst = op(dst, src)), per element type, beside memcpy of the same bytes in
// the same run. This is the gamma of the cost model, and what the compiler
// made of gradsync/core/ops.hpp at this build's -O level.
//
//   reduce_kernel [-b BYTES] [-o sum|min|max|prod] [-n CALLS]
//
// GB/s counts the bytes of one operand (like memcpy's bytes copied). Each
// figure is the median of 5 batches of CALLS back-to-back calls; by default
// a batch moves about 1 GB (3 to 100,000 calls). -n 1 is a smoke run.

#include <gradsync/collectives.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

/// Calls per timed batch; 0: about 1 GB of operand bytes per batch.
int calls_per_batch = 0;

template <class F>
double seconds_per_call(F&& f, std::size_t bytes) {
  f();  // warm the caches and fault the pages in
  const int iters = calls_per_batch > 0
                        ? calls_per_batch
                        : static_cast<int>(std::clamp(1e9 / static_cast<double>(bytes), 3.0, 100000.0));
  std::vector<double> t;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) f();
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / iters);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// op(3, 2), exact in every type.
double expected(gradsync::OpKind op) {
  switch (op) {
    case gradsync::OpKind::sum:
    case gradsync::OpKind::avg: return 5;  // Avg's local step is a sum; it divides once, at the end
    case gradsync::OpKind::min: return 2;
    case gradsync::OpKind::max: return 3;
    case gradsync::OpKind::prod: return 6;
  }
  return 0;
}

template <class T>
void row(const char* name, std::size_t bytes, gradsync::OpKind op, double memcpy_gbs) {
  const std::size_t n = bytes / sizeof(T);
  const gradsync::DataType type = gradsync::DataTypeOf<T>::value;
  // A kernel that computes something else has no throughput worth printing:
  // one call on 3s and 2s first, every element checked.
  std::vector<T> dst(n, T(3.0f)), src(n, T(2.0f));
  gradsync::detail::reduce_into_erased(type, op, dst.data(), src.data(), n);
  for (std::size_t i = 0; i < n; ++i) {
    const double got = static_cast<double>(static_cast<float>(dst[i]));  // 16-bit types convert to float only
    if (got != expected(op)) {
      std::fprintf(stderr, "reduce_kernel: %s gave %g at element %zu of %zu, expected %g\n", name,
                   got, i, n, expected(op));
      std::exit(1);
    }
  }
  std::fill(dst.begin(), dst.end(), T(1.0f));
  std::fill(src.begin(), src.end(), T(0.0f));
  const double s = seconds_per_call(
      [&] { gradsync::detail::reduce_into_erased(type, op, dst.data(), src.data(), n); }, bytes);
  const double gbs = static_cast<double>(bytes) / s / 1e9;
  std::printf("%-9s %12zu %10.2f %9.2f\n", name, bytes, gbs, gbs / memcpy_gbs);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::size_t> sizes{std::size_t{256} << 10, std::size_t{64} << 20};
  gradsync::OpKind op = gradsync::OpKind::sum;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-b" && i + 1 < argc) {
      sizes = {static_cast<std::size_t>(std::strtoull(argv[++i], nullptr, 10))};
      if (sizes[0] < sizeof(double)) {
        std::fprintf(stderr, "reduce_kernel: -b takes at least %zu bytes (one element of every type)\n", sizeof(double));
        return 2;
      }
    } else if (a == "-o" && i + 1 < argc) {
      const std::string o = argv[++i];
      if (o == "sum") {
        op = gradsync::OpKind::sum;
      } else if (o == "min") {
        op = gradsync::OpKind::min;
      } else if (o == "max") {
        op = gradsync::OpKind::max;
      } else if (o == "prod") {
        op = gradsync::OpKind::prod;
      } else {
        std::fprintf(stderr, "reduce_kernel: -o takes sum, min, max or prod, not '%s'\n", o.c_str());
        return 2;
      }
    } else if (a == "-n" && i + 1 < argc) {
      calls_per_batch = std::atoi(argv[++i]);
      if (calls_per_batch < 1) {
        std::fprintf(stderr, "reduce_kernel: -n takes a number of calls, at least 1\n");
        return 2;
      }
    } else {
      std::fprintf(stderr, "usage: reduce_kernel [-b BYTES] [-o sum|min|max|prod] [-n CALLS]\n");
      return 2;
    }
  }
  std::printf("# local reduce dst = op(dst, src), one operand's bytes per second; GB = 1e9\n");
  std::printf("# %-7s %12s %10s %9s\n", "type", "bytes", "GB/s", "/memcpy");
  for (const std::size_t bytes : sizes) {
    std::vector<char> a(bytes, 1), b(bytes, 2);
    const double mc = static_cast<double>(bytes) / seconds_per_call([&] { std::memcpy(a.data(), b.data(), bytes); }, bytes) / 1e9;
    std::printf("%-9s %12zu %10.2f %9.2f\n", "memcpy", bytes, mc, 1.0);
    row<float>("float", bytes, op, mc);
    row<double>("double", bytes, op, mc);
    row<std::int32_t>("int32", bytes, op, mc);
    row<std::int64_t>("int64", bytes, op, mc);
    row<gradsync::bfloat16>("bfloat16", bytes, op, mc);
    row<gradsync::float16>("float16", bytes, op, mc);
  }
}
