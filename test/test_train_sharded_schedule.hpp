#pragma once
// What the ShardedTrainer tests share: the names they use, the test model's
// layers, random batches, a trainer's run on one rank (any backend: the
// Threads tests and the mpirun ones alike), and the two ways results are
// compared.

#include <doctest/doctest.h>

#include <gradsync/gradsync.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "test_train_model.hpp"

namespace test_schedule {

using namespace test_train::names;

constexpr std::size_t in = 4, out = 1;
/// Units of 25, 36, 7 and (aux) 1 elements: most not divisible by N = 2..4,
/// and one smaller than N.
inline const std::vector<std::size_t> layers{in, 5, 6, out};
inline const std::vector<std::size_t> unit_sizes{25, 36, 7, 1};

inline constexpr ShardingStrategy all_strategies[] = {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp,
                                                      ShardingStrategy::NoShard, ShardingStrategy::HybridShard};

/// HybridShard's group size in these tests: two groups where the world allows.
inline int hybrid_shard_size(int world) { return world == 4 ? 2 : world == 2 ? 1 : 0; }

/// `s` at `world` ranks, HybridShard in groups of hybrid_shard_size(world).
inline ShardedTrainerOptions options_for(ShardingStrategy s, int world) {
  ShardedTrainerOptions o;
  o.strategy = s;
  o.shard_size = s == ShardingStrategy::HybridShard ? hybrid_shard_size(world) : 0;
  return o;
}

inline Mlp<float> model_for(int rank) { return Mlp<float>{layers, static_cast<std::uint64_t>(rank) + 3, true}; }

/// One batch of `b` samples of normal random numbers.
inline Batch<float> random_batch(std::mt19937_64& rng, std::size_t b) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  Batch<float> batch;
  batch.size = b;
  for (std::size_t i = 0; i < b * in; ++i) batch.x.push_back(d(rng));
  for (std::size_t i = 0; i < b * out; ++i) batch.y.push_back(d(rng));
  return batch;
}

/// batches[s][r]: rank r's batch of step s.
using Batches = std::vector<std::vector<Batch<float>>>;

inline Batches random_batches(std::uint64_t seed, int steps, int world, std::size_t b) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<Batch<float>>> all(static_cast<std::size_t>(steps));
  for (auto& step : all) {
    for (int r = 0; r < world; ++r) step.push_back(random_batch(rng, b));
  }
  return all;
}

/// This rank's parameters after ReplicatedTrainer's steps on batches[s][rank].
template <class Comm, class Opt>
std::vector<float> replicated_parameters(Comm& comm, const Batches& batches, const Opt& opt, bool deterministic) {
  ReplicatedTrainerOptions o;
  o.sync.collective.deterministic = deterministic;
  ReplicatedTrainer trainer(comm, model_for(comm.rank()), opt, o);
  for (const auto& step : batches) trainer.step(step[static_cast<std::size_t>(comm.rank())]);
  return {trainer.parameters().begin(), trainer.parameters().end()};
}

/// This rank's gathered parameters after ShardedTrainer's steps on batches[s][rank].
template <class Comm, class Opt>
std::vector<float> sharded_parameters(Comm& comm, const Batches& batches, const Opt& opt,
                                      const ShardedTrainerOptions& o) {
  ShardedTrainer trainer(comm, model_for(comm.rank()), opt, o);
  for (const auto& step : batches) trainer.step(step[static_cast<std::size_t>(comm.rank())]);
  return trainer.full_parameters();
}

/// Rank 0's replicated_parameters on `world` threads.
template <class Opt>
std::vector<float> replicated_on_threads(const Batches& batches, int world, const Opt& opt, bool deterministic) {
  std::vector<float> result;
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    std::vector<float> mine = replicated_parameters(comm, batches, opt, deterministic);
    if (comm.rank() == 0) result = std::move(mine);
  });
  return result;
}

/// Every rank's sharded_parameters on `world` threads, in rank order.
template <class Opt>
std::vector<std::vector<float>> sharded_on_threads(const Batches& batches, int world, const Opt& opt,
                                                   const ShardedTrainerOptions& o) {
  std::vector<std::vector<float>> result(static_cast<std::size_t>(world));
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    result[static_cast<std::size_t>(comm.rank())] = sharded_parameters(comm, batches, opt, o);
  });
  return result;
}

using Trace = std::vector<gradsync::ShardedTraceEvent>;

/// " AG0 AG1 RS1 ...": a trace in one line.
inline std::string describe(const Trace& t) {
  std::string s;
  for (const auto& e : t) {
    s += e.collective == gradsync::Collective::all_gather       ? " AG"
         : e.collective == gradsync::Collective::reduce_scatter ? " RS"
         : e.collective == gradsync::Collective::all_reduce     ? " AR"
                                                      : " ??";
    s += std::to_string(e.unit);
  }
  return s;
}

/// The collectives of one step of model_for() (forward through its units in
/// order, backward in reverse) under `groups` wrapped units, without
/// prefetch, as the strategies define them: FullShard gathers each unit for
/// forward and again for backward, except the last one when kept; a unit's
/// reduction follows its last member's ready, which is its first member's.
inline Trace expected_trace(ShardingStrategy s, std::size_t groups, bool keep_last) {
  Trace t;
  if (s != ShardingStrategy::NoShard)
    for (std::size_t w = 0; w < groups; ++w) t.push_back({gradsync::Collective::all_gather, w});
  for (std::size_t w = groups; w-- > 0;) {
    switch (s) {
      case ShardingStrategy::NoShard: t.push_back({gradsync::Collective::all_reduce, w}); break;
      case ShardingStrategy::ShardGradOp: t.push_back({gradsync::Collective::reduce_scatter, w}); break;
      case ShardingStrategy::FullShard:
      case ShardingStrategy::HybridShard:
        if (!(keep_last && w + 1 == groups)) t.push_back({gradsync::Collective::all_gather, w});
        t.push_back({gradsync::Collective::reduce_scatter, w});
        if (s == ShardingStrategy::HybridShard) t.push_back({gradsync::Collective::all_reduce, w});
        break;
    }
  }
  return t;
}


/// At N = 1..4, deterministic off then on: 20 steps of fresh batches drawn
/// from `seed`, ReplicatedTrainer's result with `opt` on them, and then
/// `each(world, batches, replicated, deterministic)` checks sharded runs.
template <class Opt, class Each>
void for_each_parity_run(std::uint64_t seed, const Opt& opt, Each each) {
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    const Batches batches = random_batches(seed + static_cast<std::uint64_t>(world), 20, world, 3);
    for (const bool deterministic : {false, true}) {
      CAPTURE(deterministic);
      const std::vector<float> replicated = replicated_on_threads(batches, world, opt, deterministic);
      each(world, batches, replicated, deterministic);
    }
  }
}

/// The samples of `parts`, one after the other, as one batch.
inline Batch<float> concatenate(const std::vector<Batch<float>>& parts) {
  Batch<float> all;
  for (const auto& p : parts) {
    all.size += p.size;
    all.x.insert(all.x.end(), p.x.begin(), p.x.end());
    all.y.insert(all.y.end(), p.y.begin(), p.y.end());
  }
  return all;
}

/// Largest |a − b| / max(1, |b|): relative, with an absolute floor for values near zero.
inline double worst_relative(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::abs(double(a[i]) - double(b[i])) / std::max(1.0, std::abs(double(b[i]))));
  }
  return worst;
}

inline bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

/// Each of `world` threads runs `make(comm)` (which builds a trainer): the
/// InvalidArgument each threw ("" where none), within 2 s of a 5 s deadline,
/// so no rank waited for the others to time out.
template <class Make>
std::vector<std::string> construction_errors(int world, Make make) {
  std::vector<std::string> messages(static_cast<std::size_t>(world));
  gradsync::ThreadsOptions topt;
  topt.timeout = std::chrono::seconds(5);
  const auto t0 = std::chrono::steady_clock::now();
  gradsync::run_threads(world, topt, [&](Communicator<Threads>& comm) {
    try {
      make(comm);
    } catch (const gradsync::InvalidArgument& e) {
      messages[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(2));
  return messages;
}

/// Sharded parameters against ReplicatedTrainer's: within 1e-6 relative, and
/// bitwise when deterministic (but for HybridShard, which sums in two stages).
inline void check_matches_replicated(const std::vector<float>& sharded, const std::vector<float>& replicated,
                                     ShardingStrategy s, bool deterministic) {
  CHECK(worst_relative(sharded, replicated) <= 1e-6);
  if (deterministic && s != ShardingStrategy::HybridShard) CHECK(bitwise_equal(sharded, replicated));
}

/// A ShardedTrainer run with `o` on `world` threads: every rank gathers the
/// same parameters, and they match ReplicatedTrainer's `replicated`.
template <class Opt>
void check_sharded_run(const Batches& batches, int world, const Opt& opt, const ShardedTrainerOptions& o,
                       const std::vector<float>& replicated) {
  const std::vector<std::vector<float>> result = sharded_on_threads(batches, world, opt, o);
  for (const auto& r : result) CHECK(bitwise_equal(r, result[0]));
  check_matches_replicated(result[0], replicated, o.strategy, o.collective.deterministic);
}

}  // namespace test_schedule
