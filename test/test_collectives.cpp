// Every collective, every algorithm, op and element type, against a reference
// computed on one thread: in double for floating types, exactly in int64 for
// integers. World sizes 1..9 and counts chosen to be awkward (0, 1, N-1, N+1,
// primes), some with tiny chunks so the pipelines run many chunks at once.
// The same bodies run on Threads and, built with GRADSYNC_TEST_MPI, under
// mpirun on the Mpi backend (see support/world.hpp).
//
// The element type and the op are run-time values here (DataType, OpKind),
// made types only at the typed call (gs::visit); the inputs, references and
// checks are run-time typed and compiled once (support/values.cpp). That
// keeps this file's instantiations to one body per algorithm, and so its
// compile time (CI compiles it four times) small.
#include "support/at_worlds.hpp"
#include "support/common.hpp"
#include "support/sanitizers.hpp"
#include "support/values.hpp"
#include "support/world.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradsync/collectives.hpp"

// Everything in this file is in its own namespace: the Mpi suites compile it
// in one translation unit with other test files (test/mpi/meson.build).
namespace test_collectives {

namespace gs = gradsync;
using namespace test;

namespace {

constexpr gs::DataType all_types[] = {gs::DataType::float32, gs::DataType::float64, gs::DataType::int32,
                                      gs::DataType::int64,   gs::DataType::bfloat16, gs::DataType::float16};
constexpr gs::OpKind all_ops[] = {gs::OpKind::sum, gs::OpKind::avg, gs::OpKind::min, gs::OpKind::max, gs::OpKind::prod};
/// AllGather and Broadcast do not reduce: their specs carry Sum, unused.
/// ([[maybe_unused]]: each half of the split build uses only some helpers.)
[[maybe_unused]] constexpr gs::OpKind no_op[] = {gs::OpKind::sum};

/// Inputs for `op`: small factors for Prod, so that the product stays exact.
std::vector<Values> inputs_for(std::mt19937_64& g, gs::DataType type, int n, std::size_t count, gs::OpKind op) {
  return draw_inputs(g, type, n, count, op == gs::OpKind::prod ? Draw::factors : Draw::small);
}

/// n buffers of `count` elements, each filled with a value no result has.
std::vector<Values> sentinels(gs::DataType type, int n, std::size_t count) {
  std::vector<Values> v(static_cast<std::size_t>(n), Values(type, count));
  for (auto& x : v) x.fill(-3.0);
  return v;
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

/// Whether every local rank's buffer has the same bits as rank 0's (for
/// Mpi, compared through hashes gathered from every process).
[[maybe_unused]] void check_same_on_all_ranks(const std::vector<Values>& out, int n, const std::string& what) {
  std::vector<std::uint64_t> h(out.size());
  for (std::size_t r : test::local_ranks(n)) h[r] = test::hash_bytes(out[r].data(), out[r].size_bytes());
  const auto all = test::all_values(n, h);
  for (std::size_t r : test::local_ranks(n)) CHECK_MESSAGE(all[r] == all[0], what << ": rank " << r << " differs from rank 0");
}

/// Calls of one collective in one world: an element type, an op (unused by
/// AllGather and Broadcast), options, and one call per count.
struct Spec {
  gs::DataType type = gs::DataType::float32;
  gs::OpKind op = gs::OpKind::sum;
  std::vector<std::size_t> counts;
  gs::Options opt{};
};

/// "sum float, chunk_bytes = 64, deterministic = false" (no op for a
/// collective that does not reduce).
std::string describe(const Spec& s, bool reduces = true) {
  return (reduces ? std::string(gs::detail::name(s.op)) + " " : std::string()) + std::string(gs::name(s.type)) +
         ", chunk_bytes = " + std::to_string(s.opt.chunk_bytes) +
         ", deterministic = " + (s.opt.deterministic ? "true" : "false");
}

/// Under ThreadSanitizer (CI's TSan build) the world functions walk a
/// cross of ops and types instead of the whole grid: every type with the
/// first op, and every op on float32. The algorithms move bytes, so which
/// threads touch which memory, and when, does not depend on the element
/// type or the op; only the element loop does, and it runs on one thread.
/// TSan finds races, so the other pairs would repeat its work 3x over;
/// the plain and ASan+UBSan builds, where each (type, op) kernel can fail
/// alone (an int32 product overflowing, say), still run the whole grid.
constexpr bool cross_not_grid = test::under_tsan;

/// What one world size runs: every op and type on the awkward counts and
/// on tiny chunks, and in deterministic mode on `det_counts` (if any).
std::vector<Spec> world_specs(int n, std::span<const gs::OpKind> ops, const std::vector<std::size_t>& det_counts,
                              gs::Options det) {
  std::vector<Spec> specs;
  for (gs::OpKind op : ops) {
    for (gs::DataType type : all_types) {
      if (cross_not_grid && op != ops.front() && type != gs::DataType::float32) continue;
      specs.push_back({type, op, awkward_counts(n), {}});
      for (const auto& cc : chunk_cases(n)) specs.push_back({type, op, cc.counts, {.chunk_bytes = cc.chunk_bytes}});
      if (!det_counts.empty()) specs.push_back({type, op, det_counts, det});
    }
  }
  return specs;
}

// The world functions below run every spec's calls in one world (one
// run_world: threads are started once per world size, not once per call
// list), and are templates on the algorithm only: the element type and the
// op are run-time values, made types (gs::visit) just at the typed call, and
// the checks are compiled once (support/values.cpp).

/// Runs every spec's calls in one world: on each rank r, for each spec j in
/// order, call(comm, r, j, T{}) with the spec's element type as T.
template <class Call>
void run_specs(int n, const std::vector<Spec>& specs, Call call) {
  test::run_world(n, [&](auto& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    for (std::size_t j = 0; j < specs.size(); ++j) gs::visit(specs[j].type, [&](auto t) { call(comm, r, j, t); });
  });
}

/// AllReduce out of place and in place on every count of every spec.
template <class Algo>
void all_reduce_world(std::mt19937_64& g, int n, const std::vector<Spec>& specs) {
  // [spec][count][rank]
  std::vector<std::vector<std::vector<Values>>> in(specs.size()), oop(specs.size()), ip(specs.size());
  for (std::size_t j = 0; j < specs.size(); ++j) {
    for (std::size_t c : specs[j].counts) {
      in[j].push_back(inputs_for(g, specs[j].type, n, c, specs[j].op));
      oop[j].push_back(sentinels(specs[j].type, n, c));
      ip[j].push_back(in[j].back());
    }
  }
  if (!test::world_has(n)) return;
  const auto original = in;
  run_specs(n, specs, [&]<class T>(auto& comm, std::size_t r, std::size_t j, T) {
    const gs::AllReduce<Algo> all_reduce{specs[j].opt};
    gs::visit(specs[j].op, [&](auto o) {
      for (std::size_t c = 0; c < specs[j].counts.size(); ++c) {
        all_reduce(comm, std::as_const(in[j][c][r]).template as<T>(), oop[j][c][r].template as<T>(), o);
        all_reduce(comm, ip[j][c][r].template as<T>(), o);
      }
    });
  });
  for (std::size_t j = 0; j < specs.size(); ++j) {
    for (std::size_t c = 0; c < specs[j].counts.size(); ++c) {
      INFO("AllReduce<" << Algo::name << "> N = " << n << ", " << describe(specs[j]) << ", count = " << specs[j].counts[c]);
      const auto want = reference(in[j][c], specs[j].op);
      for (std::size_t r : test::local_ranks(n)) {
        const std::string rank = "rank " + std::to_string(r);
        check_close(oop[j][c][r], want, "out of place, " + rank);
        check_close(ip[j][c][r], want, "in place, " + rank);
        CHECK_MESSAGE(same_bits(in[j][c][r], original[j][c][r]), "out of place changed the input on " << rank);
      }
      // Every algorithm hands every rank the very same bits.
      check_same_on_all_ranks(oop[j][c], n, "out of place");
      check_same_on_all_ranks(ip[j][c], n, "in place");
    }
  }
}

/// ReduceScatter with a per-rank block of each count of every spec.
template <class Algo>
void reduce_scatter_world(std::mt19937_64& g, int n, const std::vector<Spec>& specs) {
  const auto world = static_cast<std::size_t>(n);
  std::vector<std::vector<std::vector<Values>>> in(specs.size()), out(specs.size());
  for (std::size_t j = 0; j < specs.size(); ++j) {
    for (std::size_t m : specs[j].counts) {
      in[j].push_back(inputs_for(g, specs[j].type, n, m * world, specs[j].op));
      out[j].push_back(sentinels(specs[j].type, n, m));
    }
  }
  if (!test::world_has(n)) return;
  run_specs(n, specs, [&]<class T>(auto& comm, std::size_t r, std::size_t j, T) {
    const gs::ReduceScatter<Algo> reduce_scatter{specs[j].opt};
    gs::visit(specs[j].op, [&](auto o) {
      for (std::size_t c = 0; c < specs[j].counts.size(); ++c) {
        reduce_scatter(comm, std::as_const(in[j][c][r]).template as<T>(), out[j][c][r].template as<T>(), o);
      }
    });
  });
  for (std::size_t j = 0; j < specs.size(); ++j) {
    for (std::size_t c = 0; c < specs[j].counts.size(); ++c) {
      const std::size_t m = specs[j].counts[c];
      INFO("ReduceScatter<" << Algo::name << "> N = " << n << ", " << describe(specs[j]) << ", block = " << m);
      const auto want = reference(in[j][c], specs[j].op);
      for (std::size_t r : test::local_ranks(n)) {
        check_close(out[j][c][r], std::span<const Expect>(want).subspan(r * m, m), "rank " + std::to_string(r));
      }
    }
  }
}

/// AllGather out of place and in place (in = out's own block).
template <class Algo>
void all_gather_world(std::mt19937_64& g, int n, const std::vector<Spec>& specs) {
  const auto world = static_cast<std::size_t>(n);
  std::vector<std::vector<std::vector<Values>>> in(specs.size()), oop(specs.size()), ip(specs.size());
  for (std::size_t j = 0; j < specs.size(); ++j) {
    for (std::size_t m : specs[j].counts) {
      in[j].push_back(draw_inputs(g, specs[j].type, n, m));
      oop[j].push_back(sentinels(specs[j].type, n, m * world));
      ip[j].push_back(oop[j].back());
      for (std::size_t r = 0; r < world; ++r) ip[j].back()[r].put(r * m, in[j].back()[r]);
    }
  }
  if (!test::world_has(n)) return;
  run_specs(n, specs, [&]<class T>(auto& comm, std::size_t r, std::size_t j, T) {
    const gs::AllGather<Algo> all_gather{specs[j].opt};
    for (std::size_t c = 0; c < specs[j].counts.size(); ++c) {
      const std::size_t m = specs[j].counts[c];
      all_gather(comm, std::as_const(in[j][c][r]).template as<T>(), oop[j][c][r].template as<T>());
      std::span<T> y = ip[j][c][r].template as<T>();
      all_gather(comm, std::span<const T>(y.subspan(r * m, m)), y);
    }
  });
  for (std::size_t j = 0; j < specs.size(); ++j) {
    for (std::size_t c = 0; c < specs[j].counts.size(); ++c) {
      const std::size_t m = specs[j].counts[c];
      INFO("AllGather<" << Algo::name << "> N = " << n << ", " << describe(specs[j], false) << ", block = " << m);
      Values want(specs[j].type, m * world);
      for (std::size_t q = 0; q < world; ++q) want.put(q * m, in[j][c][q]);
      for (std::size_t r : test::local_ranks(n)) {
        check_bits(oop[j][c][r], want, "out of place, rank " + std::to_string(r));
        check_bits(ip[j][c][r], want, "in place, rank " + std::to_string(r));
      }
    }
  }
}

/// Broadcast from every root; every rank starts with different data.
template <class Algo>
void broadcast_world(std::mt19937_64& g, int n, const std::vector<Spec>& specs) {
  const auto world = static_cast<std::size_t>(n);
  // buf[spec][count][root][rank]
  std::vector<std::vector<std::vector<std::vector<Values>>>> buf(specs.size());
  for (std::size_t j = 0; j < specs.size(); ++j) {
    buf[j].resize(specs[j].counts.size());
    for (std::size_t c = 0; c < specs[j].counts.size(); ++c)
      for (std::size_t root = 0; root < world; ++root)
        buf[j][c].push_back(draw_inputs(g, specs[j].type, n, specs[j].counts[c]));
  }
  if (!test::world_has(n)) return;
  const auto original = buf;
  run_specs(n, specs, [&]<class T>(auto& comm, std::size_t r, std::size_t j, T) {
    const gs::Broadcast<Algo> broadcast{specs[j].opt};
    for (std::size_t c = 0; c < specs[j].counts.size(); ++c)
      for (int root = 0; root < n; ++root)
        broadcast(comm, buf[j][c][static_cast<std::size_t>(root)][r].template as<T>(), root);
  });
  for (std::size_t j = 0; j < specs.size(); ++j) {
    for (std::size_t c = 0; c < specs[j].counts.size(); ++c) {
      for (std::size_t root = 0; root < world; ++root) {
        INFO("Broadcast<" << Algo::name << "> N = " << n << ", " << describe(specs[j], false) << ", count = "
                          << specs[j].counts[c] << ", root = " << root);
        for (std::size_t r : test::local_ranks(n)) {
          check_bits(buf[j][c][root][r], original[j][c][root][root], "rank " + std::to_string(r));
        }
      }
    }
  }
}

#define GRADSYNC_ALGORITHMS gs::Ring, gs::Tree, gs::RecursiveHalvingDoubling, gs::Native, gs::Auto

}  // namespace

TEST_CASE_TEMPLATE("AllReduce matches the reference for every op, type, world size 1..9 and count", Algo,
                   GRADSYNC_ALGORITHMS) {
  at_worlds("all_reduce/" + std::string(Algo::name), {1, 2, 3, 4, 5, 6, 7, 8, 9}, [](std::mt19937_64& g, int n) {
    const std::vector<std::size_t> det_counts{static_cast<std::size_t>(n - 1), static_cast<std::size_t>(n + 1), 101};
    all_reduce_world<Algo>(g, n, world_specs(n, all_ops, det_counts, {.deterministic = true, .chunk_bytes = 64}));
  });
}

TEST_CASE_TEMPLATE("ReduceScatter matches the reference for every op, type, world size 1..9 and count", Algo,
                   GRADSYNC_ALGORITHMS) {
  at_worlds("reduce_scatter/" + std::string(Algo::name), {1, 2, 3, 4, 5, 6, 7, 8, 9}, [](std::mt19937_64& g, int n) {
    reduce_scatter_world<Algo>(g, n, world_specs(n, all_ops, {1, 13}, {.deterministic = true}));
  });
}

TEST_CASE_TEMPLATE("AllGather out of place and in place for every type, world size 1..9 and count", Algo,
                   GRADSYNC_ALGORITHMS) {
  at_worlds("all_gather/" + std::string(Algo::name), {1, 2, 3, 4, 5, 6, 7, 8, 9}, [](std::mt19937_64& g, int n) {
    all_gather_world<Algo>(g, n, world_specs(n, no_op, {}, {}));
  });
}

TEST_CASE_TEMPLATE("Broadcast from every root for every type, world size 1..9 and count", Algo, GRADSYNC_ALGORITHMS) {
  at_worlds("broadcast/" + std::string(Algo::name), {1, 2, 3, 4, 5, 6, 7, 8, 9}, [](std::mt19937_64& g, int n) {
    broadcast_world<Algo>(g, n, world_specs(n, no_op, {}, {}));
  });
}

TEST_CASE_TEMPLATE("AllReduce of a million floats at N = 3 and 4", Algo, GRADSYNC_ALGORITHMS) {
  // A prime count: no world size divides it. Each rank's share spans two
  // or three chunks of the default 512 KiB, so the pipelines overlap
  // chunks. Under a sanitizer, a fifth of the count in quarter-size chunks
  // keeps that shape (two chunks a share) at a fifth of the cost.
  const std::size_t count = test::sanitized ? 200'003 : 1'000'003;
  const gs::Options options{.chunk_bytes = test::sanitized ? std::size_t{1} << 17 : 0};
  at_worlds("all_reduce_large/" + std::string(Algo::name), {3, 4}, [&](std::mt19937_64& g, int n) {
    all_reduce_world<Algo>(g, n, {{gs::DataType::float32, gs::OpKind::sum, {count}, options}});
  });
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
    std::vector<Spec> specs;
    for (gs::OpKind op : all_ops) specs.push_back({gs::data_type_v<T>, op, {first_long - 1, first_long}, {}});
    all_reduce_world<gs::RecursiveHalvingDoubling>(g, n, specs);
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
        std::vector<Values> out(world, Values(gs::DataType::float32, count));
        test::run_world(n, [&](auto& comm) {
          const auto r = static_cast<std::size_t>(comm.rank());
          const std::span<float> x = out[r].as<float>();
          for (std::size_t i = 0; i < count; ++i) x[i] = (r + i) % 2 ? -0.0f : 0.0f;
          gs::visit(op, [&](auto o) { gs::AllReduce<Algo>{}(comm, x, o); });
        });
        for (std::size_t r : test::local_ranks(n)) {
          const std::span<const float> x = std::as_const(out[r]).as<float>();
          CHECK_MESSAGE(std::all_of(x.begin(), x.end(), [](float v) { return v == 0.0f; }), "rank " << r);
        }
        check_same_on_all_ranks(out, n, "signed zeros");
      }
    }
  }
}

// Min and Max may not drop a NaN because of the order an algorithm meets the
// ranks' values in (std::min keeps its first operand when a comparison with
// NaN is false): a NaN on any rank is the result, and -0 is below +0, the
// same bits on every algorithm, type and world size.
template <class T, class Algo>
void check_min_max_order_free(int n, gs::OpKind op, std::size_t count, std::mt19937_64& rng) {
  if (!test::world_has(n)) return;
  const auto world = static_cast<std::size_t>(n);
  const bool is_min = op == gs::OpKind::min;
  // Inputs as doubles exactly representable in T: a NaN on one rank, zeros
  // of either sign on every rank, or eighths in [-12.5, 12.5].
  std::vector<std::vector<double>> in(world, std::vector<double>(count));
  std::vector<double> want(count);
  for (std::size_t i = 0; i < count; ++i) {
    const auto kind = rng() % 3;
    for (std::size_t r = 0; r < world; ++r) {
      in[r][i] = kind == 1 ? (rng() % 2 ? -0.0 : 0.0) : static_cast<double>(static_cast<int>(rng() % 201) - 100) / 8;
    }
    if (kind == 0) in[rng() % world][i] = std::numeric_limits<double>::quiet_NaN();
    double w = in[0][i];
    for (std::size_t r = 1; r < world; ++r) {
      const double x = in[r][i];
      if (std::isnan(w) || std::isnan(x)) {
        w = std::numeric_limits<double>::quiet_NaN();
      } else if (x == w) {
        w = (std::signbit(x) == is_min) ? x : w;
      } else {
        w = (is_min ? x < w : x > w) ? x : w;
      }
    }
    want[i] = w;
  }
  std::vector<Values> out(world, Values(gs::DataTypeOf<T>::value, count));
  test::run_world(n, [&](auto& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    const std::span<T> x = out[r].as<T>();
    for (std::size_t i = 0; i < count; ++i) {
      if constexpr (std::is_same_v<T, double>) {
        x[i] = in[r][i];
      } else {
        x[i] = T(static_cast<float>(in[r][i]));
      }
    }
    gs::visit(op, [&](auto o) { gs::AllReduce<Algo>{}(comm, x, o); });
  });
  for (std::size_t r : test::local_ranks(n)) {
    const std::span<const T> x = std::as_const(out[r]).template as<T>();
    std::size_t wrong = 0, first = count;
    for (std::size_t i = 0; i < count; ++i) {
      double g = 0;
      if constexpr (std::is_same_v<T, double>) {
        g = x[i];
      } else {
        g = static_cast<double>(static_cast<float>(x[i]));
      }
      const bool ok = std::isnan(want[i]) ? std::isnan(g) : g == want[i] && std::signbit(g) == std::signbit(want[i]);
      if (!ok && wrong++ == 0) first = i;
    }
    CHECK_MESSAGE(wrong == 0, "rank " << r << ": " << wrong << " wrong, the first at " << first);
  }
}

TEST_CASE_TEMPLATE("Min and Max: a NaN on any rank is the result and -0 is below +0, on every algorithm", Algo,
                   GRADSYNC_ALGORITHMS) {
  auto rng = test::rng_for("min max order free");
  CAPTURE(test::test_seed());
  // Sanitized, odd world sizes only (with and without RHD's fold).
  for (int n = test::sanitized ? 3 : 2; n <= 7; n += test::sanitized ? 2 : 1) {
    for (const gs::OpKind op : {gs::OpKind::max, gs::OpKind::min}) {
      for (const std::size_t count : {std::size_t{7}, std::size_t{5003}}) {
        INFO("AllReduce<" << Algo::name << "> " << gs::detail::name(op) << " N = " << n << " count = " << count);
        check_min_max_order_free<float, Algo>(n, op, count, rng);
        check_min_max_order_free<double, Algo>(n, op, count, rng);
        check_min_max_order_free<gs::bfloat16, Algo>(n, op, count, rng);
        check_min_max_order_free<gs::float16, Algo>(n, op, count, rng);
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

}  // namespace test_collectives
