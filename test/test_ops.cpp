// Reduction ops on their own: integer Sum, Prod and Avg wrap modulo 2^bits on
// every algorithm (computed in the unsigned type, so UBSan stays silent), and
// the per-thread flush-denormals switch.
#include "support/at_worlds.hpp"
#include "support/common.hpp"
#include "support/sanitizers.hpp"
#include "support/world.hpp"

#include <doctest/doctest.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <future>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#include "gradsync/collectives.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_ops {

namespace gs = gradsync;
using namespace test;

namespace {

// Wrapping is checked in constant evaluation too, where signed overflow would
// not compile; narrow types would overflow int after promotion without the
// unsigned widening.
static_assert(gs::Sum::apply<std::int32_t>(std::numeric_limits<std::int32_t>::max(), 1) ==
              std::numeric_limits<std::int32_t>::min());
static_assert(gs::Sum::apply<std::int64_t>(std::numeric_limits<std::int64_t>::min(), -1) ==
              std::numeric_limits<std::int64_t>::max());
static_assert(gs::Prod::apply<std::int32_t>(65536, 65536) == 0);
static_assert(gs::Prod::apply<std::int32_t>(std::numeric_limits<std::int32_t>::min(), -1) ==
              std::numeric_limits<std::int32_t>::min());
static_assert(gs::Prod::apply<std::int64_t>(std::int64_t{1} << 62, 4) == 0);
static_assert(gs::Prod::apply<std::uint16_t>(65535, 65535) == 1);
static_assert(gs::Sum::apply<std::int8_t>(127, 1) == -128);
static_assert(gs::Avg::apply<std::int32_t>(std::numeric_limits<std::int32_t>::max(), 2) ==
              std::numeric_limits<std::int32_t>::min() + 1);
static_assert(gs::Avg::finish<std::int32_t>(-7, 2) == -3);
static_assert(gs::Avg::finish<std::int32_t>(std::numeric_limits<std::int32_t>::min(), 3) == -715827882);

/// Random bits over the whole range, with the edges mixed in often.
template <class T>
T draw(std::mt19937_64& g) {
  using L = std::numeric_limits<T>;
  switch (std::uniform_int_distribution<int>(0, 15)(g)) {
    case 0: return L::max();
    case 1: return L::min();
    case 2: return T(-1);
    case 3: return T(std::uniform_int_distribution<int>(-3, 3)(g));
    default: return static_cast<T>(g());
  }
}

/// The reference: the fold of element i over the ranks in the unsigned
/// type, converted back (modulo 2^bits), then Avg's truncating division.
template <class Op, class T>
T reference(const std::vector<std::vector<T>>& in, std::size_t i) {
  using U = std::make_unsigned_t<T>;
  U acc = static_cast<U>(in[0][i]);
  for (std::size_t q = 1; q < in.size(); ++q) {
    const U x = static_cast<U>(in[q][i]);
    acc = std::is_same_v<Op, gs::Prod> ? static_cast<U>(acc * x) : static_cast<U>(acc + x);
  }
  T r = static_cast<T>(acc);
  if constexpr (std::is_same_v<Op, gs::Avg>) r = static_cast<T>(r / static_cast<T>(in.size()));
  return r;
}

template <class T>
void check_equal(std::span<const T> got, std::span<const T> want, const std::string& where) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      FAIL_CHECK(where << ": element " << i << " of " << got.size() << " is " << got[i]
                       << ", the unsigned reference is " << want[i]);
      return;
    }
  }
}

template <class Op, class T>
void integer_all_reduce_wraps(std::mt19937_64& g, int n) {
  const auto world = static_cast<std::size_t>(n);
  // Below a SIMD block, its tail, not divisible by N, and long enough to pipeline.
  std::vector<std::vector<std::vector<T>>> in;
  std::vector<std::vector<T>> want;
  for (std::size_t count : {std::size_t{1}, std::size_t{7}, world * 12, std::size_t{1031}, std::size_t{20011}}) {
    in.emplace_back(world, std::vector<T>(count));
    for (auto& v : in.back())
      for (auto& x : v) x = draw<T>(g);
    want.emplace_back(count);
    for (std::size_t i = 0; i < count; ++i) want.back()[i] = reference<Op>(in.back(), i);
  }
  const std::vector<gs::Options> options{{}, {.chunk_bytes = 64}, {.deterministic = true}};
  // 64-byte chunks cut 20011 elements into over a thousand pieces a call,
  // each a handoff between ranks: under a sanitizer that one pair costs
  // most of this test, and 1031 elements already make 65 pieces.
  const auto runs = [&](std::size_t c, std::size_t o) {
    return !(test::sanitized && options[o].chunk_bytes == 64 && in[c][0].size() > 1031);
  };
  for_each_type(Algorithms{}, [&](auto algo) {
    using Algo = typename decltype(algo)::type;
    for (std::size_t o = 0; o < options.size(); ++o) {
      INFO("AllReduce<" << Algo::name << "> " << Op::name << " " << type_name<T>() << " N = " << n << ", options "
                        << o);
      std::vector<std::vector<std::vector<T>>> oop(in.size(), std::vector<std::vector<T>>(world));
      auto ip = in;
      for (std::size_t c = 0; c < in.size(); ++c)
        for (auto& v : oop[c]) v.assign(in[c][0].size(), T{});
      test::run_world(n, [&](auto& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        const gs::AllReduce<Algo> all_reduce{options[o]};
        for (std::size_t c = 0; c < in.size(); ++c) {
          if (!runs(c, o)) continue;
          all_reduce(comm, std::span<const T>(in[c][r]), std::span<T>(oop[c][r]), Op{});
          all_reduce(comm, std::span<T>(ip[c][r]), Op{});
        }
      });
      for (std::size_t c = 0; c < in.size(); ++c) {
        if (!runs(c, o)) continue;
        for (std::size_t r : test::local_ranks(n)) {
          const std::string where = "count " + std::to_string(want[c].size()) + ", rank " + std::to_string(r);
          check_equal<T>(oop[c][r], want[c], "out of place, " + where);
          check_equal<T>(ip[c][r], want[c], "in place, " + where);
        }
      }
    }
  });
}

template <class Op, class T>
void integer_reduce_scatter_wraps(std::mt19937_64& g, int n) {
  const auto world = static_cast<std::size_t>(n);
  const std::size_t m = 1031;
  std::vector<std::vector<T>> in(world, std::vector<T>(m * world));
  for (auto& v : in)
    for (auto& x : v) x = draw<T>(g);
  std::vector<T> want(m * world);
  for (std::size_t i = 0; i < want.size(); ++i) want[i] = reference<Op>(in, i);
  for_each_type(Algorithms{}, [&](auto algo) {
    using Algo = typename decltype(algo)::type;
    INFO("ReduceScatter<" << Algo::name << "> " << Op::name << " " << type_name<T>() << " N = " << n);
    std::vector<std::vector<T>> out(world, std::vector<T>(m));
    test::run_world(n, [&](auto& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      gs::ReduceScatter<Algo>{}(comm, std::span<const T>(in[r]), std::span<T>(out[r]), Op{});
    });
    for (std::size_t r : test::local_ranks(n)) {
      check_equal<T>(out[r], std::span<const T>(want).subspan(r * m, m), "rank " + std::to_string(r));
    }
  });
}

/// Whether 1e-20f * 1e-20f (1e-40, subnormal in float) came out as zero on
/// this thread. Volatile keeps the compiler from folding it; the bits are
/// compared, since a comparison with DAZ on reads a subnormal as zero.
bool product_flushed() {
  volatile float a = 1e-20f;
  volatile float b = 1e-20f;
  volatile float p = a * b;
  return std::bit_cast<std::uint32_t>(static_cast<float>(p)) == 0;
}

/// Whether a subnormal operand times one came out as zero (DAZ) on this thread.
bool operand_flushed() {
  volatile float s = std::numeric_limits<float>::denorm_min() * 1024;
  volatile float one = 1.0f;
  volatile float p = s * one;
  return std::bit_cast<std::uint32_t>(static_cast<float>(p)) == 0;
}

}  // namespace

// Avg is the wrapped sum divided by N, truncated toward zero.
// Under TSan a cross, not the grid, as in test_collectives.cpp: every op on
// int32 and Sum on int64. The wrapping is the element loop's, on one thread;
// the plain and ASan+UBSan builds run every pair.
TEST_CASE_TEMPLATE("integer Sum, Prod and Avg wrap modulo 2^bits on every algorithm", Op, gs::Sum, gs::Prod, gs::Avg) {
  at_worlds(std::string(Op::name) + " int32", {3, 5}, integer_all_reduce_wraps<Op, std::int32_t>);
  if (test::under_tsan && !std::is_same_v<Op, gs::Sum>) return;
  at_worlds(std::string(Op::name) + " int64", {3, 5}, integer_all_reduce_wraps<Op, std::int64_t>);
}

TEST_CASE("integer ReduceScatter wraps modulo 2^bits on every algorithm") {
  at_worlds("rs sum int32", {3, 5}, integer_reduce_scatter_wraps<gs::Sum, std::int32_t>);
  at_worlds("rs prod int64", {3, 5}, integer_reduce_scatter_wraps<gs::Prod, std::int64_t>);
}

TEST_CASE("set_flush_denormals flushes subnormal results and operands on this thread only") {
  gs::set_flush_denormals(false);
  REQUIRE_FALSE(product_flushed());
  REQUIRE_FALSE(operand_flushed());
  if (!gs::set_flush_denormals(true)) {
    MESSAGE("flush-denormals is not supported on this platform; nothing to check");
    gs::set_flush_denormals(false);
    return;
  }
  CHECK(product_flushed());
  CHECK(operand_flushed());
  // Normal values are untouched.
  volatile float x = 3.0f;
  CHECK(x * 0.5f == 1.5f);

  SUBCASE("FlushDenormals restores the state it found") {
    gs::set_flush_denormals(false);
    {
      gs::FlushDenormals flush;
      CHECK(flush.supported());
      CHECK(product_flushed());
      {
        gs::FlushDenormals keep(false);
        CHECK_FALSE(product_flushed());
      }
      CHECK(product_flushed());
    }
    CHECK_FALSE(product_flushed());
  }

  SUBCASE("another running thread keeps its own state") {
    gs::set_flush_denormals(false);
    std::promise<void> flushed_here, other_flushed;
    std::promise<bool> other_saw;
    std::future<void> go = flushed_here.get_future();
    std::thread other([&] {
      go.wait();
      other_saw.set_value(product_flushed());
      gs::set_flush_denormals(true);
      other_flushed.set_value();
    });
    gs::set_flush_denormals(true);
    flushed_here.set_value();
    CHECK_FALSE(other_saw.get_future().get());  // this thread's switch did not reach it
    gs::set_flush_denormals(false);
    other_flushed.get_future().wait();
    CHECK_FALSE(product_flushed());  // nor did its switch reach this thread
    other.join();
  }

  SUBCASE("each rank of run_threads sets its own") {
    gs::set_flush_denormals(false);
    std::vector<char> saw(3, 0);
    gs::run_threads(3, [&](gs::Communicator<gs::Threads>& comm) {
      const gs::FlushDenormals flush;
      saw[static_cast<std::size_t>(comm.rank())] = product_flushed();
    });
    for (char flushed : saw) CHECK(flushed);
    CHECK_FALSE(product_flushed());  // rank 0 ran here and restored it
  }
  gs::set_flush_denormals(false);
}

TEST_CASE("ThreadsOptions::flush_denormals flushes on every rank's thread and restores the caller's") {
  gs::set_flush_denormals(false);
  if (!gs::set_flush_denormals(true)) {
    MESSAGE("flush-denormals is not supported on this platform; nothing to check");
    gs::set_flush_denormals(false);
    return;
  }
  gs::set_flush_denormals(false);
  for (bool on : {true, false}) {
    std::vector<int> flushed(4, -1);
    gs::run_threads(4, gs::ThreadsOptions{.flush_denormals = on},
                    [&](gs::Communicator<gs::Threads>& comm) { flushed[static_cast<std::size_t>(comm.rank())] = product_flushed(); });
    CHECK(flushed == std::vector<int>(4, on ? 1 : 0));
    // Rank 0 ran on this thread; its setting did not outlive the run.
    CHECK_FALSE(product_flushed());
  }
}

}  // namespace test_ops
