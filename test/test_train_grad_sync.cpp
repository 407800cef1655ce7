// GradSync (the bucketed reducer), its parts (plan, readiness, reduction
// policies) and the ProgressWorker under it, alone.
#include <doctest/doctest.h>

#include <gradsync/gradsync.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/common.hpp"
#include "support/instances.hpp"
#include "support/refusals.hpp"
#include "support/unit_disagreement.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_train_grad_sync {

using gradsync::Communicator;
using gradsync::GradSync;
using gradsync::GradSyncOptions;
using gradsync::Threads;

namespace {

/// A value that differs per rank, unit and element, exact in float.
float g(int rank, std::size_t unit, std::size_t i) {
  return static_cast<float>((rank + 1) * 3 + static_cast<int>(unit) * 7 + static_cast<int>(i % 13)) * 0.25f;
}

/// Pseudo-random values whose sum depends on the order it is taken in.
float noisy(int rank, std::size_t i) {
  std::uint64_t s = (static_cast<std::uint64_t>(rank) << 32) ^ (i * 0x9E3779B97F4A7C15ull);
  s ^= s >> 31;
  s *= 0xBF58476D1CE4E5B9ull;
  s ^= s >> 27;
  return static_cast<float>(static_cast<double>(s >> 11) / double(1ull << 53) * 2.0 - 1.0) * 1e3f;
}

/// The unit that flat element i falls in, for units of `sizes` laid end to end.
std::size_t unit_of(const std::vector<std::size_t>& sizes, std::size_t i) {
  std::size_t u = 0, at = 0;
  while (i >= at + sizes[u]) at += sizes[u++];
  return u;
}

std::vector<std::span<float>> split(std::vector<float>& flat, const std::vector<std::size_t>& sizes) {
  std::vector<std::span<float>> out;
  std::size_t at = 0;
  for (std::size_t n : sizes) {
    out.push_back(std::span<float>(flat).subspan(at, n));
    at += n;
  }
  return out;
}

/// Runs one synced backward on `world` ranks over units of `sizes` filled by
/// `fill(rank, flat_index)`, and returns every rank's averaged gradient.
template <class Fill>
std::vector<std::vector<float>> sync_once(int world, const std::vector<std::size_t>& sizes, GradSyncOptions o,
                                          Fill fill) {
  std::vector<std::vector<float>> out(static_cast<std::size_t>(world));
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    std::size_t total = 0;
    for (std::size_t n : sizes) total += n;
    std::vector<float> flat(total);
    for (std::size_t i = 0; i < total; ++i) flat[i] = fill(comm.rank(), i);
    GradSync<Threads, float> sync(comm, split(flat, sizes), o);
    for (std::size_t u = sizes.size(); u-- > 0;) sync.ready(u);
    sync.finish();
    out[static_cast<std::size_t>(comm.rank())] = flat;
  });
  return out;
}

}  // namespace

TEST_CASE("ProgressWorker runs collectives in submission order and wait() rethrows their errors") {
  gradsync::run_threads(3, [](Communicator<Threads>& comm) {
    std::vector<int> order;
    std::vector<float> a(1000, float(comm.rank() + 1)), b(10, 1.0f);
    {
      gradsync::ProgressWorker<Threads> worker(comm);
      auto r1 = worker.submit("a", [&](Communicator<Threads>& c) {
        gradsync::AllReduce<gradsync::Ring>{}(c, std::span<float>(a));
        order.push_back(1);
      });
      auto r2 = worker.submit("b", [&](Communicator<Threads>& c) {
        gradsync::AllReduce<gradsync::Tree>{}(c, std::span<float>(b));
        order.push_back(2);
      });
      r2.wait();
      CHECK(r1.test());
      CHECK(worker.in_flight() == 0);
      auto bad = worker.submit("bad", [](Communicator<Threads>&) { throw std::runtime_error("boom"); });
      CHECK_THROWS_WITH_AS(bad.wait(), "boom", std::runtime_error);
      // Later work is not run, and fails with the first failure itself.
      bool ran = false;
      auto after = worker.submit("after", [&](Communicator<Threads>&) { ran = true; });
      CHECK_THROWS_WITH_AS(after.wait(), "boom", std::runtime_error);
      CHECK_FALSE(ran);
    }
    CHECK(order == std::vector<int>{1, 2});
    CHECK(a[0] == 6.0f);
    CHECK(b[0] == 3.0f);
  });
}

TEST_CASE("buckets: 25 MiB cap, 1 MiB first bucket, reverse parameter order, big units alone") {
  gradsync::run_threads(1, [](Communicator<Threads>& comm) {
    const std::size_t MiB = std::size_t{1} << 20;
    // floats: 2 MiB, 20 MiB, 30 MiB (over the cap), 8 MiB, 0.5 MiB, 0.25 MiB, 0.5 MiB
    const std::vector<std::size_t> bytes{2 * MiB, 20 * MiB, 30 * MiB, 8 * MiB, MiB / 2, MiB / 4, MiB / 2};
    std::vector<std::size_t> sizes;
    for (std::size_t b : bytes) sizes.push_back(b / sizeof(float));
    std::vector<float> flat;
    for (std::size_t n : sizes) flat.resize(flat.size() + n);
    GradSync<Threads, float> sync(comm, split(flat, sizes));
    const auto& plan = sync.buckets();
    REQUIRE(plan.size() == 4);
    // First bucket: units 6, 5 (0.75 MiB); adding unit 4 would pass 1 MiB.
    CHECK(plan[0].first_unit == 5);
    CHECK(plan[0].last_unit == 6);
    CHECK(plan[1].first_unit == 3);  // units 4, 3: 8.5 MiB
    CHECK(plan[1].last_unit == 4);
    CHECK(plan[2].first_unit == 2);  // 30 MiB, alone
    CHECK(plan[2].last_unit == 2);
    CHECK(plan[3].first_unit == 0);  // 20 MiB + 2 MiB: fits under 25 MiB
    CHECK(plan[3].last_unit == 1);
    CHECK(plan[3].count == (22 * MiB) / sizeof(float));
    for (const auto& b : plan) CHECK(b.in_place);
  });
}

TEST_CASE("averaging: every rank ends with the mean of all ranks' gradients") {
  for (int world : {1, 2, 3}) {
    CAPTURE(world);
    const std::vector<std::size_t> sizes{5, 17, 0, 40, 3};
    GradSyncOptions o;
    o.first_bucket_cap_bytes = 64;
    o.bucket_cap_bytes = 128;
    std::size_t total = 0;
    for (std::size_t n : sizes) total += n;
    auto out = sync_once(world, sizes, o, [&](int r, std::size_t i) { return g(r, unit_of(sizes, i), i); });
    for (int r = 0; r < world; ++r)
      for (std::size_t i = 0; i < total; ++i) {
        float sum = 0;
        for (int q = 0; q < world; ++q) sum += g(q, unit_of(sizes, i), i);
        REQUIRE(out[static_cast<std::size_t>(r)][i] == sum / static_cast<float>(world));
      }
  }
}

TEST_CASE("a bucket launches as soon as its gradients are ready, in bucket order, before finish") {
  gradsync::run_threads(2, [](Communicator<Threads>& comm) {
    std::vector<float> flat(4 * 16, 1.0f);
    GradSyncOptions o;
    o.first_bucket_cap_bytes = o.bucket_cap_bytes = 16 * sizeof(float);  // one unit per bucket
    GradSync<Threads, float> sync(comm, split(flat, {16, 16, 16, 16}), o);
    REQUIRE(sync.buckets().size() == 4);
    // Unit 2 is bucket 1: ready, but bucket 0 (unit 3) is not, so nothing starts.
    sync.ready(2);
    CHECK(sync.launched() == 0);
    sync.ready(3);
    CHECK(sync.launched() == 2);
    sync.ready(1);
    CHECK(sync.launched() == 3);
    sync.ready(0);
    CHECK(sync.launched() == 4);
    sync.finish();
    CHECK(sync.stats().buckets_launched_early == 4);
    CHECK(flat[0] == 1.0f);
  });
}

TEST_CASE("results do not depend on bucket size: bitwise when deterministic, within rounding otherwise") {
  const std::vector<std::size_t> sizes{300, 1000, 7, 2500, 64};
  std::size_t total = 0;
  for (std::size_t n : sizes) total += n;
  for (bool det : {true, false}) {
    CAPTURE(det);
    std::vector<std::vector<float>> results;
    for (std::size_t cap : {std::size_t{16}, std::size_t{4096}, std::size_t{25} << 20}) {
      GradSyncOptions o;
      o.collective.deterministic = det;
      o.first_bucket_cap_bytes = std::min<std::size_t>(cap, std::size_t{1} << 20);
      o.bucket_cap_bytes = cap;
      results.push_back(sync_once(3, sizes, o, noisy)[0]);
    }
    for (std::size_t k = 1; k < results.size(); ++k)
      for (std::size_t i = 0; i < total; ++i) {
        if (det) {
          REQUIRE(results[k][i] == results[0][i]);
        } else {
          // Three addends in another order: at most a couple of ulps of the largest.
          REQUIRE(std::abs(results[k][i] - results[0][i]) <= 1e3f * 4 * 1.2e-7f);
        }
      }
  }
}

TEST_CASE("units scattered in memory are packed, reduced and unpacked like contiguous ones") {
  gradsync::run_threads(3, [](Communicator<Threads>& comm) {
    const std::vector<std::size_t> sizes{33, 7, 100};
    std::vector<std::vector<float>> separate;
    std::vector<float> flat;
    for (std::size_t u = 0; u < sizes.size(); ++u) {
      separate.emplace_back(sizes[u]);
      for (std::size_t i = 0; i < sizes[u]; ++i) {
        separate[u][i] = g(comm.rank(), u, i);
        flat.push_back(g(comm.rank(), u, i));
      }
    }
    std::vector<std::span<float>> spans(separate.begin(), separate.end());
    GradSyncOptions o;
    o.collective.deterministic = true;
    GradSync<Threads, float> a(comm, spans, o);
    CHECK_FALSE(a.buckets()[0].in_place);
    a.mark_all_ready();
    a.finish();
    GradSync<Threads, float> b(comm, split(flat, sizes), o);
    CHECK(b.buckets()[0].in_place);
    b.mark_all_ready();
    b.finish();
    std::size_t at = 0;
    for (const auto& s : separate)
      for (float x : s) REQUIRE(x == flat[at++]);
  });
}

TEST_CASE("bf16 compression matches the uncompressed mean within bfloat16 precision") {
  const std::vector<std::size_t> sizes{500, 1500};
  GradSyncOptions plain, bf16;
  bf16.compression = gradsync::Compression::bf16;
  auto fill = [](int r, std::size_t i) { return noisy(r, i) * 1e-3f; };
  const auto a = sync_once(3, sizes, plain, fill);
  const auto b = sync_once(3, sizes, bf16, fill);
  double worst = 0;
  for (std::size_t i = 0; i < a[0].size(); ++i) {
    // Inputs are in [-1, 1]; bf16 keeps 8 significant bits, each of the 3
    // roundings (cast, sum, mean) costs at most 2^-9 relative.
    worst = std::max(worst, double(std::abs(a[0][i] - b[0][i])));
    REQUIRE(std::abs(a[0][i] - b[0][i]) <= 3 * std::ldexp(1.0, -8));
    REQUIRE(b[0][i] == b[1][i]);
    REQUIRE(b[0][i] == b[2][i]);
  }
  CHECK(worst > 0);  // it really went through bfloat16
}

TEST_CASE("find_unused_parameters: a unit with no gradient on a rank contributes zeros") {
  gradsync::run_threads(3, [](Communicator<Threads>& comm) {
    std::vector<float> flat(30, float(comm.rank() + 1));
    if (comm.rank() == 1) std::fill(flat.begin(), flat.begin() + 10, 99.0f);  // stale, never produced
    GradSyncOptions o;
    o.find_unused_parameters = true;
    GradSync<Threads, float> sync(comm, split(flat, {10, 10, 10}), o);
    sync.ready(2);
    sync.ready(1);
    if (comm.rank() != 1) sync.ready(0);
    sync.finish();
    CHECK(flat[0] == doctest::Approx((1.0 + 0.0 + 3.0) / 3));
    CHECK(flat[15] == doctest::Approx(2.0));
  });
}

TEST_CASE("find_unused_parameters: a synced finish() with no gradient since the last is refused, the mean kept") {
  CAPTURE(test::test_seed());
  auto rng = test::rng_for("find_unused second finish");
  for (int n = 3; n <= 5; ++n) {
    // Which units each rank reports in the one backward, at random: some
    // ranks report none of a unit, none reports no unit at all.
    std::vector<std::vector<int>> reports(static_cast<std::size_t>(n));
    for (auto& r : reports) {
      for (int u = 0; u < 3; ++u) {
        if (std::bernoulli_distribution(0.6)(rng)) r.push_back(u);
      }
      if (r.empty()) r.push_back(std::uniform_int_distribution<int>(0, 2)(rng));
    }
    const bool accumulate_first = std::bernoulli_distribution(0.5)(rng);
    CAPTURE(n);
    CAPTURE(accumulate_first);
    gradsync::run_threads(n, [&](Communicator<Threads>& comm) {
      std::vector<float> flat(30, float(comm.rank() + 1));
      GradSyncOptions o;
      o.find_unused_parameters = true;
      GradSync<Threads, float> sync(comm, split(flat, {10, 10, 10}), o);
      if (accumulate_first) {
        // A no_sync micro-step's gradient counts as one since the last sync.
        auto guard = sync.no_sync();
        for (int u : reports[static_cast<std::size_t>(comm.rank())]) sync.ready(static_cast<std::size_t>(u));
        sync.finish();
      } else {
        for (int u : reports[static_cast<std::size_t>(comm.rank())]) sync.ready(static_cast<std::size_t>(u));
      }
      sync.finish();
      const std::vector<float> mean = flat;
      const auto seq = comm.sequence();
      CHECK_THROWS_WITH_AS(sync.finish(), doctest::Contains("no unit got a gradient since the last synced finish()"),
                           gradsync::InvalidArgument);
      CHECK(comm.sequence() == seq);
      CHECK(flat == mean);
      // The refused call did not count: the next backward still syncs on every rank.
      sync.mark_all_ready();
      sync.finish();
    });
  }
}

TEST_CASE("without find_unused_parameters, a missing gradient is a clear error and no rank hangs") {
  const auto t0 = std::chrono::steady_clock::now();
  gradsync::ThreadsOptions topt;
  topt.timeout = std::chrono::seconds(120);
  CHECK_THROWS_WITH_AS(gradsync::run_threads(3, topt,
                                             [](Communicator<Threads>& comm) {
                                               std::vector<float> flat(30, 1.0f);
                                               GradSync<Threads, float> sync(comm, split(flat, {10, 10, 10}), {},
                                                                             {"embed", "hidden", "head"});
                                               sync.ready(2);
                                               if (comm.rank() != 1) sync.ready(1);
                                               sync.ready(0);
                                               sync.finish();
                                             }),
                       doctest::Contains("no gradient for unit 1 ('hidden')"), gradsync::InvalidArgument);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));
}

TEST_CASE("a unit marked ready twice in one backward is an error") {
  gradsync::run_threads(1, [](Communicator<Threads>& comm) {
    std::vector<float> flat(8, 1.0f);
    GradSync<Threads, float> sync(comm, split(flat, {4, 4}));
    sync.ready(1);
    CHECK_THROWS_WITH_AS(sync.ready(1), doctest::Contains("marked ready twice"), gradsync::InvalidArgument);
    CHECK_THROWS_AS(sync.ready(2), gradsync::InvalidArgument);
    sync.ready(0);
    sync.finish();
  });
}

TEST_CASE("no_sync: micro-steps do not communicate; the synced backward reduces the accumulated sum") {
  gradsync::run_threads(3, [](Communicator<Threads>& comm) {
    std::vector<float> flat(20, 0.0f);
    GradSync<Threads, float> sync(comm, split(flat, {12, 8}));
    const auto seq0 = comm.sequence();
    for (int micro = 0; micro < 3; ++micro) {
      auto guard = sync.no_sync();
      for (float& x : flat) x += float(comm.rank() + micro);
      sync.ready(1);
      sync.ready(0);
      sync.finish();
    }
    CHECK(comm.sequence() == seq0);
    for (float& x : flat) x += float(comm.rank() + 3);
    sync.set_averaging({.local_scale = 0.25});
    sync.ready(1);
    sync.ready(0);
    sync.finish();
    CHECK(comm.sequence() > seq0);
    // Mean over ranks of (sum over 4 micro-steps of rank + micro) / 4 = 1 + 1.5.
    for (float x : flat) CHECK(x == doctest::Approx(2.5));
  });
}

TEST_CASE("a collective that fails on the worker surfaces from finish() on every rank") {
  CHECK_THROWS_WITH_AS(gradsync::run_threads(3,
                                             [](Communicator<Threads>& comm) {
                                               // Rank 2 alone will step with another learning rate: the
                                               // ranks' first bucket disagrees on its label.
                                               std::vector<float> flat(10, 1.0f);
                                               GradSync<Threads, float> sync(comm, {std::span<float>(flat)});
                                               sync.set_agreed_lr(comm.rank() == 2 ? 0.1 : 0.4);
                                               sync.ready(0);
                                               sync.finish();
                                             }),
                       doctest::Contains("disagree"), gradsync::InvalidArgument);
}

TEST_CASE("GradSync options that differ between ranks are named at construction, with each rank's value") {
  auto rng = test::rng_for("GradSync options agreement");
  CAPTURE(test::test_seed());
  for (int n = 3; n <= 5; ++n) {
    const int odd = static_cast<int>(rng() % static_cast<unsigned>(n));
    const int which = static_cast<int>(rng() % 4);
    CAPTURE(n);
    CAPTURE(odd);
    CAPTURE(which);
    const std::vector<std::string> what = test::refusals_on_threads(n, [&](Communicator<Threads>& comm) {
      std::vector<float> flat(10, 1.0f);
      GradSyncOptions o;
      if (comm.rank() == odd) {
        if (which == 0) o.compression = gradsync::Compression::bf16;
        if (which == 1) o.bucket_cap_bytes = 1024;
        if (which == 2) o.find_unused_parameters = true;
        if (which == 3) o.collective.deterministic = true;
      }
      GradSync<Threads, float> sync(comm, {std::span<float>(flat)}, o);
    });
    const char* field[] = {"compression", "bucket_cap_bytes", "find_unused_parameters", "collective.deterministic"};
    const char* ours[] = {"none", "26214400", "false", "false"};
    const char* theirs[] = {"bf16", "1024", "true", "true"};
    INFO(what[0]);
    CHECK(what[0].find(std::string("GradSyncOptions::") + field[which] + ": ") != std::string::npos);
    CHECK(what[0].find(std::string(theirs[which]) + " on world rank " + std::to_string(odd)) != std::string::npos);
    CHECK(what[0].find(std::string(ours[which]) + " on world ranks ") != std::string::npos);
    for (const std::string& w : what) CHECK(w == what[0]);
  }
}

TEST_CASE("ranks that register different units all throw at construction, naming the unit and the rank") {
  std::uint64_t seed = std::random_device{}();
  if (const char* s = std::getenv("GRADSYNC_TEST_SEED")) seed = std::stoull(s);
  INFO("seed " << seed << " (rerun with GRADSYNC_TEST_SEED=" << seed << ")");
  std::mt19937_64 rng(seed);
  auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
  gradsync::ThreadsOptions topt;
  topt.timeout = std::chrono::seconds(5);
  for (int world : {3, 4, 5}) {
    for (int kind = 0; kind < 3; ++kind) {
      for (int trial = 0; trial < 3; ++trial) {
        std::vector<std::size_t> sizes(2 + pick(4));
        std::vector<std::string> names;
        for (std::size_t u = 0; u < sizes.size(); ++u) {
          sizes[u] = 2 + pick(30);
          names.push_back("unit" + std::to_string(u));
        }
        auto their_sizes = sizes;
        auto their_names = names;
        std::size_t unit = pick(sizes.size());
        if (kind == 0) {
          // The same total, split at another place.
          const std::size_t a = unit + 1 < sizes.size() ? unit : unit - 1;
          const std::size_t move = 1 + pick(their_sizes[a + 1] - 1);
          their_sizes[a] += move;
          their_sizes[a + 1] -= move;
          unit = a;
        } else if (kind == 1) {
          their_names[unit] += "_renamed";
        } else {
          their_sizes.erase(their_sizes.begin() + static_cast<std::ptrdiff_t>(unit));
          their_names.erase(their_names.begin() + static_cast<std::ptrdiff_t>(unit));
        }
        const int odd = static_cast<int>(pick(static_cast<std::size_t>(world)));
        CAPTURE(world);
        CAPTURE(kind);
        CAPTURE(odd);
        CAPTURE(unit);
        std::vector<std::string> messages(static_cast<std::size_t>(world));
        std::vector<int> constructed(static_cast<std::size_t>(world), 0);
        const auto t0 = std::chrono::steady_clock::now();
        gradsync::run_threads(world, topt, [&](Communicator<Threads>& comm) {
          const auto r = static_cast<std::size_t>(comm.rank());
          const bool differs = comm.rank() == odd;
          std::vector<float> flat(256, 1.0f);
          test::catch_message(messages[r], [&] {
            GradSync<Threads, float> sync(comm, split(flat, differs ? their_sizes : sizes), {},
                                          differs ? their_names : names);
            constructed[r] = 1;
            sync.mark_all_ready();
            sync.finish();
          });
        });
        CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1));
        test::check_unit_disagreement("GradSync", messages, constructed, unit, odd);
      }
    }
  }
}

TEST_CASE("units that agree cost one small AllGather at construction, and none on one rank") {
  for (int world : {1, 3}) {
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      std::vector<float> flat(20, 1.0f);
      const auto seq0 = comm.sequence();
      GradSync<Threads, float> sync(comm, split(flat, {12, 8}), {}, {"a", "b"});
      CHECK(comm.sequence() - seq0 == (world == 1 ? 0u : 1u));
    });
  }
}

namespace {

/// Runs `Policy` once on `world` ranks over `count` random floats per rank
/// and checks every rank's result against a double-precision reference of
/// the sum (or mean) of all ranks' inputs; also checks that the ranks'
/// results together cover the bucket once, with equal bits where they overlap.
template <class Policy>
void check_policy(int world, std::size_t count, bool mean, bool deterministic, std::uint64_t seed) {
  CAPTURE(world);
  CAPTURE(count);
  CAPTURE(mean);
  CAPTURE(deterministic);
  std::vector<std::vector<float>> in(static_cast<std::size_t>(world));
  std::mt19937_64 rng(seed ^ (count * 0x9E3779B97F4A7C15ull) ^ static_cast<std::uint64_t>(world));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto& x : in) {
    x.resize(count);
    for (float& v : x) v = u(rng);
  }
  std::vector<std::vector<float>> storage(static_cast<std::size_t>(world));
  std::vector<gradsync::ReducedPart> parts(static_cast<std::size_t>(world));
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    std::vector<float>& s = storage[r];
    s.assign(Policy::storage(count, world), 0.0f);
    std::copy(in[r].begin(), in[r].end(), s.begin());
    const Policy policy{gradsync::Options{.deterministic = deterministic}};
    policy.reduce(comm, std::span<float>(s), count, mean);
    parts[r] = Policy::result(count, world, comm.rank());
  });
  std::vector<int> covered(count, 0);
  std::vector<float> seen(count, 0.0f);
  for (std::size_t r = 0; r < parts.size(); ++r) {
    const gradsync::ReducedPart p = parts[r];
    REQUIRE(p.first + p.count <= count);
    REQUIRE(p.offset + p.count <= storage[r].size());
    for (std::size_t j = 0; j < p.count; ++j) {
      const std::size_t i = p.first + j;
      double sum = 0, magnitude = 0;
      for (const auto& x : in) {
        sum += x[i];
        magnitude += std::abs(double(x[i]));
      }
      const double ref = mean ? sum / world : sum;
      // world − 1 float additions and a division, each within 2^-24 of what it rounds.
      const double tol = (world + 1) * std::ldexp(magnitude, -24);
      const float got = storage[r][p.offset + j];
      CAPTURE(r);
      CAPTURE(i);
      REQUIRE(std::abs(double(got) - ref) <= tol);
      if (deterministic) {
        // Rank order, in float: what the deterministic option promises bit for bit.
        float fold = in[0][i];
        for (std::size_t q = 1; q < in.size(); ++q) fold += in[q][i];
        REQUIRE(got == (mean ? fold / static_cast<float>(world) : fold));
      }
      if (covered[i]) REQUIRE(got == seen[i]);
      ++covered[i];
      seen[i] = got;
    }
  }
  for (std::size_t i = 0; i < count; ++i) REQUIRE(covered[i] >= 1);
}

}  // namespace

TEST_CASE_TEMPLATE("reduction policies match a double-precision reference on 1 to 4 ranks, any count", Policy,
                   gradsync::AllReduceAverage<>, gradsync::ReduceScatterAverage<>,
                   gradsync::AllReduceAverage<gradsync::Ring>, gradsync::ReduceScatterAverage<gradsync::Ring>) {
  std::uint64_t seed = std::random_device{}();
  if (const char* s = std::getenv("GRADSYNC_TEST_SEED")) seed = std::stoull(s);
  INFO("seed " << seed << " (rerun with GRADSYNC_TEST_SEED=" << seed << ")");
  std::mt19937_64 rng(seed);
  for (int world = 1; world <= 4; ++world) {
    // Not divisible by the world size, smaller than it, and one random size.
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{7}, std::size_t{1001},
                              std::size_t{4093 + rng() % 5000}}) {
      for (bool mean : {true, false}) {
        for (bool det : {false, true}) check_policy<Policy>(world, count, mean, det, seed);
      }
    }
  }
}

TEST_CASE("reduce-scatter shards are FSDP's: ceil(count / N) each, the last ones short or empty") {
  using RS = gradsync::ReduceScatterAverage<>;
  CHECK(RS::storage(10, 4) == 3 * 5);
  CHECK(RS::result(10, 4, 0).first == 0);
  CHECK(RS::result(10, 4, 3).first == 9);
  CHECK(RS::result(10, 4, 3).count == 1);
  CHECK(RS::result(2, 4, 3).count == 0);
  CHECK(RS::result(10, 4, 2).offset == 12);
  CHECK(RS::storage(10, 1) == 10);
  CHECK(RS::result(10, 1, 0).count == 10);
  CHECK_FALSE(RS::in_place);
  CHECK(gradsync::AllReduceAverage<>::in_place);
}

TEST_CASE("GradSync with ReduceScatterAverage: each rank's shard of each bucket holds the mean, the rest is as it was") {
  const std::vector<std::size_t> sizes{5, 17, 0, 40, 3};
  std::size_t total = 0;
  for (std::size_t n : sizes) total += n;
  for (int world = 1; world <= 4; ++world) {
    for (bool bf16 : {false, true}) {
      CAPTURE(world);
      CAPTURE(bf16);
      gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
        std::vector<float> flat(total);
        for (std::size_t i = 0; i < total; ++i) flat[i] = g(comm.rank(), unit_of(sizes, i), i);
        GradSyncOptions o;
        o.first_bucket_cap_bytes = 64;
        o.bucket_cap_bytes = 128;
        if (bf16) o.compression = gradsync::Compression::bf16;
        GradSync<Threads, float, gradsync::Auto, gradsync::ReduceScatterAverage<>> sync(comm, split(flat, sizes), o);
        for (std::size_t u = sizes.size(); u-- > 0;) sync.ready(u);
        sync.finish();
        std::vector<std::size_t> unit_start{0};
        for (std::size_t n : sizes) unit_start.push_back(unit_start.back() + n);
        for (const gradsync::BucketInfo& b : sync.buckets()) {
          CHECK_FALSE(b.in_place);
          const auto part = gradsync::ReduceScatterAverage<>::result(b.count, world, comm.rank());
          const std::size_t begin = unit_start[b.first_unit];
          for (std::size_t j = 0; j < b.count; ++j) {
            const std::size_t i = begin + j;
            float sum = 0;
            for (int q = 0; q < world; ++q) sum += g(q, unit_of(sizes, i), i);
            const bool mine = j >= part.first && j < part.first + part.count;
            // The inputs are exact in bfloat16 too, and so are their sums here.
            const float mean = bf16 ? float(gradsync::bfloat16(sum / static_cast<float>(world)))
                                    : sum / static_cast<float>(world);
            CAPTURE(i);
            REQUIRE(flat[i] == (mine ? mean : g(comm.rank(), unit_of(sizes, i), i)));
          }
        }
      });
    }
  }
}

TEST_CASE("ReadinessTracker: buckets start in plan order, whatever order units become ready in") {
  std::vector<float> flat(40);
  const auto units = split(flat, {10, 10, 10, 10});
  const gradsync::BucketPlan plan(std::span<const std::span<float>>(units), 80, 80);
  REQUIRE(plan.size() == 2);  // units 2-3, then 0-1
  CHECK(plan.bucket_of(3) == 0);
  CHECK(plan.bucket_of(0) == 1);
  gradsync::ReadinessTracker t(plan);
  CHECK(t.mark_ready(0));
  CHECK(t.mark_ready(1));
  CHECK_FALSE(t.next_startable());  // bucket 1 is complete, bucket 0 is not
  CHECK_FALSE(t.mark_ready(1));     // twice
  CHECK(t.mark_ready(3));
  CHECK(t.mark_ready(2));
  REQUIRE(t.next_startable());
  CHECK(t.take_next() == 0);
  REQUIRE(t.next_startable());
  CHECK(t.take_next() == 1);
  CHECK_FALSE(t.next_startable());
  CHECK(t.started() == 2);
  t.reset_backward();
  CHECK(t.started() == 0);
  CHECK_FALSE(t.ready(0));
}

TEST_CASE("one progress worker per communicator: two users share it, and their jobs run in submission order") {
  gradsync::run_threads(3, [](Communicator<Threads>& comm) {
    std::weak_ptr<gradsync::ProgressWorker<Threads>> first;
    {
      auto p = gradsync::ProgressWorker<Threads>::shared(comm);
      auto q = gradsync::ProgressWorker<Threads>::shared(comm);
      CHECK(p == q);
      first = p;
      // Jobs from both holders, alternating; each is a collective of its own
      // size, so a different order on some rank would fail as a disagreement.
      std::vector<int> order;
      std::vector<std::vector<float>> data(8);
      std::vector<gradsync::Request> requests;
      for (int j = 0; j < 8; ++j) {
        data[static_cast<std::size_t>(j)].assign(static_cast<std::size_t>(j + 1) * 100, 1.0f);
        auto& worker = j % 2 ? *q : *p;
        requests.push_back(worker.submit("job " + std::to_string(j), [&, j](Communicator<Threads>& c) {
          gradsync::AllReduce<>{}(c, std::span<float>(data[static_cast<std::size_t>(j)]));
          order.push_back(j);
        }));
      }
      for (auto& r : requests) r.wait();
      CHECK(order == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7});
      for (const auto& d : data) CHECK(d.back() == 3.0f);

      // Two GradSyncs on one communicator, their buckets in flight together.
      std::vector<float> fa(64, float(comm.rank())), fb(48, float(comm.rank() + 1));
      GradSyncOptions o;
      o.first_bucket_cap_bytes = o.bucket_cap_bytes = 16 * sizeof(float);
      GradSync<Threads, float> a(comm, split(fa, {16, 16, 16, 16}), o);
      GradSync<Threads, float> b(comm, split(fb, {16, 16, 16}), o);
      CHECK(&a.progress_worker() == p.get());
      CHECK(&b.progress_worker() == p.get());
      for (std::size_t u = 4; u-- > 0;) {
        a.ready(u);
        if (u < 3) b.ready(u);
      }
      a.finish();
      b.finish();
      for (float x : fa) CHECK(x == 1.0f);  // (0 + 1 + 2) / 3
      for (float x : fb) CHECK(x == 2.0f);  // (1 + 2 + 3) / 3
    }
    // The last holder let go: the thread is joined, and the next user gets a new worker.
    CHECK(first.expired());
  });
}

}  // namespace test_train_grad_sync
