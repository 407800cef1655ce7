// Deterministic mode: AllReduce and ReduceScatter give, bit for bit, the
// rank-ordered left fold acc = x0; acc = acc + x1; ...; acc = acc + x(N-1),
// computed on one thread in the element type, for every algorithm and on every
// run. The data spans twelve decades, so any other order changes the bits.
// Built with GRADSYNC_TEST_MPI it runs under mpirun on the Mpi backend, which
// is how the Mpi results are shown bitwise equal to the Threads ones.
#include "support/at_worlds.hpp"
#include "support/common.hpp"
#include "support/values.hpp"
#include "support/world.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gradsync/collectives.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_deterministic {

namespace gs = gradsync;
using namespace test;

namespace {

/// The rank-ordered fold over all ranks, rounded to the element type at every
/// step (16-bit types through float), then Avg's division.
Values fold(const std::vector<Values>& in, gs::OpKind op) {
  Values acc = in[0];
  gs::visit(acc.type(), [&]<class T>(T) {
    std::span<T> a = acc.as<T>();
    for (std::size_t q = 1; q < in.size(); ++q) {
      std::span<const T> x = in[q].as<T>();
      for (std::size_t i = 0; i < a.size(); ++i) {
        if constexpr (is_half_v<T>) {
          a[i] = T(static_cast<float>(a[i]) + static_cast<float>(x[i]));
        } else {
          a[i] = a[i] + x[i];
        }
      }
    }
    if (op != gs::OpKind::avg) return;
    const float n = static_cast<float>(in.size());
    for (T& v : a) {
      if constexpr (is_half_v<T>) {
        v = T(static_cast<float>(v) / n);
      } else {
        v = static_cast<T>(v / n);
      }
    }
  });
  return acc;
}

std::vector<std::size_t> counts_for(int n) {
  // < N, N - 1, N + 1 (never divisible by N >= 2), primes, and a multiple of N.
  return {0, 1, static_cast<std::size_t>(n - 1), static_cast<std::size_t>(n + 1), 7, 13,
          static_cast<std::size_t>(12 * n), 1031};
}

/// results[c][r] of AllReduce (out of place, then in place) on every count.
template <class Algo>
void all_reduce_results(int n, gs::OpKind op, const std::vector<std::vector<Values>>& in, gs::Options opt,
                        std::vector<std::vector<Values>>& oop, std::vector<std::vector<Values>>& ip) {
  const auto world = static_cast<std::size_t>(n);
  oop.assign(in.size(), {});
  ip = in;
  for (std::size_t c = 0; c < in.size(); ++c) oop[c].assign(world, Values(in[c][0].type(), in[c][0].size()));
  test::run_world(n, [&](auto& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    const gs::AllReduce<Algo> all_reduce{opt};
    for (std::size_t c = 0; c < in.size(); ++c) {
      gs::visit(in[c][r].type(), [&]<class T>(T) {
        gs::visit(op, [&](auto o) {
          all_reduce(comm, in[c][r].as<T>(), oop[c][r].as<T>(), o);
          all_reduce(comm, ip[c][r].as<T>(), o);
        });
      });
    }
  });
}

template <class Algo>
std::vector<std::vector<Values>> reduce_scatter_results(int n, gs::OpKind op, const std::vector<std::vector<Values>>& in,
                                                        gs::Options opt) {
  const auto world = static_cast<std::size_t>(n);
  std::vector<std::vector<Values>> out(in.size());
  for (std::size_t c = 0; c < in.size(); ++c) out[c].assign(world, Values(in[c][0].type(), in[c][0].size() / world));
  test::run_world(n, [&](auto& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    const gs::ReduceScatter<Algo> reduce_scatter{opt};
    for (std::size_t c = 0; c < in.size(); ++c) {
      gs::visit(in[c][r].type(), [&]<class T>(T) {
        gs::visit(op, [&](auto o) { reduce_scatter(comm, in[c][r].as<T>(), out[c][r].as<T>(), o); });
      });
    }
  });
  return out;
}

void all_reduce_is_the_fold(gs::OpKind op, gs::DataType type) {
  const std::string salt = "all_reduce/" + std::string(gs::detail::name(op)) + "/" + std::string(gs::name(type));
  at_worlds(salt, {2, 3, 4, 5, 6, 7, 8}, [&](std::mt19937_64& g, int n) {
    std::vector<std::vector<Values>> in;
    std::vector<Values> want;
    for (std::size_t count : counts_for(n)) {
      in.push_back(draw_inputs(g, type, n, count, Draw::wide));
      want.push_back(fold(in.back(), op));
    }
    for (const std::size_t chunk : {std::size_t{0}, std::size_t{64}}) {
      for_each_type(Algorithms{}, [&](auto algo) {
        using Algo = typename decltype(algo)::type;
        for (int run = 0; run < 2; ++run) {
          INFO("AllReduce<" << Algo::name << "> " << gs::detail::name(op) << " " << gs::name(type) << " N = " << n
                            << ", chunk_bytes = " << chunk << ", run " << run);
          std::vector<std::vector<Values>> oop, ip;
          all_reduce_results<Algo>(n, op, in, {.deterministic = true, .chunk_bytes = chunk}, oop, ip);
          for (std::size_t c = 0; c < in.size(); ++c) {
            for (std::size_t r : test::local_ranks(n)) {
              const std::string where = "count " + std::to_string(want[c].size()) + ", rank " + std::to_string(r);
              check_bits(oop[c][r], want[c], "out of place, " + where);
              check_bits(ip[c][r], want[c], "in place, " + where);
            }
          }
        }
      });
    }
  });
}

void reduce_scatter_is_the_fold(gs::OpKind op, gs::DataType type) {
  const std::string salt = "reduce_scatter/" + std::string(gs::detail::name(op)) + "/" + std::string(gs::name(type));
  at_worlds(salt, {2, 3, 4, 5, 6, 7, 8}, [&](std::mt19937_64& g, int n) {
    const auto world = static_cast<std::size_t>(n);
    const std::vector<std::size_t> blocks{0, 1, 2, 7, 13, 101};
    std::vector<std::vector<Values>> in;
    std::vector<Values> want;
    for (std::size_t m : blocks) {
      in.push_back(draw_inputs(g, type, n, m * world, Draw::wide));
      want.push_back(fold(in.back(), op));
    }
    for_each_type(Algorithms{}, [&](auto algo) {
      using Algo = typename decltype(algo)::type;
      for (int run = 0; run < 2; ++run) {
        INFO("ReduceScatter<" << Algo::name << "> " << gs::detail::name(op) << " " << gs::name(type) << " N = " << n
                              << ", run " << run);
        const auto out = reduce_scatter_results<Algo>(n, op, in, {.deterministic = true});
        for (std::size_t c = 0; c < in.size(); ++c) {
          const std::size_t m = blocks[c];
          for (std::size_t r : test::local_ranks(n)) {
            check_bits(out[c][r], want[c].slice(r * m, m), "block " + std::to_string(m) + ", rank " + std::to_string(r));
          }
        }
      }
    });
  });
}

}  // namespace

TEST_CASE("deterministic AllReduce of float is the rank-ordered fold for every algorithm and run") {
  all_reduce_is_the_fold(gs::OpKind::sum, gs::DataType::float32);
  all_reduce_is_the_fold(gs::OpKind::avg, gs::DataType::float32);
}

TEST_CASE("deterministic AllReduce of bfloat16 rounds at every step of the rank-ordered fold") {
  all_reduce_is_the_fold(gs::OpKind::sum, gs::DataType::bfloat16);
  all_reduce_is_the_fold(gs::OpKind::avg, gs::DataType::bfloat16);
}

TEST_CASE("deterministic AllReduce of float16 rounds at every step of the rank-ordered fold") {
  all_reduce_is_the_fold(gs::OpKind::sum, gs::DataType::float16);
}

TEST_CASE("deterministic ReduceScatter is the rank-ordered fold for every algorithm and run") {
  reduce_scatter_is_the_fold(gs::OpKind::sum, gs::DataType::float32);
  reduce_scatter_is_the_fold(gs::OpKind::sum, gs::DataType::bfloat16);
  reduce_scatter_is_the_fold(gs::OpKind::avg, gs::DataType::float32);
  reduce_scatter_is_the_fold(gs::OpKind::sum, gs::DataType::float16);
}

TEST_CASE("deterministic bfloat16: 256 + 1 + 1 is 256 on every algorithm, not 258") {
  // 257 is a tie between 256 and 258 in bfloat16 and rounds to the even 256.
  if (!test::world_has(3)) return;
  for_each_type(Algorithms{}, [&](auto algo) {
    using Algo = typename decltype(algo)::type;
    INFO("AllReduce<" << Algo::name << ">");
    std::vector<std::vector<gs::bfloat16>> x(3);
    test::run_world(3, [&](auto& comm) {
      auto& v = x[static_cast<std::size_t>(comm.rank())];
      v.assign(5, gs::bfloat16(comm.rank() == 0 ? 256.0f : 1.0f));
      gs::AllReduce<Algo>{{.deterministic = true}}(comm, std::span<gs::bfloat16>(v));
    });
    for (std::size_t r : test::local_ranks(3))
      for (gs::bfloat16 b : x[r]) CHECK(static_cast<float>(b) == 256.0f);
  });
}

TEST_CASE("the data is wide enough that an unordered reduction changes the bits") {
  // Without this, the fold tests above could pass by luck of benign data.
  const std::uint64_t seed = test_seed();
  CAPTURE(seed);
  auto g = rng_for("teeth");
  const int n = 8;
  if (!test::world_has(n)) return;
  const std::vector<std::vector<Values>> in{draw_inputs(g, gs::DataType::float32, n, 1000, Draw::wide)};
  const Values want = fold(in[0], gs::OpKind::sum);
  std::vector<std::vector<Values>> oop, ip;
  all_reduce_results<gs::Ring>(n, gs::OpKind::sum, in, {}, oop, ip);
  std::size_t differ = 0;
  const std::size_t r = test::local_ranks(n).front();
  for (std::size_t i = 0; i < want.size(); ++i) differ += same_bits(oop[0][r].slice(i, 1), want.slice(i, 1)) ? 0 : 1;
  CHECK(differ > 0);
}

}  // namespace test_deterministic
