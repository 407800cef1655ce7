// GradSync on bfloat16 and float16 gradients (what DistributedDataParallel
// uses for 16-bit LibTorch parameters), without torch, so the sanitizer
// builds run it too. Deterministic mode pins down where rounding happens:
// each rank-ordered addition is done in float and rounded to the type, the
// division by N is done in float and rounded once, and a local scale is
// applied in float and rounded once before the reduction.
#include <doctest/doctest.h>

#include <gradsync/gradsync.hpp>

#include <cstddef>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "support/common.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_train_grad_sync_half {

namespace {

using gradsync::Communicator;
using gradsync::GradSync;
using gradsync::GradSyncOptions;
using gradsync::Threads;

/// Rank r's value at element i, the same on every call for one seed.
template <class T>
std::vector<T> values(int rank, std::size_t n, std::string_view salt) {
  auto rng = test::rng_for(std::string(salt) + " rank " + std::to_string(rank));
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  std::vector<T> out(n);
  for (T& x : out) x = T(u(rng));
  return out;
}

/// What the reduction must give: each rank's value times `pre` (in float,
/// rounded), the rank-ordered sum rounded after each step, then, if
/// `divide`, the float division by N rounded once.
template <class T>
T expected(const std::vector<std::vector<T>>& in, std::size_t i, float pre, bool divide) {
  T acc = T(static_cast<float>(in[0][i]) * pre);
  for (std::size_t r = 1; r < in.size(); ++r) {
    acc = T(static_cast<float>(acc) + static_cast<float>(T(static_cast<float>(in[r][i]) * pre)));
  }
  return divide ? T(static_cast<float>(acc) / static_cast<float>(in.size())) : acc;
}

}  // namespace

TEST_CASE_TEMPLATE("GradSync on 16-bit gradients: rank-ordered sums rounded per step, one rounded division",
                   T, gradsync::bfloat16, gradsync::float16) {
  CAPTURE(test::test_seed());
  // Awkward sizes: an empty unit, sizes not divisible by N, buckets of several units.
  const std::vector<std::size_t> sizes{37, 0, 129, 5, 300};
  std::size_t total = 0;
  for (std::size_t s : sizes) total += s;
  for (int n = 1; n <= 4; ++n) {
    for (const bool scattered : {false, true}) {
      for (const bool scaled : {false, true}) {
        CAPTURE(n);
        CAPTURE(scattered);
        CAPTURE(scaled);
        std::vector<std::vector<T>> in;
        for (int r = 0; r < n; ++r) in.push_back(values<T>(r, total, "grad sync half"));
        std::vector<std::vector<T>> out(static_cast<std::size_t>(n));
        std::vector<int> packed(static_cast<std::size_t>(n));
        // A scale of 1/3 after 3 micro-steps, and a divisor other than N, take the scaled path.
        const float scale = scaled ? 1.0f / 3.0f : 1.0f;
        const int divisor = scaled && n > 1 ? n - 1 : n;
        gradsync::run_threads(n, [&](Communicator<Threads>& comm) {
          const auto r = static_cast<std::size_t>(comm.rank());
          std::vector<T> flat = in[r];
          // Scattered: each unit in its own vector, so buckets are packed.
          std::vector<std::vector<T>> apart;
          std::vector<std::span<T>> units;
          std::size_t at = 0;
          for (std::size_t s : sizes) {
            if (scattered) {
              apart.emplace_back(flat.begin() + static_cast<std::ptrdiff_t>(at),
                                 flat.begin() + static_cast<std::ptrdiff_t>(at + s));
            } else {
              units.push_back(std::span<T>(flat).subspan(at, s));
            }
            at += s;
          }
          for (auto& a : apart) units.push_back(std::span<T>(a));
          GradSyncOptions o;
          o.collective.deterministic = true;
          o.first_bucket_cap_bytes = 64;
          o.bucket_cap_bytes = 300;
          GradSync<Threads, T> sync(comm, units, o);
          if (scaled) sync.set_averaging({.local_scale = scale, .divisor = divisor});
          for (const auto& b : sync.buckets()) packed[r] += b.in_place ? 0 : 1;
          sync.mark_all_ready();
          sync.finish();
          if (scattered) {
            out[r].clear();
            for (const auto& a : apart) out[r].insert(out[r].end(), a.begin(), a.end());
          } else {
            out[r] = flat;
          }
        });
        for (int r = 0; r < n; ++r) {
          CAPTURE(r);
          CHECK((packed[static_cast<std::size_t>(r)] > 0) == scattered);
          for (std::size_t i = 0; i < total; ++i) {
            CAPTURE(i);
            // Dividing by N is Avg's last step; another divisor, and any
            // divisor of float16, is folded into the local scale (in
            // double, then float) before a Sum.
            const bool mean = divisor == n && !std::is_same_v<T, gradsync::float16>;
            const auto pre = static_cast<float>(mean ? double{scale} : double{scale} / divisor);
            // A world of one skips the reduction: its mean is its own value.
            const T want = n == 1 ? T(static_cast<float>(in[0][i]) * pre) : expected(in, i, pre, mean);
            REQUIRE(out[static_cast<std::size_t>(r)][i].bits == want.bits);
          }
        }
      }
    }
  }
}

TEST_CASE("GradSync on float16 gradients: a mean within float16's range stays finite where the sum would not") {
  // 30000 on each of 3 ranks sums to 90000, past float16's 65504: the
  // gradients are divided by N before the sum, so the mean is exact.
  for (int n = 2; n <= 5; ++n) {
    CAPTURE(n);
    gradsync::run_threads(n, [&](Communicator<Threads>& comm) {
      std::vector<gradsync::float16> grad(9, gradsync::float16(30000.0f + 1000.0f * float(comm.rank())));
      GradSync<Threads, gradsync::float16> sync(comm, {std::span<gradsync::float16>(grad)});
      sync.mark_all_ready();
      sync.finish();
      const float want = 30000.0f + 1000.0f * float(n - 1) / 2.0f;
      for (auto g : grad) CHECK(static_cast<float>(g) == doctest::Approx(want).epsilon(2e-3));
    });
  }
}

}  // namespace test_train_grad_sync_half
