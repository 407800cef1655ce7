// ReplicatedTrainer: the DDP semantics of issue 6, each one a test.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <gradsync/gradsync.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <vector>

#include "test_train_model.hpp"

using gradsync::Communicator;
using gradsync::ReplicatedTrainer;
using gradsync::ReplicatedTrainerOptions;
using gradsync::Threads;
using test_train::Batch;
using test_train::make_batch;
using test_train::Mlp;

namespace {

constexpr std::size_t in = 5, out = 3;
const std::vector<std::size_t> layers{in, 16, 12, out};

Mlp<float> model_for(int rank, bool aux = false) {
  return Mlp<float>{layers, static_cast<std::uint64_t>(rank) + 7, aux, {}};
}

gradsync::Sgd<float> momentum_sgd() { return gradsync::Sgd<float>({.lr = 0.2, .momentum = 0.9}); }

/// Final parameters of rank 0 after `steps` steps where rank r of `world`
/// trains on samples [s·world·b + r·b, +b) of step s.
template <class Opt>
std::vector<float> train(int world, std::size_t b, int steps, Opt opt, ReplicatedTrainerOptions o = {},
                         std::vector<std::vector<float>>* per_rank = nullptr) {
  std::vector<std::vector<float>> params(static_cast<std::size_t>(world));
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    ReplicatedTrainer trainer(comm, model_for(comm.rank()), opt, o);
    const auto r = static_cast<std::size_t>(comm.rank());
    for (int s = 0; s < steps; ++s) {
      trainer.step(make_batch<float>((static_cast<std::size_t>(s) * world + r) * b, b, in, out));
    }
    params[r].assign(trainer.parameters().begin(), trainer.parameters().end());
  });
  if (per_rank) *per_rank = params;
  return params[0];
}

/// |a − b| within what float summation in another order can explain.
void check_close(const std::vector<float>& a, const std::vector<float>& b, float tol) {
  REQUIRE(a.size() == b.size());
  float worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]) / (1.0f + std::abs(b[i])));
  CHECK(worst <= tol);
}

}  // namespace

TEST_CASE("start: construction broadcasts rank 0's parameters and buffers") {
  std::vector<std::vector<float>> params(3), buffers(3);
  gradsync::run_threads(3, [&](Communicator<Threads>& comm) {
    ReplicatedTrainer trainer(comm, model_for(comm.rank()), momentum_sgd());
    const auto r = static_cast<std::size_t>(comm.rank());
    params[r].assign(trainer.parameters().begin(), trainer.parameters().end());
    buffers[r].assign(trainer.buffers().begin(), trainer.buffers().end());
  });
  // What rank 0's model initialises itself to, without any trainer.
  std::vector<float> p0;
  gradsync::run_threads(1, [&](Communicator<Threads>& comm) {
    ReplicatedTrainer trainer(comm, model_for(0), momentum_sgd());
    p0.assign(trainer.parameters().begin(), trainer.parameters().end());
  });
  CHECK(params[0] == p0);
  CHECK(params[1] == p0);
  CHECK(params[2] == p0);
  CHECK(buffers[1] == std::vector<float>{7.0f});
  CHECK(buffers[2] == std::vector<float>{7.0f});
}

TEST_CASE("averaging: N ranks with batch b train as 1 rank with batch N*b") {
  for (int world : {2, 3}) {
    CAPTURE(world);
    const auto single = train(1, static_cast<std::size_t>(world) * 4, 6, momentum_sgd());
    const auto multi = train(world, 4, 6, momentum_sgd());
    check_close(multi, single, 2e-5f);
    const auto single_adam = train(1, static_cast<std::size_t>(world) * 4, 6, gradsync::Adam<float>({.lr = 0.01}));
    const auto multi_adam = train(world, 4, 6, gradsync::Adam<float>({.lr = 0.01}));
    check_close(multi_adam, single_adam, 1e-4f);
  }
}

TEST_CASE("replicas stay bit-identical after every step") {
  std::vector<std::vector<std::vector<float>>> history(3);
  gradsync::run_threads(3, [&](Communicator<Threads>& comm) {
    ReplicatedTrainer trainer(comm, model_for(comm.rank()), gradsync::AdamW<float>());
    const auto r = static_cast<std::size_t>(comm.rank());
    for (std::size_t s = 0; s < 5; ++s) {
      trainer.step(make_batch<float>((s * 3 + r) * 5, 5, in, out));
      history[r].emplace_back(trainer.parameters().begin(), trainer.parameters().end());
    }
  });
  for (std::size_t s = 0; s < 5; ++s) {
    CHECK(history[1][s] == history[0][s]);
    CHECK(history[2][s] == history[0][s]);
  }
  CHECK(history[0][4] != history[0][0]);
}

TEST_CASE("the debug replica check throws on every rank, naming the first rank that differs") {
  ReplicatedTrainerOptions o;
  o.check_replicas_every = 1;
  CHECK_THROWS_WITH_AS(gradsync::run_threads(4,
                                             [&](Communicator<Threads>& comm) {
                                               ReplicatedTrainer trainer(comm, model_for(comm.rank()),
                                                                         momentum_sgd(), o);
                                               for (std::size_t s = 0; s < 4; ++s) {
                                                 // A bug outside the trainer changes two replicas.
                                                 if (s == 2 && comm.rank() >= 2) trainer.parameters()[3] += 1e-6f;
                                                 trainer.step(make_batch<float>(s * 8, 2, in, out));
                                               }
                                             }),
                       doctest::Contains("rank 2's parameters differ from rank 0's"), gradsync::Error);
}

TEST_CASE("buckets: results do not depend on bucket size (deterministic reductions: bitwise)") {
  ReplicatedTrainerOptions small, large;
  small.sync.first_bucket_cap_bytes = 64;
  small.sync.bucket_cap_bytes = 256;
  small.sync.collective.deterministic = large.sync.collective.deterministic = true;
  std::vector<std::vector<float>> a, b;
  train(3, 4, 4, momentum_sgd(), small, &a);
  train(3, 4, 4, momentum_sgd(), large, &b);
  CHECK(a[0] == b[0]);
  CHECK(a[2] == b[2]);
  // And the small buckets really were several, launched during backward.
  gradsync::run_threads(2, [&](Communicator<Threads>& comm) {
    ReplicatedTrainer trainer(comm, model_for(comm.rank()), momentum_sgd(), small);
    CHECK(trainer.grad_sync().buckets().size() >= 3);
    trainer.step(make_batch<float>(0, 4, in, out));
    CHECK(trainer.grad_sync().stats().buckets_launched_early == trainer.grad_sync().buckets().size());
  });
}

TEST_CASE("accumulation: K-1 accumulate() + step() on N ranks equal one step on K*N*b samples") {
  constexpr int K = 3, world = 2;
  constexpr std::size_t b = 4;
  std::vector<float> multi;
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    ReplicatedTrainer trainer(comm, model_for(comm.rank()), momentum_sgd());
    const auto r = static_cast<std::size_t>(comm.rank());
    for (std::size_t s = 0; s < 2; ++s) {
      const auto seq = comm.sequence();
      for (std::size_t k = 0; k + 1 < K; ++k) trainer.accumulate(make_batch<float>(((s * K + k) * world + r) * b, b, in, out));
      CHECK(comm.sequence() == seq);  // no communication in the micro-steps
      trainer.step(make_batch<float>(((s * K + K - 1) * world + r) * b, b, in, out));
      CHECK(comm.sequence() > seq);
    }
    if (r == 0) multi.assign(trainer.parameters().begin(), trainer.parameters().end());
  });
  const auto single = train(1, K * world * b, 2, momentum_sgd());
  check_close(multi, single, 2e-5f);
}

TEST_CASE("compression: bf16 gradients train within bfloat16 tolerance of the uncompressed path") {
  ReplicatedTrainerOptions bf16;
  bf16.sync.compression = gradsync::Compression::bf16;
  std::vector<std::vector<float>> plain_ranks, bf16_ranks;
  const auto plain = train(3, 4, 3, gradsync::Sgd<float>({.lr = 0.1}), {}, &plain_ranks);
  const auto compressed = train(3, 4, 3, gradsync::Sgd<float>({.lr = 0.1}), bf16, &bf16_ranks);
  // Each gradient element carries ~2^-8 relative error; three steps of lr 0.1.
  check_close(compressed, plain, 3 * 0.1f * std::ldexp(1.0f, -7));
  CHECK(compressed != plain);
  CHECK(bf16_ranks[1] == bf16_ranks[0]);
  CHECK(bf16_ranks[2] == bf16_ranks[0]);
}

TEST_CASE("unused parameters: zeros with find_unused_parameters, a clear error without") {
  // Rank 1's batches never use the auxiliary unit.
  auto body = [](ReplicatedTrainerOptions o, std::vector<std::vector<float>>* result_ptr) {
    return [o, result = result_ptr](Communicator<Threads>& comm) {
      ReplicatedTrainer trainer(comm, model_for(comm.rank(), true), gradsync::Sgd<float>({.lr = 0.1}), o);
      for (std::size_t s = 0; s < 3; ++s) {
        auto batch = make_batch<float>(s * 8 + static_cast<std::size_t>(comm.rank()) * 4, 4, in, out);
        batch.skip_aux = comm.rank() == 1;
        trainer.step(batch);
      }
      if (result) (*result)[static_cast<std::size_t>(comm.rank())].assign(trainer.parameters().begin(), trainer.parameters().end());
    };
  };
  ReplicatedTrainerOptions on;
  on.sync.find_unused_parameters = true;
  std::vector<std::vector<float>> params(3);
  gradsync::run_threads(3, body(on, &params));
  CHECK(params[1] == params[0]);
  CHECK(params[2] == params[0]);
  const auto t0 = std::chrono::steady_clock::now();
  gradsync::ThreadsOptions topt;
  topt.timeout = std::chrono::seconds(120);
  CHECK_THROWS_WITH_AS(gradsync::run_threads(3, topt, body({}, nullptr)),
                       doctest::Contains("no gradient for unit 3 ('aux')"), gradsync::InvalidArgument);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));
}

TEST_CASE("uneven inputs: join lets ranks with less data finish cleanly; each step averages the ranks with data") {
  constexpr int world = 3;
  constexpr std::size_t b = 4;
  // Rank r has 2 + r batches; step s draws from samples [s*world*b + r*b, +b).
  ReplicatedTrainerOptions o;
  o.join = true;
  o.check_replicas_every = 1;
  std::vector<std::vector<float>> params(world);
  std::vector<std::size_t> steps(world);
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    ReplicatedTrainer trainer(comm, model_for(comm.rank()), momentum_sgd(), o);
    const auto r = static_cast<std::size_t>(comm.rank());
    for (std::size_t s = 0; s < 2 + r; ++s) trainer.step(make_batch<float>((s * world + r) * b, b, in, out));
    trainer.join();
    params[r].assign(trainer.parameters().begin(), trainer.parameters().end());
    steps[r] = trainer.stats().steps;
  });
  CHECK(steps == std::vector<std::size_t>{4, 4, 4});
  CHECK(params[1] == params[0]);
  CHECK(params[2] == params[0]);
  // The same training on one rank, each step on the batches of the ranks that had data.
  std::vector<float> single;
  gradsync::run_threads(1, [&](Communicator<Threads>& comm) {
    ReplicatedTrainer trainer(comm, model_for(0), momentum_sgd());
    for (std::size_t s = 0; s < 4; ++s) {
      Batch<float> all;
      for (std::size_t r = 0; r < world; ++r) {
        if (s >= 2 + r) continue;
        auto part = make_batch<float>((s * world + r) * b, b, in, out);
        all.size += part.size;
        all.x.insert(all.x.end(), part.x.begin(), part.x.end());
        all.y.insert(all.y.end(), part.y.begin(), part.y.end());
      }
      trainer.step(all);
    }
    single.assign(trainer.parameters().begin(), trainer.parameters().end());
  });
  check_close(params[0], single, 2e-5f);
}
