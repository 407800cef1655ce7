// Every collective, every algorithm, op and element type, against a reference
// computed on one thread: in double for floating types, exactly in int64 for
// integers. World sizes 1..9 and counts chosen to be awkward (0, 1, N-1, N+1,
// primes), some with tiny chunks so the pipelines run many chunks at once.
// The same bodies run on Threads and, built with GRADSYNC_TEST_MPI, under
// mpirun on the Mpi backend (see support/world.hpp).
//
// The op is a run-time value here (OpKind), dispatched to the op type only
// at the call: it keeps this file's template instantiations, and so its
// compile time under the sanitizers, five times smaller.
#include "support/common.hpp"
#include "support/world.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "gradsync/gradsync.hpp"

namespace gs = gradsync;
using namespace test;

namespace {

using Types = List<float, double, std::int32_t, std::int64_t, gs::bfloat16, gs::float16>;
constexpr gs::OpKind all_ops[] = {gs::OpKind::sum, gs::OpKind::avg, gs::OpKind::min, gs::OpKind::max, gs::OpKind::prod};

/// Calls f(Op{}) with the op type of `kind`.
template <class F>
void with_op(gs::OpKind kind, F&& f) {
  switch (kind) {
    case gs::OpKind::sum: return f(gs::Sum{});
    case gs::OpKind::avg: return f(gs::Avg{});
    case gs::OpKind::min: return f(gs::Min{});
    case gs::OpKind::max: return f(gs::Max{});
    case gs::OpKind::prod: return f(gs::Prod{});
  }
}

/// Relative error of one rounding step.
template <class T>
constexpr double step_eps() {
  if constexpr (std::is_same_v<T, gs::bfloat16>) {
    return 1.0 / 256.0;
  } else if constexpr (std::is_same_v<T, gs::float16>) {
    return 1.0 / 2048.0;
  } else if constexpr (std::is_floating_point_v<T>) {
    return static_cast<double>(std::numeric_limits<T>::epsilon());
  } else {
    return 0.0;
  }
}

/// One input element. Integers stay small so sums are exact and a product over
/// nine ranks is at most 2^9; floats stay in [0.5, 1.5] in magnitude for Prod.
template <class T>
T draw(std::mt19937_64& g, gs::OpKind op) {
  if constexpr (std::is_integral_v<T>) {
    if (op == gs::OpKind::prod) {
      static constexpr T values[] = {1, 1, 2, 2, -1};
      return values[std::uniform_int_distribution<int>(0, 4)(g)];
    } else {
      return static_cast<T>(std::uniform_int_distribution<int>(-1000, 1000)(g));
    }
  } else {
    double v = 0;
    if (op == gs::OpKind::prod) {
      v = std::uniform_real_distribution<double>(0.5, 1.5)(g);
      if (std::uniform_int_distribution<int>(0, 3)(g) == 0) v = -v;
    } else {
      v = std::uniform_real_distribution<double>(-1.0, 1.0)(g);
    }
    if constexpr (std::is_same_v<T, double>) {
      return v;
    } else {
      return T(static_cast<float>(v));
    }
  }
}

/// inputs[r] for each of n ranks, `count` elements each.
template <class T>
std::vector<std::vector<T>> draw_inputs(std::mt19937_64& g, int n, std::size_t count,
                                        gs::OpKind op = gs::OpKind::sum) {
  std::vector<std::vector<T>> in(static_cast<std::size_t>(n), std::vector<T>(count));
  for (auto& v : in)
    for (auto& x : v) x = draw<T>(g, op);
  return in;
}

/// What one output element must be: within `tol` of `ref` (tol 0: exact).
struct Expect {
  double ref = 0;
  double tol = 0;
};

/// Element-wise reference of Op over the ranks' inputs. The tolerance grows
/// with N: N roundings, each at most eps relative to the partial result.
template <class T>
std::vector<Expect> reference(const std::vector<std::vector<T>>& in, gs::OpKind op) {
  using K = gs::OpKind;
  const std::size_t count = in.empty() ? 0 : in[0].size();
  const auto n = static_cast<double>(in.size());
  std::vector<Expect> want(count);
  for (std::size_t i = 0; i < count; ++i) {
    if constexpr (std::is_integral_v<T>) {
      std::int64_t acc = in[0][i];
      for (std::size_t q = 1; q < in.size(); ++q) {
        const std::int64_t x = in[q][i];
        if (op == K::sum || op == K::avg) acc += x;
        if (op == K::min) acc = std::min(acc, x);
        if (op == K::max) acc = std::max(acc, x);
        if (op == K::prod) acc *= x;
      }
      // C++ integer division truncates toward zero, as Avg promises.
      if (op == K::avg) acc /= static_cast<std::int64_t>(in.size());
      want[i] = {static_cast<double>(acc), 0.0};
    } else {
      constexpr double eps = step_eps<T>();
      double acc = to_double(in[0][i]);
      double abs_sum = std::fabs(acc);
      for (std::size_t q = 1; q < in.size(); ++q) {
        const double x = to_double(in[q][i]);
        abs_sum += std::fabs(x);
        if (op == K::sum || op == K::avg) acc += x;
        if (op == K::min) acc = std::min(acc, x);
        if (op == K::max) acc = std::max(acc, x);
        if (op == K::prod) acc *= x;
      }
      double tol = 0;
      if (op == K::sum) tol = 4 * n * eps * abs_sum;
      if (op == K::avg) {
        acc /= n;
        tol = 4 * eps * abs_sum + 2 * eps * std::fabs(acc);
      }
      if (op == K::prod) tol = 4 * n * eps * std::fabs(acc);
      want[i] = {acc, tol};
    }
  }
  return want;
}

/// Fails the current case at the first element of `got` that misses `want`.
template <class T>
void check_close(std::span<const T> got, std::span<const Expect> want, const std::string& where) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double v = to_double(got[i]);
    if (!(std::fabs(v - want[i].ref) <= want[i].tol)) {
      FAIL_CHECK(where << ": element " << i << " of " << got.size() << " is " << v << ", expected " << want[i].ref
                       << " +- " << want[i].tol);
      return;
    }
  }
}

template <class T>
bool same_bits(std::span<const T> a, std::span<const T> b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size_bytes()) == 0);
}

template <class T>
void check_bits(std::span<const T> got, std::span<const T> want, const std::string& where) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      FAIL_CHECK(where << ": element " << i << " of " << got.size() << " is " << to_double(got[i]) << ", expected "
                       << to_double(want[i]));
      return;
    }
  }
}

/// 0, 1, N-1, N+1 and a few primes, without repeats.
std::vector<std::size_t> awkward_counts(int n) {
  std::vector<std::size_t> c{0, 1, static_cast<std::size_t>(n - 1), static_cast<std::size_t>(n + 1), 7, 13, 101, 1031};
  std::sort(c.begin(), c.end());
  c.erase(std::unique(c.begin(), c.end()), c.end());
  return c;
}

/// Tiny chunks: a pipelined algorithm cuts each of these into many pieces.
/// 4 bytes is less than one double, which must still make progress.
struct ChunkCase {
  std::size_t chunk_bytes;
  std::vector<std::size_t> counts;
};
std::vector<ChunkCase> chunk_cases(int n) {
  return {{64, {static_cast<std::size_t>(n + 1), 101, 1031}}, {4, {37}}};
}

template <class T>
T sentinel() {
  return T(static_cast<float>(-3));
}

/// Whether every local rank's buffer has the same bits as rank 0's (for
/// Mpi, compared through hashes gathered from every process).
template <class T>
void check_same_on_all_ranks(const std::vector<std::vector<T>>& out, int n, const std::string& what) {
  std::vector<std::uint64_t> h(out.size());
  for (std::size_t r : test::local_ranks(n)) h[r] = test::hash_bytes(out[r].data(), out[r].size() * sizeof(T));
  const auto all = test::all_values(n, h);
  for (std::size_t r : test::local_ranks(n)) CHECK_MESSAGE(all[r] == all[0], what << ": rank " << r << " differs from rank 0");
}

/// AllReduce out of place and in place on every count, in one world.
template <class Algo, class T>
void all_reduce_case(std::mt19937_64& g, int n, gs::OpKind op, const std::vector<std::size_t>& counts, gs::Options opt) {
  const auto world = static_cast<std::size_t>(n);
  std::vector<std::vector<std::vector<T>>> in, oop, ip;
  for (std::size_t c : counts) {
    in.push_back(draw_inputs<T>(g, n, c, op));
    oop.emplace_back(world, std::vector<T>(c, sentinel<T>()));
    ip.push_back(in.back());
  }
  if (!test::world_has(n)) return;
  const auto original = in;
  test::run_world(n, [&](auto& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    const gs::AllReduce<Algo> all_reduce{opt};
    with_op(op, [&](auto o) {
      for (std::size_t c = 0; c < counts.size(); ++c) {
        all_reduce(comm, std::span<const T>(in[c][r]), std::span<T>(oop[c][r]), o);
        all_reduce(comm, std::span<T>(ip[c][r]), o);
      }
    });
  });
  for (std::size_t c = 0; c < counts.size(); ++c) {
    INFO("count = " << counts[c] << ", chunk_bytes = " << opt.chunk_bytes << ", deterministic = " << opt.deterministic);
    const auto want = reference(in[c], op);
    for (std::size_t r : test::local_ranks(n)) {
      const std::string rank = "rank " + std::to_string(r);
      check_close<T>(oop[c][r], want, "out of place, " + rank);
      check_close<T>(ip[c][r], want, "in place, " + rank);
      CHECK_MESSAGE(same_bits<T>(in[c][r], original[c][r]), "out of place changed the input on " << rank);
    }
    // Every algorithm hands every rank the very same bits.
    check_same_on_all_ranks(oop[c], n, "out of place");
    check_same_on_all_ranks(ip[c], n, "in place");
  }
}

/// ReduceScatter with a per-rank block of each count.
template <class Algo, class T>
void reduce_scatter_case(std::mt19937_64& g, int n, gs::OpKind op, const std::vector<std::size_t>& counts,
                         gs::Options opt) {
  const auto world = static_cast<std::size_t>(n);
  std::vector<std::vector<std::vector<T>>> in, out;
  for (std::size_t m : counts) {
    in.push_back(draw_inputs<T>(g, n, m * world, op));
    out.emplace_back(world, std::vector<T>(m, sentinel<T>()));
  }
  if (!test::world_has(n)) return;
  test::run_world(n, [&](auto& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    const gs::ReduceScatter<Algo> reduce_scatter{opt};
    with_op(op, [&](auto o) {
      for (std::size_t c = 0; c < counts.size(); ++c) {
        reduce_scatter(comm, std::span<const T>(in[c][r]), std::span<T>(out[c][r]), o);
      }
    });
  });
  for (std::size_t c = 0; c < counts.size(); ++c) {
    const std::size_t m = counts[c];
    INFO("block = " << m << ", chunk_bytes = " << opt.chunk_bytes << ", deterministic = " << opt.deterministic);
    const auto want = reference(in[c], op);
    for (std::size_t r : test::local_ranks(n)) {
      check_close<T>(out[c][r], std::span<const Expect>(want).subspan(r * m, m), "rank " + std::to_string(r));
    }
  }
}

/// AllGather out of place and in place (in = out's own block).
template <class Algo, class T>
void all_gather_case(std::mt19937_64& g, int n, const std::vector<std::size_t>& counts, gs::Options opt) {
  const auto world = static_cast<std::size_t>(n);
  std::vector<std::vector<std::vector<T>>> in, oop, ip;
  for (std::size_t m : counts) {
    in.push_back(draw_inputs<T>(g, n, m));
    oop.emplace_back(world, std::vector<T>(m * world, sentinel<T>()));
    ip.push_back(oop.back());
    for (std::size_t r = 0; r < world; ++r) std::copy(in.back()[r].begin(), in.back()[r].end(), ip.back()[r].begin() + static_cast<std::ptrdiff_t>(r * m));
  }
  if (!test::world_has(n)) return;
  test::run_world(n, [&](auto& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    const gs::AllGather<Algo> all_gather{opt};
    for (std::size_t c = 0; c < counts.size(); ++c) {
      const std::size_t m = counts[c];
      all_gather(comm, std::span<const T>(in[c][r]), std::span<T>(oop[c][r]));
      std::span<T> y(ip[c][r]);
      all_gather(comm, std::span<const T>(y.subspan(r * m, m)), y);
    }
  });
  for (std::size_t c = 0; c < counts.size(); ++c) {
    INFO("block = " << counts[c] << ", chunk_bytes = " << opt.chunk_bytes);
    std::vector<T> want;
    for (const auto& block : in[c]) want.insert(want.end(), block.begin(), block.end());
    for (std::size_t r : test::local_ranks(n)) {
      check_bits<T>(oop[c][r], want, "out of place, rank " + std::to_string(r));
      check_bits<T>(ip[c][r], want, "in place, rank " + std::to_string(r));
    }
  }
}

/// Broadcast from every root; every rank starts with different data.
template <class Algo, class T>
void broadcast_case(std::mt19937_64& g, int n, const std::vector<std::size_t>& counts, gs::Options opt) {
  const auto world = static_cast<std::size_t>(n);
  // buf[c][root][rank]
  std::vector<std::vector<std::vector<std::vector<T>>>> buf(counts.size());
  for (std::size_t c = 0; c < counts.size(); ++c)
    for (std::size_t root = 0; root < world; ++root) buf[c].push_back(draw_inputs<T>(g, n, counts[c]));
  if (!test::world_has(n)) return;
  const auto original = buf;
  test::run_world(n, [&](auto& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    const gs::Broadcast<Algo> broadcast{opt};
    for (std::size_t c = 0; c < counts.size(); ++c)
      for (int root = 0; root < n; ++root) broadcast(comm, std::span<T>(buf[c][static_cast<std::size_t>(root)][r]), root);
  });
  for (std::size_t c = 0; c < counts.size(); ++c) {
    for (std::size_t root = 0; root < world; ++root) {
      INFO("count = " << counts[c] << ", root = " << root << ", chunk_bytes = " << opt.chunk_bytes);
      for (std::size_t r : test::local_ranks(n)) {
        check_bits<T>(buf[c][root][r], original[c][root][root], "rank " + std::to_string(r));
      }
    }
  }
}

#define GRADSYNC_ALGORITHMS gs::Ring, gs::Tree, gs::RecursiveHalvingDoubling, gs::Native, gs::Auto

}  // namespace

// The file builds as one suite, or as two halves (GRADSYNC_TEST_PART 1:
// all-reduce, 2: the rest) that compile in parallel; CI compiles it three
// times, under two sanitizers.
#if !defined(GRADSYNC_TEST_PART) || GRADSYNC_TEST_PART == 1
TEST_CASE_TEMPLATE("AllReduce matches the reference for every op, type, world size 1..9 and count", Algo,
                   GRADSYNC_ALGORITHMS) {
  const std::uint64_t seed = test_seed();
  CAPTURE(seed);
  auto g = rng_for("all_reduce/" + std::string(Algo::name));
  for (gs::OpKind op : all_ops) {
    for_each_type(Types{}, [&](auto type) {
      using T = typename decltype(type)::type;
      for (int n = 1; n <= 9; ++n) {
        INFO("AllReduce<" << Algo::name << "> " << gs::detail::name(op) << " " << type_name<T>() << " N = " << n);
        all_reduce_case<Algo, T>(g, n, op, awkward_counts(n), {});
        for (const auto& cc : chunk_cases(n)) all_reduce_case<Algo, T>(g, n, op, cc.counts, {.chunk_bytes = cc.chunk_bytes});
        const std::vector<std::size_t> det_counts{static_cast<std::size_t>(n - 1), static_cast<std::size_t>(n + 1), 101};
        all_reduce_case<Algo, T>(g, n, op, det_counts, {.deterministic = true, .chunk_bytes = 64});
      }
    });
  }
}

#endif

#if !defined(GRADSYNC_TEST_PART) || GRADSYNC_TEST_PART == 2
TEST_CASE_TEMPLATE("ReduceScatter matches the reference for every op, type, world size 1..9 and count", Algo,
                   GRADSYNC_ALGORITHMS) {
  const std::uint64_t seed = test_seed();
  CAPTURE(seed);
  auto g = rng_for("reduce_scatter/" + std::string(Algo::name));
  for (gs::OpKind op : all_ops) {
    for_each_type(Types{}, [&](auto type) {
      using T = typename decltype(type)::type;
      for (int n = 1; n <= 9; ++n) {
        INFO("ReduceScatter<" << Algo::name << "> " << gs::detail::name(op) << " " << type_name<T>() << " N = " << n);
        reduce_scatter_case<Algo, T>(g, n, op, awkward_counts(n), {});
        for (const auto& cc : chunk_cases(n)) reduce_scatter_case<Algo, T>(g, n, op, cc.counts, {.chunk_bytes = cc.chunk_bytes});
        reduce_scatter_case<Algo, T>(g, n, op, {1, 13}, {.deterministic = true});
      }
    });
  }
}

TEST_CASE_TEMPLATE("AllGather out of place and in place for every type, world size 1..9 and count", Algo,
                   GRADSYNC_ALGORITHMS) {
  const std::uint64_t seed = test_seed();
  CAPTURE(seed);
  auto g = rng_for("all_gather/" + std::string(Algo::name));
  for_each_type(Types{}, [&](auto type) {
    using T = typename decltype(type)::type;
    for (int n = 1; n <= 9; ++n) {
      INFO("AllGather<" << Algo::name << "> " << type_name<T>() << " N = " << n);
      all_gather_case<Algo, T>(g, n, awkward_counts(n), {});
      for (const auto& cc : chunk_cases(n)) all_gather_case<Algo, T>(g, n, cc.counts, {.chunk_bytes = cc.chunk_bytes});
    }
  });
}

TEST_CASE_TEMPLATE("Broadcast from every root for every type, world size 1..9 and count", Algo, GRADSYNC_ALGORITHMS) {
  const std::uint64_t seed = test_seed();
  CAPTURE(seed);
  auto g = rng_for("broadcast/" + std::string(Algo::name));
  for_each_type(Types{}, [&](auto type) {
    using T = typename decltype(type)::type;
    for (int n = 1; n <= 9; ++n) {
      INFO("Broadcast<" << Algo::name << "> " << type_name<T>() << " N = " << n);
      broadcast_case<Algo, T>(g, n, awkward_counts(n), {});
      for (const auto& cc : chunk_cases(n)) broadcast_case<Algo, T>(g, n, cc.counts, {.chunk_bytes = cc.chunk_bytes});
    }
  });
}

#endif

#if !defined(GRADSYNC_TEST_PART) || GRADSYNC_TEST_PART == 1
TEST_CASE_TEMPLATE("AllReduce of a million floats at N = 3 and 4", Algo, GRADSYNC_ALGORITHMS) {
  const std::uint64_t seed = test_seed();
  CAPTURE(seed);
  auto g = rng_for("all_reduce_large/" + std::string(Algo::name));
  // A prime count: no world size divides it.
  for (int n : {3, 4}) {
    INFO("AllReduce<" << Algo::name << "> sum float N = " << n);
    all_reduce_case<Algo, float>(g, n, gs::OpKind::sum, {1'000'003}, {});
  }
}

// RHD's all-reduce runs recursive doubling on whole buffers below the size
// where the backend's cost model says Rabenseifner wins, and Rabenseifner
// above: both sides of that switch, for every world size and op.
TEST_CASE_TEMPLATE("RecursiveHalvingDoubling all-reduce is right on both sides of its short-path switch", T, float,
                   double) {
  const std::uint64_t seed = test_seed();
  CAPTURE(seed);
  auto g = rng_for("rhd_switch/" + std::string(type_name<T>()));
  const gs::CostModel& m = gs::cost_model<test::Backend>();
  for (int n = 2; n <= 9; ++n) {
    std::size_t first_long = 0;
    for (std::size_t c = 1; c <= (std::size_t{1} << 20); ++c) {
      if (!gs::detail::rhd_all_reduce_short(n, static_cast<double>(c * sizeof(T)), m)) {
        first_long = c;
        break;
      }
    }
    INFO("N = " << n << ", first count on the halving path: " << first_long);
    REQUIRE(first_long > 1);
    for (gs::OpKind op : all_ops) {
      all_reduce_case<gs::RecursiveHalvingDoubling, T>(g, n, op, {first_long - 1, first_long}, {});
    }
  }
}

// Max and min of +0 and -0 depend on the operand order, so an algorithm in
// which ranks reduce separately (RHD's short recursive doubling) must order
// operands the same way on every rank. Counts on both sides of the short
// path's switch, world sizes with and without a fold.
TEST_CASE_TEMPLATE("AllReduce hands every rank the same bits for max and min of signed zeros", Algo,
                   GRADSYNC_ALGORITHMS) {
  for (int n = 2; n <= 9; ++n) {
    if (!test::world_has(n)) continue;
    for (const gs::OpKind op : {gs::OpKind::max, gs::OpKind::min}) {
      for (const std::size_t count : {std::size_t{1}, std::size_t{7}, std::size_t{1031}, std::size_t{20011}}) {
        INFO("AllReduce<" << Algo::name << "> " << gs::detail::name(op) << " float N = " << n << " count = " << count);
        const auto world = static_cast<std::size_t>(n);
        std::vector<std::vector<float>> out(world, std::vector<float>(count));
        test::run_world(n, [&](auto& comm) {
          const auto r = static_cast<std::size_t>(comm.rank());
          for (std::size_t i = 0; i < count; ++i) out[r][i] = (r + i) % 2 ? -0.0f : 0.0f;
          with_op(op, [&](auto o) { gs::AllReduce<Algo>{}(comm, std::span<float>(out[r]), o); });
        });
        for (std::size_t r : test::local_ranks(n)) {
          CHECK_MESSAGE(std::all_of(out[r].begin(), out[r].end(), [](float x) { return x == 0.0f; }), "rank " << r);
        }
        check_same_on_all_ranks(out, n, "signed zeros");
      }
    }
  }
}

TEST_CASE("AllReduce accepts any contiguous range and defaults to Auto and Sum") {
  if (!test::world_has(4)) return;
  std::vector<std::vector<std::int64_t>> sums(4);
  std::vector<std::vector<double>> maxes(4);
  test::run_world(4, [&](auto& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    sums[r].assign(5, comm.rank() + 1);
    gs::AllReduce<>{}(comm, sums[r]);
    maxes[r].assign(3, 0.5 * comm.rank());
    gs::AllReduce<gs::Ring>{}(comm, maxes[r], gs::Max{});
  });
  for (std::size_t r : test::local_ranks(4)) {
    CHECK(sums[r] == std::vector<std::int64_t>(5, 10));
    CHECK(maxes[r] == std::vector<double>(3, 1.5));
  }
}
#endif
