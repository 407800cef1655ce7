// ReplicatedTrainer: the semantics of PyTorch DDP, each one a test.
#include <doctest/doctest.h>

#include <gradsync/gradsync.hpp>
#include <gradsync/train/checkpoint/replicated_checkpoint.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "support/common.hpp"
#include "support/instances.hpp"
#include "support/refusals.hpp"
#include "support/temp_dir.hpp"
#include "support/unit_disagreement.hpp"
#include "test_train_model.hpp"
#include "test_train_nonfinite.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_train_replicated_trainer {

using namespace test_train::names;

namespace {

constexpr std::size_t in = 5, out = 3;
const std::vector<std::size_t> layers{in, 16, 12, out};

Mlp<float> model_for(int rank, bool aux = false) {
  return Mlp<float>{layers, static_cast<std::uint64_t>(rank) + 7, aux};
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
    // Its buckets ran on the communicator's one shared worker, not a thread of its own.
    CHECK(&trainer.grad_sync().progress_worker() == gradsync::ProgressWorker<Threads>::shared(comm).get());
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

namespace {

/// Adds 1 to its one unit's gradient, then reports the unit ready twice.
template <class C>
struct ReadyTwice {
  using value_type = float;
  using compute_type = C;
  std::vector<gradsync::UnitSpec> units() const { return {{"w", {{"w", {4}}}, {}}}; }
  void bind(std::span<const gradsync::UnitView<float>>) {}
  double forward_backward(const Batch<float>&, const gradsync::StepContext<C>& ctx) const {
    { const auto forward = ctx.params(0); }
    const auto p = ctx.params(0);
    for (C& g : p->flat_grads) g = C(static_cast<float>(g) + 1.0f);
    ctx.ready(0);
    ctx.ready(0);
    return 0;
  }
};

template <class C>
void check_ready_twice_refused() {
  for (int world = 1; world <= 3; ++world) {
    CAPTURE(world);
    // Under accumulate() nothing communicates: a bfloat16 gradient folded
    // into the float one on each ready() once counted twice here. Refused,
    // the micro-step leaves nothing behind: its gradient is dropped.
    std::vector<float> first(static_cast<std::size_t>(world));
    const auto accumulated = test::refusals_on_threads(world, [&](Communicator<Threads>& comm) {
      ReplicatedTrainer trainer(comm, ReadyTwice<C>{}, gradsync::Sgd<float>());
      struct Record {
        ReplicatedTrainer<ReadyTwice<C>, gradsync::Sgd<float>, Communicator<Threads>>& t;
        float& to;
        ~Record() { to = t.gradients()[0]; }
      } record{trainer, first[static_cast<std::size_t>(comm.rank())]};
      trainer.accumulate(Batch<float>{});
    });
    for (const float g : first) CHECK(g == 0.0f);
    // In a synced step the first ready() may already have started the
    // bucket's all-reduce, which every rank started alike.
    const auto stepped = test::refusals_on_threads(world, [](Communicator<Threads>& comm) {
      ReplicatedTrainer trainer(comm, ReadyTwice<C>{}, gradsync::Sgd<float>());
      trainer.step(Batch<float>{});
    });
    for (const auto& messages : {accumulated, stepped}) {
      for (const auto& m : messages) CHECK(m.find("unit 0 ('w') ready twice in one backward") != std::string::npos);
    }
  }
}

}  // namespace

TEST_CASE("protocol: a unit reported ready twice in one backward throws, under accumulate() too") {
  SUBCASE("float") { check_ready_twice_refused<float>(); }
  SUBCASE("bfloat16 compute") { check_ready_twice_refused<gradsync::bfloat16>(); }
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

TEST_CASE("uneven inputs: clip_grad_norm in a step where a rank has joined is refused, on every rank") {
  // The joined rank takes the step without clipping: its replica would part.
  auto rng = test::rng_for("join and clip");
  CAPTURE(test::test_seed());
  const int world = 3 + static_cast<int>(rng() % 3);
  const int short_rank = static_cast<int>(rng() % static_cast<unsigned>(world));
  INFO("N = " << world << ", rank " << short_rank << " joins after one step");
  ReplicatedTrainerOptions o;
  o.join = true;
  gradsync::ThreadsOptions topt;
  topt.timeout = std::chrono::seconds(20);
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(gradsync::run_threads(world, topt, [&](Communicator<Threads>& comm) {
    ReplicatedTrainer trainer(comm, model_for(comm.rank()), momentum_sgd(), o);
    const auto r = static_cast<std::size_t>(comm.rank());
    try {
      for (std::size_t s = 0; s < (comm.rank() == short_rank ? 1u : 3u); ++s) {
        trainer.forward_backward(make_batch<float>((s * std::size_t(world) + r) * 4, 4, in, out));
        trainer.clip_grad_norm(1.0);
        trainer.optimizer_step();
      }
      trainer.join();
    } catch (const std::exception& e) {
      errors[r] = e.what();
      throw;
    }
  }), gradsync::Error);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r << ": " << errors[static_cast<std::size_t>(r)]);
    if (r != short_rank) CHECK(errors[static_cast<std::size_t>(r)].find("1 rank(s) have joined") != std::string::npos);
    CHECK(!errors[static_cast<std::size_t>(r)].empty());
  }
}

TEST_CASE("uneven inputs: what a rank accumulated before join() is dropped, also when every rank joins at once") {
  // An epoch whose batch count is not a multiple of the accumulation
  // window ends with a micro-step no step follows: join() drops it, so the
  // next epoch's first step is that of a run which never took it, and a
  // checkpoint between the epochs is allowed.
  auto rng = test::rng_for("join drops the leftover");
  CAPTURE(test::test_seed());
  for (int round = 0; round < 3; ++round) {
    const int world = 2 + static_cast<int>(rng() % 3);
    // Which ranks end their epoch on a leftover micro-step: at least one, maybe all.
    const unsigned leftover = 1u + static_cast<unsigned>(rng() % ((1u << world) - 1));
    INFO("N = " << world << ", ranks with a leftover micro-step: mask " << leftover);
    ReplicatedTrainerOptions o;
    o.join = true;
    o.sync.collective.deterministic = true;
    std::vector<std::vector<float>> kept(static_cast<std::size_t>(world)), plain(kept);
    test::TempDir dir;
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      auto batch = [&](std::size_t s) { return make_batch<float>((s * std::size_t(world) + r) * 4, 4, in, out); };
      for (const bool with_leftover : {true, false}) {
        ReplicatedTrainer trainer(comm, model_for(comm.rank()), momentum_sgd(), o);
        trainer.accumulate(batch(0));
        trainer.step(batch(1));
        if (with_leftover && (leftover >> r & 1u)) trainer.accumulate(batch(2));
        trainer.join();
        CHECK(trainer.between_steps());
        if (with_leftover) gradsync::save_checkpoint(trainer, dir.path);
        trainer.accumulate(batch(3));
        trainer.step(batch(4));
        auto& into = with_leftover ? kept : plain;
        into[r].assign(trainer.parameters().begin(), trainer.parameters().end());
      }
    });
    for (std::size_t r = 0; r < kept.size(); ++r) {
      CAPTURE(r);
      CHECK(test_nonfinite::bitwise_equal(kept[r], plain[r]));
    }
  }
}

TEST_CASE("uneven inputs: buffers come from a rank with data, and joined ranks follow the learning rate") {
  // Rank 0 runs out of data first. A joined rank runs no forward, so its
  // buffers fall behind: broadcast from it, they would undo each step's
  // update on the others. And it steps with the rate the others set, before
  // forward_backward(), between the step's halves or after the step before,
  // and ends with the rate they set after their last step.
  auto rng = test::rng_for("join buffers and rates");
  CAPTURE(test::test_seed());
  const int world = 3 + static_cast<int>(rng() % 3);
  constexpr std::size_t b = 2;
  std::vector<std::size_t> batches(static_cast<std::size_t>(world));
  for (auto& n : batches) n = 1 + rng() % 4;
  batches[0] = 1 + rng() % 2;
  batches.back() = batches[0] + 1 + rng() % 2;
  const std::size_t steps = *std::ranges::max_element(batches);
  // Where step s's rate is set: before it, between its halves, or after step s - 1.
  enum class When { before, between, after };
  std::vector<When> when(steps);
  for (std::size_t s = 0; s < steps; ++s) when[s] = static_cast<When>(rng() % 3);
  // A constant rate, then a schedule: each of the two faults alone.
  for (const bool schedule : {false, true}) {
    auto lr_at = [&](std::size_t s) { return schedule ? 0.2 * (1.0 - 0.15 * static_cast<double>(s)) : 0.2; };
    INFO("N = " << world << ", steps " << steps << ", rank 0 has " << batches[0] << " batch(es)"
                << std::string(schedule ? ", a schedule" : ", one rate"));
    // After its last step a rank sets the next epoch's rate, as a schedule does.
    auto step = [&](auto& trainer, std::size_t s, const Batch<float>& batch, bool last) {
      if (when[s] == When::before) trainer.optimizer().set_lr(lr_at(s));
      trainer.forward_backward(batch);
      if (when[s] == When::between) trainer.optimizer().set_lr(lr_at(s));
      trainer.optimizer_step();
      if (last || (s + 1 < steps && when[s + 1] == When::after)) trainer.optimizer().set_lr(lr_at(s + 1));
    };
    ReplicatedTrainerOptions o;
    o.join = true;
    o.check_replicas_every = 1;
    std::vector<std::vector<float>> params(static_cast<std::size_t>(world)), buffers(params.size());
    std::vector<double> lrs(params.size());
    float initial = 0;
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      ReplicatedTrainer trainer(comm, model_for(comm.rank()), momentum_sgd(), o);
      const auto r = static_cast<std::size_t>(comm.rank());
      if (r == 0) initial = trainer.buffers()[0];
      for (std::size_t s = 0; s < batches[r]; ++s) {
        step(trainer, s, make_batch<float>((s * world + r) * b, b, in, out), s + 1 == batches[r]);
      }
      trainer.join();
      params[r].assign(trainer.parameters().begin(), trainer.parameters().end());
      buffers[r].assign(trainer.buffers().begin(), trainer.buffers().end());
      lrs[r] = trainer.optimizer().lr();
    });
    for (std::size_t r = 0; r < params.size(); ++r) {
      INFO("rank " << r);
      CHECK(params[r] == params[0]);
      CHECK(buffers[r] == buffers[0]);
      // Every step adds its batch to the buffers of the rank they come from.
      CHECK(buffers[r][0] == initial + static_cast<float>(b * steps));
      CHECK(lrs[r] == lr_at(steps));
    }
    // The same training on one rank, each step on the batches of the ranks that had data.
    std::vector<float> single;
    gradsync::run_threads(1, [&](Communicator<Threads>& comm) {
      ReplicatedTrainer trainer(comm, model_for(0), momentum_sgd());
      for (std::size_t s = 0; s < steps; ++s) {
        Batch<float> all;
        for (std::size_t r = 0; r < params.size(); ++r) {
          if (s >= batches[r]) continue;
          auto part = make_batch<float>((s * world + r) * b, b, in, out);
          all.size += part.size;
          all.x.insert(all.x.end(), part.x.begin(), part.x.end());
          all.y.insert(all.y.end(), part.y.begin(), part.y.end());
        }
        step(trainer, s, all, s + 1 == steps);
      }
      single.assign(trainer.parameters().begin(), trainer.parameters().end());
    });
    check_close(params[0], single, 2e-5f);
  }
}

TEST_CASE("uneven inputs: ranks with data that set different rates, in a step or after the last, fail every rank") {
  // Rank 0 joins after one step; the others take two, and one of them sets
  // another rate than the rest between step 2's halves, or after it.
  auto rng = test::rng_for("join rates differ");
  CAPTURE(test::test_seed());
  for (const bool after_last : {false, true}) {
    const int world = 3 + static_cast<int>(rng() % 3);
    const int odd = 1 + static_cast<int>(rng() % static_cast<unsigned>(world - 1));
    INFO("N = " << world << ", rank " << odd << " sets another rate " << std::string(after_last ? "after" : "in")
                << " step 2");
    ReplicatedTrainerOptions o;
    o.join = true;
    std::vector<std::string> errors(static_cast<std::size_t>(world));
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      ReplicatedTrainer trainer(comm, model_for(comm.rank()), momentum_sgd(), o);
      const auto r = static_cast<std::size_t>(comm.rank());
      const double rate = comm.rank() == odd ? 0.05 : 0.1;
      try {
        for (std::size_t s = 0; s < (r == 0 ? 1u : 2u); ++s) {
          trainer.forward_backward(make_batch<float>((s * world + r) * 2, 2, in, out));
          if (s == 1 && !after_last) trainer.optimizer().set_lr(rate);
          trainer.optimizer_step();
        }
        if (r != 0 && after_last) trainer.optimizer().set_lr(rate);
        trainer.join();
      } catch (const gradsync::InvalidArgument& e) {
        errors[r] = e.what();
      }
    });
    const std::string expected =
        after_last ? "as join() returns, the ranks that took the last step hold different learning rates: 0.05 on rank "
                   : "where 1 rank(s) have joined, the ranks with data set different learning rates after "
                     "forward_backward(), between 0.05 and 0.1";
    for (std::size_t r = 0; r < errors.size(); ++r) {
      INFO("rank " << r << ": " << errors[r]);
      CHECK(errors[r].find(expected) != std::string::npos);
    }
  }
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

namespace {

/// The randomized tests' seed: GRADSYNC_TEST_SEED if set, else a fresh one.
std::uint64_t test_seed() {
  if (const char* s = std::getenv("GRADSYNC_TEST_SEED")) return std::stoull(s);
  std::random_device rd;
  return (std::uint64_t{rd()} << 32) ^ rd();
}

std::size_t pick(std::mt19937_64& rng, std::size_t n) { return static_cast<std::size_t>(rng() % n); }

/// 2 to 6 units of 1 to 3 parameters, 1- or 2-D, some with a buffer.
std::vector<gradsync::UnitSpec> random_units(std::mt19937_64& rng) {
  std::vector<gradsync::UnitSpec> units(2 + pick(rng, 5));
  for (std::size_t u = 0; u < units.size(); ++u) {
    units[u].name = "unit" + std::to_string(u);
    const std::size_t params = 1 + pick(rng, 3);
    for (std::size_t p = 0; p < params; ++p) {
      std::vector<std::size_t> shape{1 + pick(rng, 9)};
      if (pick(rng, 2)) shape.push_back(1 + pick(rng, 9));
      units[u].params.push_back({"p" + std::to_string(p), shape});
    }
    if (pick(rng, 3) == 0) units[u].buffers.push_back({"stat", {1 + pick(rng, 4)}});
  }
  return units;
}

/// What the ranks' declarations differ in.
enum class Mismatch { shape, split, name, count };

/// `u` changed as `kind` says, and the index of the first unit that differs.
std::pair<std::vector<gradsync::UnitSpec>, std::size_t> mutate(std::vector<gradsync::UnitSpec> u, Mismatch kind,
                                                               std::mt19937_64& rng) {
  const std::size_t i = pick(rng, u.size());
  switch (kind) {
    case Mismatch::shape: {
      // Same elements, another shape: transposed, or one more axis of 1.
      auto& shape = u[i].params[pick(rng, u[i].params.size())].shape;
      if (shape.size() == 2 && shape[0] != shape[1]) {
        std::swap(shape[0], shape[1]);
      } else {
        shape.push_back(1);
      }
      return {u, i};
    }
    case Mismatch::split: {
      // The same tensors, grouped into units differently.
      if (u[i].params.size() >= 2) {
        gradsync::UnitSpec tail{u[i].name + "b", {u[i].params.begin() + 1, u[i].params.end()}, {}};
        u[i].params.resize(1);
        u.insert(u.begin() + static_cast<std::ptrdiff_t>(i) + 1, std::move(tail));
        return {u, i};
      }
      const std::size_t a = i + 1 < u.size() ? i : i - 1;
      u[a].params.insert(u[a].params.end(), u[a + 1].params.begin(), u[a + 1].params.end());
      u[a].buffers.insert(u[a].buffers.end(), u[a + 1].buffers.begin(), u[a + 1].buffers.end());
      u.erase(u.begin() + static_cast<std::ptrdiff_t>(a) + 1);
      return {u, a};
    }
    case Mismatch::name:
      if (pick(rng, 2)) {
        u[i].name += "_renamed";
      } else {
        u[i].params[pick(rng, u[i].params.size())].name += "_renamed";
      }
      return {u, i};
    case Mismatch::count:
      if (pick(rng, 2)) {
        u.erase(u.begin() + static_cast<std::ptrdiff_t>(i));
        return {u, i};
      } else {
        const std::size_t at = pick(rng, u.size() + 1);
        u.insert(u.begin() + static_cast<std::ptrdiff_t>(at), gradsync::UnitSpec{"extra", {{"w", {3, 2}}}, {}});
        return {u, at};
      }
  }
  return {u, 0};
}

std::size_t total(const std::vector<gradsync::UnitSpec>& units) {
  std::size_t n = 0;
  for (const auto& u : units)
    for (const auto& t : u.params) n += t.count();
  return n;
}

}  // namespace

TEST_CASE("units: ranks that declare different units all throw at construction, naming the unit and the rank") {
  const std::uint64_t seed = test_seed();
  INFO("seed " << seed << " (rerun with GRADSYNC_TEST_SEED=" << seed << ")");
  std::mt19937_64 rng(seed);
  gradsync::ThreadsOptions topt;
  topt.timeout = std::chrono::seconds(5);
  const char* names[] = {"a different shape, same total", "a different unit split, same total",
                         "a different name", "one unit fewer or more"};
  for (int world : {3, 4, 5}) {
    for (int k = 0; k < 4; ++k) {
      for (int trial = 0; trial < 3; ++trial) {
        const auto kind = static_cast<Mismatch>(k);
        const auto mine = random_units(rng);
        // Named, not a structured binding: lambdas below capture them, which
        // Clang accepts only from version 16.
        const auto mutated = mutate(mine, kind, rng);
        const auto& theirs = mutated.first;
        const std::size_t unit = mutated.second;
        const int odd = static_cast<int>(pick(rng, static_cast<std::size_t>(world)));
        CAPTURE(world);
        CAPTURE(names[k]);
        CAPTURE(odd);
        CAPTURE(unit);
        if (kind != Mismatch::count) REQUIRE(total(theirs) == total(mine));
        std::vector<std::string> messages(static_cast<std::size_t>(world));
        std::vector<int> constructed(static_cast<std::size_t>(world), 0);
        const auto t0 = std::chrono::steady_clock::now();
        gradsync::run_threads(world, topt, [&](Communicator<Threads>& comm) {
          const auto r = static_cast<std::size_t>(comm.rank());
          test::catch_message(messages[r], [&] {
            ReplicatedTrainer trainer(comm, Declared<float>{comm.rank() == odd ? theirs : mine},
                                      gradsync::Sgd<float>({.lr = 0.1}));
            constructed[r] = 1;
            trainer.step(Batch<float>{});
          });
        });
        CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1));
        test::check_unit_disagreement("ReplicatedTrainer", messages, constructed, unit, odd);
      }
    }
    // Agreeing ranks: no error, and training goes on as before.
    const auto units = random_units(rng);
    std::vector<std::vector<float>> params(static_cast<std::size_t>(world));
    gradsync::run_threads(world, topt, [&](Communicator<Threads>& comm) {
      ReplicatedTrainer trainer(comm, Declared<float>{units}, gradsync::Sgd<float>({.lr = 0.5}));
      const std::vector<float> before(trainer.parameters().begin(), trainer.parameters().end());
      trainer.step(Batch<float>{});
      params[static_cast<std::size_t>(comm.rank())].assign(trainer.parameters().begin(), trainer.parameters().end());
      // The loss is half the squared norm: one step of lr 0.5 halves every parameter.
      for (std::size_t i = 0; i < before.size(); ++i) REQUIRE(params[static_cast<std::size_t>(comm.rank())][i] == before[i] * 0.5f);
    });
    for (const auto& p : params) CHECK(p == params[0]);
  }
}

TEST_CASE("units: the message names both declarations, the unit counts, and every rank that differs") {
  const std::vector<gradsync::UnitSpec> mine{{"fc1", {{"weight", {10, 1024}}}, {}}, {"fc2", {{"weight", {1024, 10}}}, {}}};
  auto transposed = mine;
  transposed[1].params[0].shape = {10, 1024};
  auto shorter = mine;
  shorter.pop_back();
  auto run = [&](int world, auto declared) {
    gradsync::ThreadsOptions topt;
    topt.timeout = std::chrono::seconds(5);
    const std::vector<std::string> messages = test::refusals_on_threads(world, topt, [&](Communicator<Threads>& comm) {
      ReplicatedTrainer trainer(comm, Declared<float>{declared(comm.rank())}, gradsync::Sgd<float>({.lr = 0.1}));
    });
    for (const auto& m : messages) CHECK(m == messages[0]);
    return messages[0];
  };
  CHECK(run(3, [&](int r) { return r == 2 ? transposed : mine; }) ==
        "gradsync: ReplicatedTrainer: ranks declared different units: rank 0 declared unit 1 as 'fc2' (weight "
        "[1024 x 10]), rank 2 declared it as 'fc2' (weight [10 x 1024]). Every rank's model must declare the same "
        "units, with the same names and shapes, in the same order: check what its units() depends on "
        "(configuration, rank, world size).");
  // Rank 0 alone differs: the majority is the reference, and both other differing ranks are listed.
  const std::string m = run(5, [&](int r) { return r == 0 ? shorter : r == 3 ? transposed : mine; });
  CHECK(m.find("rank 1 declared unit 1 as 'fc2' (weight [1024 x 10]) (2 units in all), rank 0 declared no unit 1 "
               "(1 unit in all). Ranks that differ from rank 1: 0, 3.") != std::string::npos);
}

TEST_CASE("on_nonfinite: a NaN or Inf in one rank's gradient or loss throws, skips or passes on every rank") {
  namespace nf = test_nonfinite;
  INFO("GRADSYNC_TEST_SEED = " << test::test_seed());
  auto g = test::rng_for("replicated on_nonfinite");
  for (const auto compression : {gradsync::Compression::none, gradsync::Compression::bf16}) {
    INFO("compression = " << (compression == gradsync::Compression::bf16 ? "bf16" : "none"));
    const nf::Poison p = nf::draw(g);
    auto make_for = [&](gradsync::OnNonfinite policy) {
      return [policy, compression](Communicator<Threads>& comm) {
        ReplicatedTrainerOptions o;
        o.on_nonfinite = policy;
        o.sync.compression = compression;
        o.sync.collective.deterministic = true;
        return ReplicatedTrainer(comm, nf::Model{nf::sizes}, gradsync::Sgd<float>({.lr = 0.1, .momentum = 0.9}), o);
      };
    };
    nf::check_policies(
        p, make_for, [](auto& t) { return t.parameters(); },
        [](auto& t) { return std::vector<float>(t.parameters().begin(), t.parameters().end()); },
        [](std::size_t u) { return "unit " + std::to_string(u) + " ('n" + std::to_string(u) + "')"; });
  }
}

}  // namespace test_train_replicated_trainer
