// ShardedTrainer: layout, parity with ReplicatedTrainer, the collectives of a
// step, persistent memory, and what it refuses.
#include <doctest/doctest.h>

#include <gradsync/gradsync.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "support/common.hpp"
#include "support/refusals.hpp"
#include "support/unit_disagreement.hpp"
#include "test_train_sharded_schedule.hpp"
#include "test_train_nonfinite.hpp"
#include "test_train_squares.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_train_sharded_trainer {

using namespace test_schedule;

namespace {

constexpr ShardingStrategy strategies[] = {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp,
                                           ShardingStrategy::NoShard};

/// Rank 0's gathered parameters; every rank's gather must be the same.
template <class Opt>
std::vector<float> train_sharded(const Batches& batches, int world, Opt opt, ShardingStrategy strategy,
                                 bool deterministic) {
  ShardedTrainerOptions o;
  o.strategy = strategy;
  o.collective.deterministic = deterministic;
  const std::vector<std::vector<float>> result = sharded_on_threads(batches, world, opt, o);
  for (const auto& r : result) CHECK(r == result[0]);
  return result[0];
}

template <class Opt>
void check_parity(const char* opt_name, Opt opt) {
  const std::uint64_t seed = test::test_seed();
  INFO("seed = " << seed << ", optimizer = " << std::string(opt_name));
  for_each_parity_run(seed, opt, [&](int world, const Batches& batches, const std::vector<float>& replicated,
                                     bool deterministic) {
    for (const ShardingStrategy s : strategies) {
      INFO("strategy = " << name(s));
      ShardedTrainerOptions o = options_for(s, world);
      o.collective.deterministic = deterministic;
      check_sharded_run(batches, world, opt, o, replicated);
    }
  });
}

}  // namespace

TEST_CASE("layout: owned ranges, zero padding, and a gather that reproduces the input bitwise") {
  for (int world = 1; world <= 4; ++world) {
    const auto n = static_cast<std::size_t>(world);
    std::vector<std::size_t> sizes{1, n, n + 1};
    if (n > 1) sizes.push_back(n - 1);
    if (world == 4) sizes.push_back(5);
    for (const std::size_t p : sizes) {
      CAPTURE(world);
      CAPTURE(p);
      const std::vector<gradsync::UnitSpec> units{{"u", {{"w", {p}}}, {}}};
      // What Declared writes at bind: element i is i % 7 − 3.
      std::vector<float> input(p);
      for (std::size_t i = 0; i < p; ++i) input[i] = static_cast<float>(i % 7) - 3.0f;
      std::vector<std::size_t> owned(n);
      gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
        ShardedTrainer trainer(comm, Declared<float>{units}, gradsync::Sgd<float>());
        const auto r = static_cast<std::size_t>(comm.rank());
        const std::size_t c = (p + n - 1) / n;
        REQUIRE(trainer.chunk_size(0) == c);
        const auto [first, count] = trainer.owned_range(0);
        CHECK(first == std::min(p, r * c));
        CHECK(count == std::min(c, p - first));
        owned[r] = count;
        const auto shard = trainer.unit_shard(0);
        REQUIRE(shard.size() == c);
        for (std::size_t i = 0; i < c; ++i) {
          if (i < count) {
            CHECK(std::memcmp(&shard[i], &input[first + i], sizeof(float)) == 0);
          } else {
            CHECK(shard[i] == 0.0f);
            CHECK(!std::signbit(shard[i]));
          }
        }
        CHECK(bitwise_equal(trainer.full_parameters(), input));
      });
      std::size_t sum = 0;
      for (const std::size_t k : owned) sum += k;
      CHECK(sum == p);
      if (world == 4 && p == 5) CHECK(owned == std::vector<std::size_t>{2, 2, 1, 0});
    }
  }
}

TEST_CASE("layout: the padding stays zero through optimizer steps, Adam with eps 0 included") {
  // A zero gradient in the padding is 0/0 for Adam without eps.
  for (const ShardingStrategy s : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp}) {
    for (int world = 2; world <= 5; ++world) {
      CAPTURE(world);
      INFO("strategy = " << name(s));
      gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
        ShardedTrainer trainer(comm, test_squares::Squares{{7, 3, 1}, 1}, gradsync::Adam<float>({.lr = 0.1, .eps = 0}),
                               {.strategy = s});
        for (int k = 0; k < 2; ++k) trainer.step(test_squares::Scale{1.0f});
        for (std::size_t u = 0; u < trainer.unit_count(); ++u) {
          const auto shard = trainer.unit_shard(u);
          for (std::size_t i = trainer.owned_range(u).second; i < shard.size(); ++i) {
            CHECK(shard[i] == 0.0f);
          }
        }
      });
    }
  }
}

TEST_CASE("units without elements: every strategy trains as ReplicatedTrainer, with and without prefetch") {
  // A wrapped unit of no elements has nothing to gather or reduce; it must
  // still pass through its phases (asked, held, ready) like the others, and
  // under a limit of one gathered unit it must not hold up the prefetch.
  const std::vector<std::size_t> sizes{5, 0, 7, 0, 3};
  const auto train = [&](auto make_trainer) {
    std::vector<float> rank0;
    gradsync::run_threads(3, [&](gradsync::Communicator<gradsync::Threads>& comm) {
      auto trainer = make_trainer(comm, test_squares::Squares{sizes, 3});
      for (int s = 0; s < 3; ++s) trainer.step(test_squares::Scale{1.0f + float(comm.rank())});
      const std::vector<float> p = trainer.full_parameters();
      if (comm.rank() == 0) rank0 = p;
    });
    return rank0;
  };
  const std::vector<float> replicated = train([](auto& comm, test_squares::Squares m) {
    struct Full {
      gradsync::ReplicatedTrainer<test_squares::Squares, gradsync::Sgd<float>, gradsync::Communicator<gradsync::Threads>> t;
      void step(test_squares::Scale b) { t.step(b); }
      std::vector<float> full_parameters() { return {t.parameters().begin(), t.parameters().end()}; }
    };
    return Full{{comm, std::move(m), gradsync::Sgd<float>({.lr = 0.1})}};
  });
  REQUIRE(replicated.size() == 15);
  for (const auto strategy : {gradsync::ShardingStrategy::FullShard, gradsync::ShardingStrategy::ShardGradOp,
                              gradsync::ShardingStrategy::NoShard}) {
    for (const bool prefetch : {false, true}) {
      CAPTURE(strategy);
      CAPTURE(prefetch);
      const std::vector<float> sharded = train([&](auto& comm, test_squares::Squares m) {
        gradsync::ShardedTrainerOptions o;
        o.strategy = strategy;
        o.forward_prefetch = prefetch;
        o.limit_all_gathers = 1;
        return gradsync::ShardedTrainer(comm, std::move(m), gradsync::Sgd<float>({.lr = 0.1}), o);
      });
      REQUIRE(sharded.size() == replicated.size());
      // Equal up to the order of the sums, which the two trainers' collectives may differ in.
      for (std::size_t i = 0; i < sharded.size(); ++i) CHECK(sharded[i] == doctest::Approx(replicated[i]).epsilon(1e-5));
    }
  }
}

TEST_CASE("start: every rank starts from rank 0's parameters") {
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    std::vector<float> replicated;
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      ReplicatedTrainer trainer(comm, model_for(comm.rank()), gradsync::Sgd<float>());
      if (comm.rank() == 0) replicated.assign(trainer.parameters().begin(), trainer.parameters().end());
    });
    for (const ShardingStrategy s : strategies) {
      INFO("strategy = " << name(s));
      std::vector<std::vector<float>> gathered(static_cast<std::size_t>(world));
      gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
        ShardedTrainer trainer(comm, model_for(comm.rank()), gradsync::Sgd<float>(), {.strategy = s});
        gathered[static_cast<std::size_t>(comm.rank())] = trainer.full_parameters();
      });
      for (const auto& g : gathered) CHECK(bitwise_equal(g, replicated));
    }
  }
}

TEST_CASE("parity: SGD, 20 steps, equal to ReplicatedTrainer (bitwise when deterministic)") {
  check_parity("SGD", gradsync::Sgd<float>({.lr = 0.1}));
}

TEST_CASE("parity: momentum SGD") {
  check_parity("momentum SGD", gradsync::Sgd<float>({.lr = 0.05, .momentum = 0.9}));
}

TEST_CASE("parity: Adam") { check_parity("Adam", gradsync::Adam<float>({.lr = 0.01})); }

TEST_CASE("parity: AdamW") { check_parity("AdamW", gradsync::AdamW<float>({.lr = 0.01, .weight_decay = 0.05})); }

TEST_CASE("trace: the collectives of one step, per strategy") {
  using gradsync::Collective;
  const std::uint64_t seed = test::test_seed();
  INFO("seed = " << seed);
  struct Variant {
    ShardingStrategy strategy;
    bool keep_last_forward_unit;
  };
  const Variant variants[] = {{ShardingStrategy::FullShard, true},
                              {ShardingStrategy::FullShard, false},
                              {ShardingStrategy::ShardGradOp, true},
                              {ShardingStrategy::NoShard, true}};
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    const auto batches = random_batches(seed, 2, world, 2);
    for (const Variant& v : variants) {
      // Plain variables: lambdas below capture them (no structured bindings).
      const ShardingStrategy s = v.strategy;
      const bool keep = v.keep_last_forward_unit;
      INFO("strategy = " << name(s) << ", keep_last_forward_unit = " << keep);
      const ShardedTrainerOptions o{.strategy = s, .keep_last_forward_unit = keep};
      std::vector<std::vector<gradsync::ShardedTraceEvent>> traces(static_cast<std::size_t>(world));
      std::vector<std::uint64_t> calls(static_cast<std::size_t>(world));
      gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        ShardedTrainer trainer(comm, model_for(comm.rank()), gradsync::Adam<float>(), o);
        trainer.step(batches[0][r]);
        const std::uint64_t before = comm.sequence();
        trainer.step(batches[1][r]);
        calls[r] = comm.sequence() - before;
        traces[r] = trainer.trace();
      });
      const std::size_t units = layers.size();  // three layers and aux
      std::vector<std::size_t> gathers(units), reductions(units), all_reduces(units);
      // Each unit's reduction comes after every one of its gathers.
      for (const auto& e : traces[0]) {
        REQUIRE(e.unit < units);
        if (e.collective == Collective::all_gather) {
          CHECK(reductions[e.unit] == 0);
          ++gathers[e.unit];
        } else if (e.collective == Collective::reduce_scatter) {
          ++reductions[e.unit];
        } else {
          CHECK(e.collective == Collective::all_reduce);
          ++all_reduces[e.unit];
        }
      }
      for (std::size_t u = 0; u < units; ++u) {
        CAPTURE(u);
        switch (s) {
          case ShardingStrategy::FullShard:
            // The aux unit, last in forward and first in backward, is FSDP's
            // root: kept gathered from its forward into its backward.
            CHECK(gathers[u] == (keep && u + 1 == units ? 1 : 2));
            CHECK(reductions[u] == 1);
            break;
          case ShardingStrategy::ShardGradOp:
            CHECK(gathers[u] == 1);
            CHECK(reductions[u] == 1);
            break;
          case ShardingStrategy::NoShard:
            CHECK(gathers[u] == 0);
            CHECK(all_reduces[u] == 1);
            break;
          case ShardingStrategy::HybridShard:  // its own test case
            break;
        }
      }
      // The same trace on every rank, and nothing else on the communicator
      // but the broadcast of the buffers and the agreement on finite gradients.
      for (std::size_t r = 0; r < traces.size(); ++r) {
        CAPTURE(r);
        REQUIRE(traces[r].size() == traces[0].size());
        for (std::size_t i = 0; i < traces[r].size(); ++i) {
          CHECK(traces[r][i].collective == traces[0][i].collective);
          CHECK(traces[r][i].unit == traces[0][i].unit);
        }
        if (world > 1) CHECK(calls[r] == traces[0].size() + 2);
      }
    }
  }
}

TEST_CASE("memory: persistent bytes per rank are (8 + S)·Σ⌈U/N⌉, or (8 + S)·Ψ under NoShard and DDP") {
  const std::vector<std::size_t> unit_sizes{25, 36, 7, 1};
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    const auto n = static_cast<std::size_t>(world);
    std::size_t sharded = 0, psi = 0;
    for (const std::size_t u : unit_sizes) {
      sharded += (u + n - 1) / n;
      psi += u;
    }
    for (const ShardingStrategy s : strategies) {
      INFO("strategy = " << name(s));
      const std::size_t elements = s == ShardingStrategy::NoShard ? psi : sharded;
      gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
        const ShardedTrainerOptions o{.strategy = s};
        ShardedTrainer sgd(comm, model_for(comm.rank()), gradsync::Sgd<float>(), o);
        CHECK(sgd.persistent_bytes() == 8 * elements);
        ShardedTrainer momentum(comm, model_for(comm.rank()), gradsync::Sgd<float>({.momentum = 0.9}), o);
        CHECK(momentum.persistent_bytes() == 12 * elements);
        ShardedTrainer adam(comm, model_for(comm.rank()), gradsync::Adam<float>(), o);
        CHECK(adam.persistent_bytes() == 16 * elements);
        ShardedTrainer adamw(comm, model_for(comm.rank()), gradsync::AdamW<float>(), o);
        CHECK(adamw.persistent_bytes() == 16 * elements);
        // DDP's figure, (8 + S)·Ψ: what NoShard reports.
        ReplicatedTrainer ddp_sgd(comm, model_for(comm.rank()), gradsync::Sgd<float>());
        CHECK(ddp_sgd.persistent_bytes() == 8 * psi);
        ReplicatedTrainer ddp_momentum(comm, model_for(comm.rank()), gradsync::Sgd<float>({.momentum = 0.9}));
        CHECK(ddp_momentum.persistent_bytes() == 12 * psi);
        ReplicatedTrainer ddp_adam(comm, model_for(comm.rank()), gradsync::Adam<float>());
        CHECK(ddp_adam.persistent_bytes() == 16 * psi);
      });
    }
  }
}

TEST_CASE("units: ranks that declare different units throw on every rank, without hanging") {
  const std::vector<gradsync::UnitSpec> mine{{"fc1", {{"weight", {3, 5}}}, {}}, {"fc2", {{"weight", {5, 3}}}, {}}};
  auto transposed = mine;
  transposed[1].params[0].shape = {3, 5};
  for (int world = 2; world <= 4; ++world) {
    CAPTURE(world);
    const std::vector<std::string> messages = construction_errors(world, [&](Communicator<Threads>& comm) {
      ShardedTrainer trainer(comm, Declared<float>{comm.rank() == world - 1 ? transposed : mine}, gradsync::Sgd<float>());
    });
    for (const auto& m : messages) {
      CHECK(m == messages[0]);
      CHECK(m.find("ShardedTrainer: ranks declared different units") != std::string::npos);
    }
  }
}

TEST_CASE("bad input: a zero-sized model throws on every rank") {
  for (int world = 1; world <= 3; ++world) {
    for (const auto& units : {std::vector<gradsync::UnitSpec>{},
                              std::vector<gradsync::UnitSpec>{{"empty", {{"w", {0}}}, {}}}}) {
      const std::vector<std::string> messages = test::refusals_on_threads(world, [&](Communicator<Threads>& comm) {
        ShardedTrainer trainer(comm, Declared<float>{units}, gradsync::Sgd<float>());
      });
      for (const auto& m : messages) CHECK(m.find("declares no parameters") != std::string::npos);
    }
  }
}

namespace {

/// Breaks the protocol in one of three ways, on every rank alike.
struct Rogue {
  using value_type = float;
  enum Kind { ask_twice, ready_without_asking, ask_three_times } kind = ask_twice;

  std::vector<gradsync::UnitSpec> units() const { return {{"a", {{"w", {6}}}, {}}, {"b", {{"w", {3}}}, {}}}; }
  void bind(std::span<const gradsync::UnitView<float>>) {}
  double forward_backward(const Batch<float>&, const gradsync::StepContext<float>& ctx) {
    switch (kind) {
      case ask_twice: {
        const auto p = ctx.params(0);
        const auto q = ctx.params(0);
        break;
      }
      case ready_without_asking: {
        { const auto p = ctx.params(1); }
        ctx.ready(1);
        break;
      }
      case ask_three_times: {
        { const auto p = ctx.params(0); }
        { const auto p = ctx.params(0); }
        { const auto p = ctx.params(0); }
        break;
      }
    }
    return 0;
  }
};

}  // namespace

TEST_CASE("bad input: calls out of protocol throw a clear error") {
  const std::pair<Rogue::Kind, const char*> cases[] = {
      {Rogue::ask_twice, "while it still holds it"},
      {Rogue::ready_without_asking, "ready without holding it from a backward ask"},
      {Rogue::ask_three_times, "a third time in one step"},
  };
  for (int world = 1; world <= 2; ++world) {
    for (const auto& c : cases) {
      const Rogue::Kind kind = c.first;
      const char* const expected = c.second;
      for (const ShardingStrategy s : strategies) {
        CAPTURE(world);
        CAPTURE(expected);
        INFO("strategy = " << name(s));
        std::vector<std::string> messages(static_cast<std::size_t>(world));
        gradsync::ThreadsOptions topt;
        topt.timeout = std::chrono::seconds(5);
        gradsync::run_threads(world, topt, [&](Communicator<Threads>& comm) {
          try {
            ShardedTrainer trainer(comm, Rogue{kind}, gradsync::Sgd<float>(), {.strategy = s});
            trainer.step(Batch<float>{});
          } catch (const gradsync::InvalidArgument& e) {
            messages[static_cast<std::size_t>(comm.rank())] = e.what();
          }
        });
        for (const auto& m : messages) CHECK(m.find(expected) != std::string::npos);
      }
    }
  }
}

TEST_CASE("evaluate: a forward without backward sees the same parameters under both trainers") {
  const std::uint64_t seed = test::test_seed();
  INFO("seed = " << seed);
  const auto batches = random_batches(seed, 3, 2, 4);
  auto loss_of = [](auto& trainer, const Batch<float>& b) {
    // The Mlp's forward, through the context: unit 0's weights summed.
    return trainer.evaluate([&](const gradsync::StepContext<float>& ctx) {
      const auto p = ctx.params(0);
      double sum = 0;
      for (const float x : p->flat_params) sum += x;
      return sum + static_cast<double>(b.size);
    });
  };
  std::vector<double> replicated(2), sharded(2);
  gradsync::run_threads(2, [&](Communicator<Threads>& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    ReplicatedTrainerOptions ro;
    ro.sync.collective.deterministic = true;
    ShardedTrainerOptions so;
    so.collective.deterministic = true;
    ReplicatedTrainer rt(comm, model_for(comm.rank()), gradsync::Sgd<float>({.lr = 0.1}), ro);
    ShardedTrainer st(comm, model_for(comm.rank()), gradsync::Sgd<float>({.lr = 0.1}), so);
    for (const auto& step : batches) {
      rt.step(step[r]);
      st.step(step[r]);
    }
    replicated[r] = loss_of(rt, batches[0][r]);
    sharded[r] = loss_of(st, batches[0][r]);
  });
  CHECK(replicated == sharded);
}

namespace {

/// Per step, each rank's clip_grad_norm result, then rank 0's final parameters.
struct Clipped {
  std::vector<std::vector<double>> norms;  // [rank][step]
  std::vector<float> params;
};

template <class Trainer>
void clip_steps(Trainer& trainer, const std::vector<std::vector<Batch<float>>>& batches, std::size_t r, double max_norm,
                double p, std::vector<double>& norms) {
  for (const auto& step : batches) {
    trainer.forward_backward(step[r]);
    const double norm = trainer.clip_grad_norm(max_norm, p);
    norms.push_back(norm);
    // Clipped: the norm is now max_norm·norm/(norm + 1e-6), at most max_norm.
    const double again = trainer.clip_grad_norm(max_norm, p);
    if (norm > max_norm) {
      CHECK(again <= max_norm * (1 + 1e-5));
      CHECK(again >= max_norm * (1 - 1e-4));
    } else {
      CHECK(again == norm);
    }
    trainer.optimizer_step();
  }
}

}  // namespace

TEST_CASE("clip_grad_norm: the global norm, equal on every rank and to ReplicatedTrainer's; inf-norm; clipping") {
  const std::uint64_t seed = test::test_seed();
  INFO("seed = " << seed);
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    const auto ranks = static_cast<std::size_t>(world);
    const auto batches = random_batches(seed + static_cast<std::uint64_t>(world), 6, world, 3);
    for (const double p : {2.0, 1.0, 3.0, std::numeric_limits<double>::infinity()}) {
      CAPTURE(p);
      // Small enough that most steps clip, large enough that some may not.
      // The inf-norm (the largest |g|) is the smallest of the four: at 0.15
      // it clipped only 3 of 6 steps in 7 of 400 runs.
      const double max_norm = p == 1.0 ? 0.5 : p == 2.0 || p == 3.0 ? 0.15 : 0.1;
      Clipped replicated{std::vector<std::vector<double>>(ranks), {}};
      ReplicatedTrainerOptions ro;
      ro.sync.collective.deterministic = true;
      gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        ReplicatedTrainer trainer(comm, model_for(comm.rank()), gradsync::Sgd<float>({.lr = 0.1}), ro);
        clip_steps(trainer, batches, r, max_norm, p, replicated.norms[r]);
        if (r == 0) replicated.params.assign(trainer.parameters().begin(), trainer.parameters().end());
      });
      for (const auto& n : replicated.norms) CHECK(n == replicated.norms[0]);
      // Clipping took place in most steps (what clip_steps checks of it).
      std::size_t clipped = 0;
      for (const double n : replicated.norms[0]) clipped += n > max_norm;
      CHECK(clipped * 2 > replicated.norms[0].size());
      for (const ShardingStrategy s : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp,
                                       ShardingStrategy::NoShard, ShardingStrategy::HybridShard}) {
        INFO("strategy = " << name(s));
        std::vector<std::vector<double>> norms(ranks);
        std::vector<float> params;
        ShardedTrainerOptions so;
        so.strategy = s;
        so.collective.deterministic = true;
        // Two groups of two at N = 4; otherwise one group.
        so.shard_size = world == 4 ? 2 : 0;
        gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
          const auto r = static_cast<std::size_t>(comm.rank());
          ShardedTrainer trainer(comm, model_for(comm.rank()), gradsync::Sgd<float>({.lr = 0.1}), so);
          clip_steps(trainer, batches, r, max_norm, p, norms[r]);
          auto full = trainer.full_parameters();
          if (r == 0) params = std::move(full);
        });
        for (const auto& n : norms) CHECK(n == norms[0]);
        REQUIRE(norms[0].size() == replicated.norms[0].size());
        for (std::size_t i = 0; i < norms[0].size(); ++i) {
          CAPTURE(i);
          // The gradients are bitwise equal; only the order of the norm's sum
          // differs. HybridShard sums the gradient in another order.
          if (s == ShardingStrategy::HybridShard) {
            CHECK(std::abs(norms[0][i] - replicated.norms[0][i]) <= 1e-6 * replicated.norms[0][i]);
          } else if (std::isinf(p)) {
            CHECK(norms[0][i] == replicated.norms[0][i]);
          } else {
            CHECK(std::abs(norms[0][i] - replicated.norms[0][i]) <= 1e-12 * replicated.norms[0][i]);
          }
        }
        CHECK(worst_relative(params, replicated.params) <= 1e-6);
      }
    }
  }
}

namespace {

/// One unit of 7 whose gradient is 1 but for a NaN at element `nan_at`: at
/// N = 3 the NaN lands in one rank's shard only, first, between or last.
struct NanAt {
  using value_type = float;
  std::size_t nan_at = 0;

  std::vector<gradsync::UnitSpec> units() const { return {{"w", {{"w", {7}}}, {}}}; }
  void bind(std::span<const gradsync::UnitView<float>>) {}
  double forward_backward(const Batch<float>&, const gradsync::StepContext<float>& ctx) const {
    { const auto forward = ctx.params(0); }
    const auto p = ctx.params(0);
    std::fill(p->flat_grads.begin(), p->flat_grads.end(), 1.0f);
    p->flat_grads[nan_at] = std::numeric_limits<float>::quiet_NaN();
    ctx.ready(0);
    return 0;
  }
};

}  // namespace

TEST_CASE("clip_grad_norm: a NaN anywhere in the gradient makes the norm NaN on every rank, for every p") {
  // A Max of partials keeps its first operand when the other is NaN, so
  // the inf-norm once came out finite where only some rank's shard held it.
  const Batch<float> none{};
  for (std::size_t at = 0; at < 7; ++at) {
    for (const double p : {2.0, 1.0, std::numeric_limits<double>::infinity()}) {
      CAPTURE(at);
      CAPTURE(p);
      std::vector<double> norms(6, 0.0);
      std::vector<int> all_nan(3, 0);
      gradsync::run_threads(3, [&](Communicator<Threads>& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        ReplicatedTrainerOptions ro;
        ro.on_nonfinite = gradsync::OnNonfinite::ignore;
        ReplicatedTrainer rt(comm, NanAt{at}, gradsync::Sgd<float>(), ro);
        rt.forward_backward(none);
        norms[r] = rt.clip_grad_norm(1.0, p);
        // The NaN factor reaches every gradient, as torch's clip_grad_norm_
        // makes it, not only the NaN one: the finite ones do not go on unclipped.
        all_nan[r] = std::ranges::all_of(rt.gradients(), [](float g) { return std::isnan(g); });
        ShardedTrainerOptions so;
        so.on_nonfinite = gradsync::OnNonfinite::ignore;
        ShardedTrainer st(comm, NanAt{at}, gradsync::Sgd<float>(), so);
        st.forward_backward(none);
        norms[3 + r] = st.clip_grad_norm(1.0, p);
      });
      for (const double n : norms) CHECK(std::isnan(n));
      for (const int a : all_nan) CHECK(a == 1);
    }
  }
}

TEST_CASE("clip_grad_norm: refused outside forward_backward .. optimizer_step, and for p <= 0") {
  gradsync::run_threads(2, [&](Communicator<Threads>& comm) {
    ReplicatedTrainer rt(comm, model_for(comm.rank()), gradsync::Sgd<float>());
    ShardedTrainer st(comm, model_for(comm.rank()), gradsync::Sgd<float>());
    CHECK_THROWS_WITH_AS(rt.clip_grad_norm(1.0), doctest::Contains("between forward_backward() and optimizer_step()"),
                         gradsync::InvalidArgument);
    CHECK_THROWS_WITH_AS(st.clip_grad_norm(1.0), doctest::Contains("between forward_backward() and optimizer_step()"),
                         gradsync::InvalidArgument);
    CHECK_THROWS_AS(rt.optimizer_step(), gradsync::InvalidArgument);
    CHECK_THROWS_AS(st.optimizer_step(), gradsync::InvalidArgument);
    const Batch<float> b = random_batches(1, 1, 1, 2)[0][0];
    rt.forward_backward(b);
    st.forward_backward(b);
    CHECK_THROWS_WITH_AS(rt.clip_grad_norm(1.0, 0.0), doctest::Contains("p > 0"), gradsync::InvalidArgument);
    CHECK_THROWS_WITH_AS(st.clip_grad_norm(1.0, -2.0), doctest::Contains("p > 0"), gradsync::InvalidArgument);
    CHECK_THROWS_AS(rt.forward_backward(b), gradsync::InvalidArgument);
    CHECK_THROWS_AS(st.forward_backward(b), gradsync::InvalidArgument);
    rt.optimizer_step();
    st.optimizer_step();
  });
}

TEST_CASE("HybridShard: 4 ranks as groups x shards match ReplicatedTrainer and FullShard at N = 4") {
  const std::uint64_t seed = test::test_seed();
  INFO("seed = " << seed);
  constexpr int world = 4;
  const auto batches = random_batches(seed, 20, world, 3);
  for (const bool deterministic : {false, true}) {
    CAPTURE(deterministic);
    const auto sgd = gradsync::Sgd<float>({.lr = 0.05, .momentum = 0.9});
    const auto adam = gradsync::Adam<float>({.lr = 0.01});
    const std::vector<float> replicated_sgd = replicated_on_threads(batches, world, sgd, deterministic);
    const std::vector<float> replicated_adam = replicated_on_threads(batches, world, adam, deterministic);
    const std::vector<float> full_shard =
        train_sharded(batches, world, adam, ShardingStrategy::FullShard, deterministic);
    CHECK(worst_relative(full_shard, replicated_adam) <= 1e-6);
    for (const int shard_size : {1, 2, 4, 0}) {
      CAPTURE(shard_size);
      for (const bool with_adam : {false, true}) {
        CAPTURE(with_adam);
        std::vector<std::vector<float>> result(world);
        std::vector<std::vector<gradsync::ShardedTraceEvent>> traces(world);
        std::vector<std::size_t> bytes(world);
        ShardedTrainerOptions o;
        o.strategy = ShardingStrategy::HybridShard;
        o.shard_size = shard_size;
        o.collective.deterministic = deterministic;
        gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
          const auto r = static_cast<std::size_t>(comm.rank());
          auto run = [&](auto opt) {
            ShardedTrainer trainer(comm, model_for(comm.rank()), opt, o);
            for (const auto& step : batches) trainer.step(step[r]);
            result[r] = trainer.full_parameters();
            traces[r] = trainer.trace();
            bytes[r] = trainer.persistent_bytes();
          };
          if (with_adam) {
            run(adam);
          } else {
            run(sgd);
          }
        });
        for (const auto& x : result) CHECK(bitwise_equal(x, result[0]));
        CHECK(worst_relative(result[0], with_adam ? replicated_adam : replicated_sgd) <= 1e-6);
        // Shards of ⌈U/s⌉ elements, with s ranks per group.
        const std::size_t s = shard_size == 0 ? world : static_cast<std::size_t>(shard_size);
        std::size_t elements = 0;
        for (const std::size_t u : {25, 36, 7, 1}) elements += (u + s - 1) / s;
        CHECK(bytes[0] == (with_adam ? 16 : 12) * elements);
        // Per unit: FullShard's gathers, then one reduce-scatter and one all-reduce.
        std::vector<std::size_t> gathers(layers.size()), scatters(layers.size()), all_reduces(layers.size());
        for (const auto& e : traces[0]) {
          if (e.collective == gradsync::Collective::all_gather) ++gathers[e.unit];
          if (e.collective == gradsync::Collective::reduce_scatter) ++scatters[e.unit];
          if (e.collective == gradsync::Collective::all_reduce) ++all_reduces[e.unit];
        }
        for (std::size_t u = 0; u < layers.size(); ++u) {
          CHECK(gathers[u] == (u + 1 == layers.size() ? 1 : 2));
          CHECK(scatters[u] == 1);
          CHECK(all_reduces[u] == 1);
        }
      }
    }
  }
}

TEST_CASE("HybridShard: a shard_size that does not divide the world throws on every rank") {
  std::vector<std::string> messages(4);
  gradsync::run_threads(4, [&](Communicator<Threads>& comm) {
    try {
      ShardedTrainer trainer(comm, model_for(comm.rank()), gradsync::Sgd<float>(),
                             {.strategy = ShardingStrategy::HybridShard, .shard_size = 3});
    } catch (const gradsync::InvalidArgument& e) {
      messages[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const auto& m : messages) CHECK(m.find("shard_size that divides the world size 4, got 3") != std::string::npos);
}

TEST_CASE("on_nonfinite: a NaN or Inf in one rank's gradient or loss throws, skips or passes on every rank") {
  namespace nf = test_nonfinite;
  INFO("GRADSYNC_TEST_SEED = " << test::test_seed());
  auto g = test::rng_for("sharded on_nonfinite");
  for (const ShardingStrategy strategy : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp,
                                          ShardingStrategy::NoShard, ShardingStrategy::HybridShard}) {
    for (const bool bf16 : {false, true}) {
      INFO("strategy = " << std::string(name(strategy)) << ", reduce_dtype bfloat16 = " << bf16);
      const nf::Poison p = nf::draw(g);
      auto make_for = [&](gradsync::OnNonfinite policy) {
        return [policy, strategy, bf16, world = p.world](Communicator<Threads>& comm) {
          ShardedTrainerOptions o;
          o.strategy = strategy;
          o.shard_size = world % 2 == 0 ? 2 : 1;
          o.on_nonfinite = policy;
          o.collective.deterministic = true;
          if (bf16) o.reduce_dtype = gradsync::DataType::bfloat16;
          return ShardedTrainer(comm, nf::Model{nf::sizes}, gradsync::Sgd<float>({.lr = 0.1, .momentum = 0.9}), o);
        };
      };
      nf::check_policies(
          p, make_for, [](auto& t) { return t.shard(); }, [](auto& t) { return t.full_parameters(); },
          [](std::size_t u) { return "wrapped unit " + std::to_string(u) + " ('n" + std::to_string(u) + "')"; });
    }
  }
}

}  // namespace test_train_sharded_trainer
