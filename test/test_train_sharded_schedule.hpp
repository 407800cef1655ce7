#pragma once
// What the ShardedTrainer tests share: the names they use, the test model's
// layers, random batches, a trainer's run on one rank (any backend: the
// Threads tests and the mpirun ones alike), and the two ways results are
// compared.

#include <gradsync/gradsync.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "test_train_model.hpp"

namespace test_schedule {

using gradsync::Communicator;
using gradsync::ReplicatedTrainer;
using gradsync::ReplicatedTrainerOptions;
using gradsync::ShardedTrainer;
using gradsync::ShardedTrainerOptions;
using gradsync::ShardingStrategy;
using gradsync::Threads;
using test_train::Batch;
using test_train::Mlp;

constexpr std::size_t in = 4, out = 1;
/// Units of 25, 36, 7 and (aux) 1 elements: most not divisible by N = 2..4,
/// and one smaller than N.
inline const std::vector<std::size_t> layers{in, 5, 6, out};
inline const std::vector<std::size_t> unit_sizes{25, 36, 7, 1};

inline constexpr ShardingStrategy all_strategies[] = {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp,
                                                      ShardingStrategy::NoShard, ShardingStrategy::HybridShard};

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
inline std::vector<std::vector<Batch<float>>> random_batches(std::uint64_t seed, int steps, int world, std::size_t b) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<Batch<float>>> all(static_cast<std::size_t>(steps));
  for (auto& step : all) {
    for (int r = 0; r < world; ++r) step.push_back(random_batch(rng, b));
  }
  return all;
}

/// batches[s][r]: rank r's batch of step s.
using Batches = std::vector<std::vector<Batch<float>>>;

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

}  // namespace test_schedule
