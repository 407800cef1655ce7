// reduce_kernel: throughput of the local reduce every algorithm is built on
// (dst = op(dst, src)), per element type, beside memcpy of the same bytes in
// the same run. This is the gamma of the cost model, and what the compiler
// made of gradsync/core/ops.hpp at this build's -O level.
//
//   reduce_kernel [-b BYTES] [-o sum|min|max|prod]
//
// GB/s counts the bytes of one operand (like memcpy's bytes copied).

#include <gradsync/gradsync.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

template <class F>
double seconds_per_call(F&& f, std::size_t bytes) {
  f();  // warm the caches and fault the pages in
  const int iters = static_cast<int>(std::clamp(1e9 / static_cast<double>(bytes), 3.0, 100000.0));
  std::vector<double> t;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) f();
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / iters);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

template <class T>
void row(const char* name, std::size_t bytes, gradsync::OpKind op, double memcpy_gbs) {
  const std::size_t n = bytes / sizeof(T);
  std::vector<T> dst(n, T(1.0f)), src(n, T(0.0f));
  const gradsync::DataType type = gradsync::DataTypeOf<T>::value;
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
    } else if (a == "-o" && i + 1 < argc) {
      const std::string o = argv[++i];
      op = o == "min" ? gradsync::OpKind::min : o == "max" ? gradsync::OpKind::max
         : o == "prod" ? gradsync::OpKind::prod : gradsync::OpKind::sum;
    } else {
      std::fprintf(stderr, "usage: reduce_kernel [-b BYTES] [-o sum|min|max|prod]\n");
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
