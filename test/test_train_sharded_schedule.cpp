// ShardedTrainer's schedule: gradient accumulation in
// both modes, auto-wrap and the wrapping plan, the collectives of a step,
// and prefetch.
#include <doctest/doctest.h>

#include <gradsync/gradsync.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "support/common.hpp"
#include "support/refusals.hpp"
#include "support/sanitizer_sample.hpp"
#include "test_train_sharded_schedule.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_train_sharded_schedule {

using gradsync::AccumulationMode;
using gradsync::Collective;
using namespace test_schedule;

namespace {

gradsync::Sgd<float> momentum_sgd() { return gradsync::Sgd<float>({.lr = 0.05, .momentum = 0.9}); }

/// micro[s][k][r]: rank r's k-th micro-batch of step s.
using MicroBatches = std::vector<std::vector<std::vector<Batch<float>>>>;

/// Runs body(world, ranks, batches) at N = world = 1..max_world, each with
/// `steps` random batches of `b` samples per rank, seeded from `salt` and N;
/// the seed is printed on failure.
template <class Body>
void at_worlds_with_batches(const char* salt, int max_world, int steps, std::size_t b, Body body) {
  const std::uint64_t seed = test::rng_for(salt)();
  INFO("GRADSYNC_TEST_SEED = " << test::test_seed());
  for (int world = 1; world <= max_world; ++world) {
    CAPTURE(world);
    const Batches batches = random_batches(seed + static_cast<std::uint64_t>(world), steps, world, b);
    body(world, static_cast<std::size_t>(world), batches);
  }
}

/// Runs body(strategy, mode, o) for every strategy and both accumulation
/// modes, `o` being options_for(strategy, world) in that mode; a failure
/// names the two.
template <class Body>
void each_accumulation(int world, Body body) {
  for (const ShardingStrategy strategy : all_strategies) {
    for (const AccumulationMode mode : {AccumulationMode::Sharded, AccumulationMode::NoSync}) {
      INFO("strategy = " << std::string(name(strategy))
                         << ", mode = " << (mode == AccumulationMode::NoSync ? "NoSync" : "Sharded"));
      ShardedTrainerOptions o = options_for(strategy, world);
      o.accumulation = mode;
      body(strategy, mode, o);
    }
  }
}

}  // namespace

TEST_CASE("accumulation: K = 4 via NoSync, K = 4 via Sharded, and one step on a 4x batch agree") {
  constexpr int steps = 3;
  constexpr std::size_t K = 4, b = 3;
  const std::uint64_t seed = test::rng_for("accumulation")();
  INFO("GRADSYNC_TEST_SEED = " << test::test_seed());
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    const auto ranks = static_cast<std::size_t>(world);
    MicroBatches micro(steps);
    std::vector<std::vector<Batch<float>>> big(steps);
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(world));
    for (std::size_t s = 0; s < steps; ++s) {
      micro[s].assign(K, {});
      for (std::size_t k = 0; k < K; ++k)
        for (std::size_t r = 0; r < ranks; ++r) micro[s][k].push_back(random_batch(rng, b));
      // A micro-batch mean of b samples, averaged over K micro-batches of
      // equal size, is the mean over the K·b samples: the 4x batch's loss.
      for (std::size_t r = 0; r < ranks; ++r) {
        std::vector<Batch<float>> parts;
        for (std::size_t k = 0; k < K; ++k) parts.push_back(micro[s][k][r]);
        big[s].push_back(concatenate(parts));
      }
    }
    ReplicatedTrainerOptions ro;
    ro.sync.collective.deterministic = true;
    std::vector<float> replicated_big, replicated_accumulated;
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      ReplicatedTrainer one(comm, model_for(comm.rank()), momentum_sgd(), ro);
      ReplicatedTrainer many(comm, model_for(comm.rank()), momentum_sgd(), ro);
      for (std::size_t s = 0; s < steps; ++s) {
        one.step(big[s][r]);
        for (std::size_t k = 0; k + 1 < K; ++k) many.accumulate(micro[s][k][r]);
        many.step(micro[s][K - 1][r]);
      }
      if (r == 0) {
        replicated_big.assign(one.parameters().begin(), one.parameters().end());
        replicated_accumulated.assign(many.parameters().begin(), many.parameters().end());
      }
    });
    CHECK(worst_relative(replicated_accumulated, replicated_big) <= 1e-6);
    each_accumulation(world, [&](ShardingStrategy strategy, AccumulationMode mode, ShardedTrainerOptions so) {
      so.collective.deterministic = true;
      std::vector<std::vector<float>> accumulated(ranks), single(ranks);
      // Per rank: collectives in each micro-step's trace, and whether the
      // communicator saw any call in a NoSync micro-step.
      std::vector<std::vector<std::size_t>> micro_reductions(ranks);
      std::vector<std::uint64_t> micro_calls(ranks);
      gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        ShardedTrainer many(comm, model_for(comm.rank()), momentum_sgd(), so);
        ShardedTrainer one(comm, model_for(comm.rank()), momentum_sgd(), so);
        for (std::size_t s = 0; s < steps; ++s) {
          for (std::size_t k = 0; k + 1 < K; ++k) {
            const std::uint64_t before = comm.sequence();
            many.accumulate(micro[s][k][r]);
            micro_calls[r] += comm.sequence() - before;
            std::size_t reductions = 0;
            for (const auto& e : many.trace()) reductions += e.collective != Collective::all_gather;
            micro_reductions[r].push_back(reductions);
          }
          many.step(micro[s][K - 1][r]);
          one.step(big[s][r]);
        }
        accumulated[r] = many.full_parameters();
        single[r] = one.full_parameters();
      });
      for (std::size_t r = 0; r < ranks; ++r) {
        CAPTURE(r);
        CHECK(bitwise_equal(accumulated[r], accumulated[0]));
        CHECK(bitwise_equal(single[r], single[0]));
        for (const std::size_t n : micro_reductions[r]) {
          if (mode == AccumulationMode::NoSync) {
            CHECK(n == 0);
          } else {
            // One reduction per unit (HybridShard: and one across replicas).
            CHECK(n == layers.size() * (strategy == ShardingStrategy::HybridShard ? 2 : 1));
          }
        }
        // NoShard under NoSync: a micro-step talks to no one.
        if (mode == AccumulationMode::NoSync && strategy == ShardingStrategy::NoShard) CHECK(micro_calls[r] == 0);
      }
      CHECK(worst_relative(accumulated[0], replicated_big) <= 1e-6);
      CHECK(worst_relative(single[0], replicated_big) <= 1e-6);
      CHECK(worst_relative(accumulated[0], single[0]) <= 1e-6);
      // NoSync reduces 1/K of the local sum once, as ReplicatedTrainer does:
      // bitwise equal under the deterministic option (HybridShard sums by group).
      if (mode == AccumulationMode::NoSync && strategy != ShardingStrategy::HybridShard) {
        CHECK(bitwise_equal(accumulated[0], replicated_accumulated));
      }
    });
  }
}

namespace {

using Groups = std::vector<std::vector<std::size_t>>;

Groups groups_of(const gradsync::ShardPlan& plan) {
  Groups g;
  for (const auto& u : plan.units) g.push_back(u.model_units);
  return g;
}

/// Parameters of each model unit of model_for(): 25, 36, 7 and 1.
const gradsync::WrapPolicy size_30 = gradsync::WrapPolicy::size_based(30);
/// Ends a wrapped unit after model units 0 and 2 (by name, as a user would).
const gradsync::WrapPolicy by_name = gradsync::WrapPolicy::custom(
    [](const gradsync::UnitSpec& u, std::size_t, std::size_t) { return u.name == "layer0" || u.name == "layer2"; });

}  // namespace

TEST_CASE("wrap: each policy's grouping of consecutive model units") {
  const std::vector<gradsync::UnitSpec> specs = model_for(0).units();
  REQUIRE(specs.size() == 4);
  using gradsync::WrapPolicy;
  using Pairs = std::vector<std::pair<std::size_t, std::size_t>>;
  CHECK(WrapPolicy::per_unit().group(specs) == Pairs{{0, 0}, {1, 1}, {2, 2}, {3, 3}});
  // 25 < 30, 25 + 36 >= 30; then 7 + 1 never reaches 30 and forms the last unit.
  CHECK(WrapPolicy::size_based(30).group(specs) == Pairs{{0, 1}, {2, 3}});
  CHECK(WrapPolicy::size_based(25).group(specs) == Pairs{{0, 0}, {1, 1}, {2, 3}});
  CHECK(WrapPolicy::size_based(0).group(specs) == Pairs{{0, 0}, {1, 1}, {2, 2}, {3, 3}});
  CHECK(WrapPolicy::size_based(1000).group(specs) == Pairs{{0, 3}});
  CHECK(WrapPolicy::size_based(69).group(specs) == Pairs{{0, 3}});
  CHECK(WrapPolicy::size_based(68).group(specs) == Pairs{{0, 2}, {3, 3}});
  CHECK(by_name.group(specs) == Pairs{{0, 0}, {1, 2}, {3, 3}});
  // The predicate sees each unit's index and the group's parameters so far.
  std::vector<std::pair<std::size_t, std::size_t>> seen;
  const auto spy = WrapPolicy::custom([&](const gradsync::UnitSpec&, std::size_t i, std::size_t params) {
    seen.emplace_back(i, params);
    return false;
  });
  CHECK(spy.group(specs) == Pairs{{0, 3}});
  CHECK(seen == Pairs{{0, 25}, {1, 61}, {2, 68}, {3, 69}});
  CHECK(WrapPolicy::per_unit().group({}).empty());
  // Random unit sizes: size-based groups cover every unit once, in order, and
  // each but the last reaches the minimum while dropping its last unit does not.
  auto rng = test::rng_for("wrap grouping");
  INFO("GRADSYNC_TEST_SEED = " << test::test_seed());
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<gradsync::UnitSpec> random(1 + rng() % 12);
    std::vector<std::size_t> sizes;
    for (auto& u : random) {
      sizes.push_back(rng() % 40);
      u.params.push_back({"w", {sizes.back()}});
    }
    const std::size_t min = rng() % 100;
    CAPTURE(min);
    const Pairs g = WrapPolicy::size_based(min).group(random);
    REQUIRE(!g.empty());
    CHECK(g.front().first == 0);
    CHECK(g.back().second == random.size() - 1);
    for (std::size_t i = 0; i < g.size(); ++i) {
      std::size_t sum = 0;
      for (std::size_t m = g[i].first; m <= g[i].second; ++m) sum += sizes[m];
      // A group ends at the first unit that brings it to the minimum.
      CHECK((g[i].first == g[i].second || sum - sizes[g[i].second] < min));
      if (i + 1 < g.size()) {
        CHECK(g[i + 1].first == g[i].second + 1);
        CHECK(sum >= min);
      }
    }
  }
}

TEST_CASE("wrap: the trainer's plan follows its policy, and every rank agrees on a predicate's plan") {
  for (int world = 1; world <= 3; ++world) {
    CAPTURE(world);
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      ShardedTrainerOptions o;
      ShardedTrainer per_unit(comm, model_for(comm.rank()), momentum_sgd(), o);
      CHECK(groups_of(per_unit.plan()) == Groups{{0}, {1}, {2}, {3}});
      o.wrap = size_30;
      ShardedTrainer sized(comm, model_for(comm.rank()), momentum_sgd(), o);
      CHECK(groups_of(sized.plan()) == Groups{{0, 1}, {2, 3}});
      CHECK(sized.wrapped_unit_of(0) == 0);
      CHECK(sized.wrapped_unit_of(1) == 0);
      CHECK(sized.wrapped_unit_of(2) == 1);
      CHECK(sized.wrapped_unit_of(3) == 1);
      CHECK(sized.plan().units[0].name == "layer0..layer1");
      CHECK(sized.plan().units[1].name == "layer2..aux");
      o.wrap = by_name;
      ShardedTrainer named(comm, model_for(comm.rank()), momentum_sgd(), o);
      CHECK(groups_of(named.plan()) == Groups{{0}, {1, 2}, {3}});
    });
  }
  // A predicate that depends on the rank: every rank throws, none hangs.
  for (int world = 2; world <= 4; ++world) {
    CAPTURE(world);
    const std::vector<std::string> messages = construction_errors(world, [](Communicator<Threads>& comm) {
      ShardedTrainerOptions o;
      const int rank = comm.rank();
      o.wrap = gradsync::WrapPolicy::custom(
          [rank](const gradsync::UnitSpec&, std::size_t i, std::size_t) { return i == (rank == 1 ? 1u : 0u); });
      ShardedTrainer trainer(comm, model_for(comm.rank()), momentum_sgd(), o);
    });
    for (const auto& m : messages) {
      CHECK(m == messages[0]);
      CHECK(m.find("ShardedTrainer wrapping plan") != std::string::npos);
      CHECK(m.find("must group the units alike on every rank") != std::string::npos);
    }
  }
}

TEST_CASE("wrap: the plan's numbers equal hand-computed sizes, an empty shard included") {
  // Model units of 3, 2, 40 and 1 parameters; at least 5 per wrapped unit
  // gives {3 + 2}, {40}, {1}. At N = 4: chunks of 2 (ranks own 2, 2, 1, 0:
  // rank 3's is empty), 10, and 1 (only rank 0 owns anything).
  const std::vector<gradsync::UnitSpec> units{{"a", {{"w", {3}}}, {}},
                                              {"b", {{"w", {2}}}, {}},
                                              {"c", {{"w", {8, 5}}}, {}},
                                              {"d", {{"w", {1}}}, {}}};
  constexpr int world = 4;
  std::vector<std::string> printed(world);
  std::vector<std::vector<std::size_t>> owned(world);
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    ShardedTrainerOptions o;
    o.wrap = gradsync::WrapPolicy::size_based(5);
    ShardedTrainer trainer(comm, test_train::Declared<float>{units}, gradsync::Adam<float>(), o);
    const gradsync::ShardPlan& plan = trainer.plan();
    REQUIRE(plan.units.size() == 3);
    CHECK(groups_of(plan) == Groups{{0, 1}, {2}, {3}});
    CHECK(plan.shards == 4);
    CHECK(plan.replicas == 1);
    CHECK(plan.element_bytes == 4);
    CHECK(plan.state_per_element == 2);
    CHECK(plan.strategy == "FullShard");
    CHECK(plan.model_units() == 4);
    CHECK(plan.params() == 46);
    const std::size_t params[] = {5, 40, 1}, shard[] = {2, 10, 1}, padding[] = {3, 0, 3};
    for (std::size_t w = 0; w < 3; ++w) {
      CAPTURE(w);
      CHECK(plan.units[w].params == params[w]);
      CHECK(plan.units[w].shard == shard[w]);
      CHECK(plan.units[w].padding == padding[w]);
      // Adam: parameter, gradient, m and v, 4 bytes each, per chunk element.
      CHECK(plan.units[w].bytes_per_rank == 16 * shard[w]);
      CHECK(plan.units[w].gathered_bytes == 4 * 4 * shard[w]);
      CHECK(trainer.unit_size(w) == params[w]);
      CHECK(trainer.chunk_size(w) == shard[w]);
      owned[static_cast<std::size_t>(comm.rank())].push_back(trainer.owned_range(w).second);
    }
    CHECK(plan.bytes_per_rank() == 16 * (2 + 10 + 1));
    CHECK(plan.bytes_per_rank() == trainer.persistent_bytes());
    CHECK(plan.max_gathered_bytes() == 160);
    // What Declared writes at bind, unit by unit: element i is i % 7 − 3.
    std::vector<float> expected;
    for (const std::size_t p : {3, 2, 40, 1})
      for (std::size_t i = 0; i < p; ++i) expected.push_back(static_cast<float>(i % 7) - 3.0f);
    CHECK(bitwise_equal(trainer.full_parameters(), expected));
    std::ostringstream os;
    os << plan;
    printed[static_cast<std::size_t>(comm.rank())] = os.str();
    CHECK(os.str() == gradsync::to_string(plan));
  });
  CHECK(owned[0] == std::vector<std::size_t>{2, 10, 1});
  CHECK(owned[1] == std::vector<std::size_t>{2, 10, 0});
  CHECK(owned[2] == std::vector<std::size_t>{1, 10, 0});
  CHECK(owned[3] == std::vector<std::size_t>{0, 10, 0});
  INFO(printed[0]);
  for (const auto& p : printed) CHECK(p == printed[0]);
  const std::string& p = printed[0];
  CHECK(p.find("wrapping plan: 3 wrapped units of 4 model units, size-based (at least 5 parameters)") == 0);
  CHECK(p.find("FullShard over 4 ranks x 1 replica, 4-byte elements, optimizer state 2 per parameter") !=
        std::string::npos);
  CHECK(p.find("a..b") != std::string::npos);
  // One header, three units and a total.
  CHECK(std::count(p.begin(), p.end(), '\n') == 2 + 1 + 3 + 1);
}

TEST_CASE("wrap: a size-wrapped run equals ReplicatedTrainer (bitwise when deterministic), every strategy") {
  const std::uint64_t seed = test::rng_for("wrap parity")();
  INFO("GRADSYNC_TEST_SEED = " << test::test_seed());
  const auto adam = gradsync::Adam<float>({.lr = 0.01});
  for_each_parity_run(seed, adam, [&](int world, const Batches& batches, const std::vector<float>& replicated,
                                      bool deterministic) {
    for (const ShardingStrategy strategy : all_strategies) {
      for (const bool named : {false, true}) {
        INFO("strategy = " << std::string(name(strategy)) << ", wrap = " << (named ? "by name" : "size 30"));
        ShardedTrainerOptions so = options_for(strategy, world);
        so.collective.deterministic = deterministic;
        so.wrap = named ? by_name : size_30;
        check_sharded_run(batches, world, adam, so, replicated);
      }
    }
  });
}

TEST_CASE("trace: the collectives of one step, in order, per strategy and wrapping") {
  at_worlds_with_batches("trace", 4, 2, 2, [&](int world, std::size_t ranks, const Batches& batches) {
    for (const ShardingStrategy strategy : all_strategies) {
      for (const bool keep : {true, false}) {
        for (const bool wrapped : {false, true}) {
          INFO("strategy = " << std::string(name(strategy)) << ", keep_last_forward_unit = " << keep
                             << ", wrap = " << (wrapped ? "size 30" : "per unit"));
          ShardedTrainerOptions o = options_for(strategy, world);
          o.keep_last_forward_unit = keep;
          if (wrapped) o.wrap = size_30;
          std::vector<Trace> traces(ranks);
          std::vector<std::uint64_t> calls(ranks);
          gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
            const auto r = static_cast<std::size_t>(comm.rank());
            ShardedTrainer trainer(comm, model_for(comm.rank()), momentum_sgd(), o);
            trainer.step(batches[0][r]);
            const std::uint64_t before = comm.sequence();
            trainer.step(batches[1][r]);
            calls[r] = comm.sequence() - before;
            traces[r] = trainer.trace();
          });
          const Trace expected = expected_trace(strategy, wrapped ? 2 : layers.size(), keep);
          for (std::size_t r = 0; r < ranks; ++r) {
            CAPTURE(r);
            CHECK(describe(traces[r]) == describe(expected));
            // Nothing else on the communicator but the buffers' broadcast and
            // the agreement on finite gradients (HybridShard's collectives
            // run on its split communicators).
            if (world > 1 && strategy != ShardingStrategy::HybridShard) CHECK(calls[r] == expected.size() + 2);
          }
        }
      }
    }
  });
}

namespace {

using gradsync::BackwardPrefetch;

const char* name(BackwardPrefetch p) {
  switch (p) {
    case BackwardPrefetch::None: return "None";
    case BackwardPrefetch::BackwardPre: return "BackwardPre";
    case BackwardPrefetch::BackwardPost: return "BackwardPost";
  }
  return "?";
}

/// Index of the n-th (0-based) event `c` of `unit` in `t`, or t.size().
std::size_t find(const Trace& t, Collective c, std::size_t unit, std::size_t n = 0) {
  for (std::size_t i = 0; i < t.size(); ++i) {
    if (t[i].collective == c && t[i].unit == unit && n-- == 0) return i;
  }
  return t.size();
}

std::size_t count(const Trace& t, Collective c, std::size_t unit) {
  std::size_t n = 0;
  for (const auto& e : t) n += e.collective == c && e.unit == unit;
  return n;
}

/// Passes a StepContext through, calling `before_ready(u)` before each ready.
class Relay final : public gradsync::detail::UnitProvider<float> {
 public:
  Relay(const gradsync::StepContext<float>& ctx, const std::function<void(std::size_t)>& hook, std::size_t units)
      : ctx_(ctx), hook_(hook), held_(units) {}
  const gradsync::UnitView<float>& acquire(std::size_t u) override { return *held_.at(u).emplace(ctx_.params(u)); }
  void release(std::size_t u) noexcept override { held_[u].reset(); }
  void ready(std::size_t u) override {
    if (hook_) hook_(u);
    ctx_.ready(u);
  }

 private:
  const gradsync::StepContext<float>& ctx_;
  const std::function<void(std::size_t)>& hook_;
  std::vector<std::optional<gradsync::UnitParams<float>>> held_;
};

/// model_for()'s Mlp, with a hook the test sets to look at the trainer as
/// each unit is reported ready (after its gradient is computed).
struct Spied {
  using value_type = float;
  test_train::Mlp<float> mlp;
  std::function<void(std::size_t)> before_ready;

  std::vector<gradsync::UnitSpec> units() const { return mlp.units(); }
  void bind(std::span<const gradsync::UnitView<float>> views) { mlp.bind(views); }
  double forward_backward(const Batch<float>& batch, const gradsync::StepContext<float>& ctx) {
    Relay relay(ctx, before_ready, layers.size());
    return mlp.forward_backward(batch, gradsync::StepContext<float>(relay));
  }
};

}  // namespace

TEST_CASE("prefetch: gather(i-1) before reduce-scatter(i) under BackwardPre and BackwardPost, within the limit") {
  test::SanitizerSample sample("prefetch trace", 4);
  at_worlds_with_batches("prefetch trace", 4, 2, 2, [&](int world, std::size_t ranks, const Batches& batches) {
    for (const ShardingStrategy strategy : {ShardingStrategy::FullShard, ShardingStrategy::HybridShard,
                                            ShardingStrategy::ShardGradOp}) {
      for (const bool wrapped : {false, true}) {
        for (const BackwardPrefetch backward :
             {BackwardPrefetch::None, BackwardPrefetch::BackwardPre, BackwardPrefetch::BackwardPost}) {
          for (const bool forward : {false, true}) {
            for (const std::size_t limit : {std::size_t{2}, std::size_t{1}, std::size_t{3}, std::size_t{0}}) {
              if (!sample.keep()) continue;
              INFO("strategy = " << std::string(name(strategy)) << ", wrap = " << (wrapped ? "size 30" : "per unit")
                                 << ", backward = " << std::string(name(backward)) << ", forward = " << forward
                                 << ", limit = " << limit);
              ShardedTrainerOptions o = options_for(strategy, world);
              if (wrapped) o.wrap = size_30;
              o.backward_prefetch = backward;
              o.forward_prefetch = forward;
              o.limit_all_gathers = limit;
              std::vector<Trace> traces(ranks);
              gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
                const auto r = static_cast<std::size_t>(comm.rank());
                ShardedTrainer trainer(comm, model_for(comm.rank()), momentum_sgd(), o);
                trainer.step(batches[0][r]);
                trainer.step(batches[1][r]);
                traces[r] = trainer.trace();
              });
              const Trace& t = traces[0];
              INFO("trace:" << describe(t));
              for (const Trace& other : traces) CHECK(describe(other) == describe(t));
              const std::size_t units = wrapped ? 2 : layers.size();
              // Prefetch moves gathers earlier, never adds or drops one.
              const Trace plain = expected_trace(strategy, units, true);
              for (std::size_t w = 0; w < units; ++w) {
                CHECK(count(t, Collective::all_gather, w) == count(plain, Collective::all_gather, w));
                CHECK(count(t, Collective::reduce_scatter, w) == 1);
              }
              if (strategy == ShardingStrategy::ShardGradOp) continue;  // nothing gathered in backward
              // Never more gathered than the limit (nothing is held twice here).
              for (const auto& e : t) {
                if (e.collective == Collective::all_gather && limit != 0) CHECK(e.gathered <= limit);
              }
              const bool prefetches = limit == 0 || limit >= 2;
              for (std::size_t w = 1; w < units; ++w) {
                CAPTURE(w);
                // Unit w−1's backward gather is its second; unit w's reduction its only one.
                const std::size_t gather = find(t, Collective::all_gather, w - 1, 1);
                const std::size_t reduce = find(t, Collective::reduce_scatter, w);
                REQUIRE(gather < t.size());
                REQUIRE(reduce < t.size());
                if (backward != BackwardPrefetch::None && prefetches) {
                  CHECK(gather < reduce);
                  if (backward == BackwardPrefetch::BackwardPost) CHECK(gather + 1 == reduce);
                } else {
                  CHECK(gather > reduce);
                }
                // Forward: unit w's gather was issued with w−1 still in use.
                CHECK(t[find(t, Collective::all_gather, w)].gathered == (forward && prefetches ? 2u : 1u));
              }
            }
          }
        }
      }
    }
  });
}

TEST_CASE("prefetch: BackwardPre gathers unit i-1 before unit i's gradient is computed, BackwardPost after") {
  at_worlds_with_batches("prefetch timing", 4, 1, 2, [&](int world, std::size_t ranks, const Batches& batches) {
    for (const BackwardPrefetch backward :
         {BackwardPrefetch::None, BackwardPrefetch::BackwardPre, BackwardPrefetch::BackwardPost}) {
      INFO("backward = " << std::string(name(backward)));
      // gathers[r][u]: unit u−1's gathers in the trace when unit u was reported ready.
      std::vector<std::vector<std::size_t>> gathers(ranks, std::vector<std::size_t>(layers.size()));
      gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        ShardedTrainerOptions o;
        o.backward_prefetch = backward;
        ShardedTrainer trainer(comm, Spied{model_for(comm.rank()), {}}, momentum_sgd(), o);
        trainer.model().before_ready = [&](std::size_t u) {
          if (u > 0) gathers[r][u] = count(trainer.trace(), Collective::all_gather, u - 1);
        };
        trainer.step(batches[0][r]);
      });
      for (std::size_t r = 0; r < ranks; ++r) {
        for (std::size_t u = 1; u < layers.size(); ++u) {
          CAPTURE(r);
          CAPTURE(u);
          // Forward's gather, and under BackwardPre already backward's.
          CHECK(gathers[r][u] == (backward == BackwardPrefetch::BackwardPre ? 2u : 1u));
        }
      }
    }
  });
}

TEST_CASE("prefetch: parity with ReplicatedTrainer still holds, bitwise when deterministic") {
  const std::uint64_t seed = test::rng_for("prefetch parity")();
  INFO("GRADSYNC_TEST_SEED = " << test::test_seed());
  const auto adam = gradsync::Adam<float>({.lr = 0.01});
  test::SanitizerSample sample("prefetch parity", 4);
  for_each_parity_run(seed, adam, [&](int world, const Batches& batches, const std::vector<float>& replicated,
                                      bool deterministic) {
    for (const ShardingStrategy strategy : all_strategies) {
      for (const BackwardPrefetch backward : {BackwardPrefetch::BackwardPre, BackwardPrefetch::BackwardPost}) {
        for (const bool wrapped : {false, true}) {
          if (!sample.keep()) continue;
          INFO("strategy = " << std::string(name(strategy)) << ", backward = " << std::string(name(backward))
                             << ", wrap = " << (wrapped ? "size 30" : "per unit"));
          ShardedTrainerOptions so = options_for(strategy, world);
          so.collective.deterministic = deterministic;
          so.forward_prefetch = true;
          so.backward_prefetch = backward;
          if (wrapped) so.wrap = size_30;
          check_sharded_run(batches, world, adam, so, replicated);
        }
      }
    }
  });
}

TEST_CASE("mixed precision: bfloat16 gathers and reductions train within bfloat16 tolerance; bytes per collective") {
  using gradsync::DataType;
  const auto sgd = gradsync::Sgd<float>({.lr = 0.1});
  constexpr int steps = 10;
  at_worlds_with_batches("mixed precision", 4, steps, 3, [&](int world, std::size_t ranks, const Batches& batches) {
    for (const ShardingStrategy strategy : all_strategies) {
      struct Run {
        std::vector<float> params;
        Trace trace;
      };
      auto run = [&](std::optional<DataType> param, std::optional<DataType> reduce, bool check_gathered) {
        ShardedTrainerOptions o = options_for(strategy, world);
        o.param_dtype = param;
        o.reduce_dtype = reduce;
        std::vector<Run> out(ranks);
        gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
          const auto r = static_cast<std::size_t>(comm.rank());
          ShardedTrainer trainer(comm, model_for(comm.rank()), sgd, o);
          for (const auto& step : batches) trainer.step(step[r]);
          out[r].params = trainer.full_parameters();
          out[r].trace = trainer.trace();
          if (!check_gathered) return;
          // What the model sees is the fp32 master rounded to bfloat16, once.
          const std::vector<float> master = out[r].params;
          trainer.evaluate([&](const gradsync::StepContext<float>& ctx) {
            std::size_t at = 0;
            for (std::size_t u = 0; u < layers.size(); ++u) {
              const auto p = ctx.params(u);
              for (const float x : p->flat_params) {
                const float rounded = static_cast<float>(gradsync::bfloat16(master[at++]));
                CHECK(std::memcmp(&x, &rounded, sizeof(float)) == 0);
              }
            }
          });
        });
        for (const Run& x : out) CHECK(bitwise_equal(x.params, out[0].params));
        return out[0];
      };
      INFO("strategy = " << std::string(name(strategy)));
      const bool gathers = strategy != ShardingStrategy::NoShard;
      const Run fp32 = run(std::nullopt, std::nullopt, false);
      const Run bf16_params = run(DataType::bfloat16, std::nullopt, gathers);
      const Run bf16_both = run(DataType::bfloat16, DataType::bfloat16, false);
      const Run explicit_fp32 = run(DataType::float32, DataType::float32, false);
      CHECK(bitwise_equal(explicit_fp32.params, fp32.params));
      // Each gathered parameter and reduced gradient is off by at most 2^-9
      // relative (round to nearest); over 10 steps of lr 0.1 on this small
      // model the parameters end 1e-4 to 3e-4 from the fp32 run (measured at
      // N = 1..4): 2^-9 leaves room, 1e-6 would not.
      const double tolerance = std::ldexp(1.0, -9);
      CHECK(worst_relative(bf16_params.params, fp32.params) <= tolerance);
      CHECK(worst_relative(bf16_both.params, fp32.params) <= tolerance);
      if (gathers) CHECK(!bitwise_equal(bf16_params.params, fp32.params));
      // One rank reduces nothing, so nothing is rounded for the wire.
      if (world > 1) CHECK(!bitwise_equal(bf16_both.params, bf16_params.params));
      // Ranks a unit is split over.
      const auto n = static_cast<std::size_t>(
          strategy == ShardingStrategy::HybridShard && hybrid_shard_size(world) != 0 ? hybrid_shard_size(world) : world);
      // Bytes of each collective: the gather in param_dtype, the reduction in
      // reduce_dtype, fp32 (the master type) unless told otherwise.
      for (const Run* x : {&fp32, &bf16_params, &bf16_both}) {
        const std::size_t param_bytes = x == &fp32 ? 4 : 2, reduce_bytes = x == &bf16_both && world > 1 ? 2 : 4;
        std::size_t all_gathers = 0, reductions = 0;
        for (const auto& e : x->trace) {
          const std::size_t P = unit_sizes[e.unit];
          const std::size_t c = (P + n - 1) / n;
          if (e.collective == Collective::all_gather) {
            CHECK(e.bytes == n * c * param_bytes);
            ++all_gathers;
          } else if (e.collective == Collective::reduce_scatter) {
            CHECK(e.bytes == n * c * reduce_bytes);
            ++reductions;
          } else if (strategy == ShardingStrategy::NoShard) {
            CHECK(e.bytes == P * reduce_bytes);
            ++reductions;
          } else {
            // HybridShard's across replicas: this rank's chunk.
            CHECK(e.bytes == (P + n - 1) / n * reduce_bytes);
          }
        }
        CHECK(all_gathers == (gathers ? expected_trace(strategy, layers.size(), true).size() - layers.size() *
                                                (strategy == ShardingStrategy::HybridShard ? 2 : 1)
                                      : 0));
        CHECK(reductions == layers.size());
      }
    }
  });
}

TEST_CASE("mixed precision: a dtype other than the master type or bfloat16 throws on every rank") {
  for (int world = 1; world <= 3; ++world) {
    const std::vector<std::string> messages = test::refusals_on_threads(world, [&](Communicator<Threads>& comm) {
      ShardedTrainerOptions o;
      o.reduce_dtype = gradsync::DataType::int32;
      ShardedTrainer trainer(comm, model_for(comm.rank()), momentum_sgd(), o);
    });
    for (const auto& m : messages) {
      CHECK(m.find("reduce_dtype must be the master type (float) or bfloat16, got int32") != std::string::npos);
    }
  }
}

namespace {

/// model_for()'s Mlp that throws in backward, or returns a NaN loss, when told to.
struct Throwing {
  using value_type = float;
  test_train::Mlp<float> mlp;
  bool fail = false;
  bool nan_loss = false;

  std::vector<gradsync::UnitSpec> units() const { return mlp.units(); }
  void bind(std::span<const gradsync::UnitView<float>> views) { mlp.bind(views); }
  double forward_backward(const Batch<float>& batch, const gradsync::StepContext<float>& ctx) {
    const double loss = mlp.forward_backward(batch, ctx);
    if (fail) throw std::runtime_error("the model failed");
    return nan_loss ? std::numeric_limits<double>::quiet_NaN() : loss;
  }
};

}  // namespace

TEST_CASE("accumulation: an evaluation between micro-steps changes nothing; a micro-step that throws drops them, "
          "and the losses noted for them") {
  at_worlds_with_batches("accumulation interrupted", 3, 4, 3,
                         [&](int world, std::size_t ranks, const Batches& batches) {
    each_accumulation(world, [&](ShardingStrategy strategy, AccumulationMode, ShardedTrainerOptions o) {
      o.backward_prefetch = BackwardPrefetch::BackwardPre;
      // Under HybridShard a throw in a step ends the trainer on every rank
      // (hybrid_groups.hpp says why): the next micro-step fails, naming it,
      // and the evaluation between micro-steps is checked without the throw.
      const bool throw_ends = strategy == ShardingStrategy::HybridShard && world > 1;
      // plain: micro-steps 0, 1 and the step on 2. interrupted: the same with
      // an evaluation after 0, and a failed micro-step (then 3) before it all.
      // The last rank's loss in the micro-step that the failure drops is a
      // NaN: dropped with it, it must not fail the step (on_nonfinite).
      std::vector<std::vector<float>> plain(ranks), interrupted(ranks);
      std::vector<std::string> errors(ranks);
      gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        ShardedTrainer a(comm, Throwing{model_for(comm.rank()), false}, momentum_sgd(), o);
        a.accumulate(batches[0][r]);
        a.accumulate(batches[1][r]);
        a.step(batches[2][r]);
        plain[r] = a.full_parameters();

        // Runs `b` into a micro-step whose model throws, and returns what it threw.
        auto fail_a_micro_step = [&](auto& b) {
          b.model().fail = true;
          try {
            b.accumulate(batches[3][r]);
          } catch (const std::runtime_error& e) {
            errors[r] = e.what();
          }
          b.model().fail = false;
        };
        ShardedTrainer b(comm, Throwing{model_for(comm.rank()), false}, momentum_sgd(), o);
        if (!throw_ends) {
          b.model().nan_loss = comm.rank() == comm.size() - 1;
          b.accumulate(batches[3][r]);
          b.model().nan_loss = false;
          fail_a_micro_step(b);
        }
        b.accumulate(batches[0][r]);
        b.evaluate([&](const gradsync::StepContext<float>& ctx) {
          for (std::size_t u = 0; u < layers.size(); ++u) const auto p = ctx.params(u);
          return 0;
        });
        b.accumulate(batches[1][r]);
        b.step(batches[2][r]);
        interrupted[r] = b.full_parameters();
        if (throw_ends) {
          // Last, on a trainer of its own: the failure ends it on every rank.
          ShardedTrainer c(comm, Throwing{model_for(comm.rank()), false}, momentum_sgd(), o);
          fail_a_micro_step(c);
          CHECK_THROWS_WITH_AS(c.accumulate(batches[0][r]), doctest::Contains("'s model threw in"), gradsync::Error);
        }
      });
      for (std::size_t r = 0; r < ranks; ++r) {
        CAPTURE(r);
        CHECK(errors[r] == "the model failed");
        CHECK(bitwise_equal(interrupted[r], plain[r]));
      }
    });
  });
}

TEST_CASE("a step or first micro-step whose backward throws leaves no gradient behind, on both trainers") {
  // The model throws after its whole backward, on every rank alike, in a
  // plain step() or in the first accumulate() of a window: the next steps
  // must be those of a run where the failed call never happened (except
  // under HybridShard, where the next step fails on every rank). Under
  // NoShard, and in ReplicatedTrainer, the backward writes into the very
  // gradient the next step reduces.
  auto rng = test::rng_for("failed first micro-step");
  INFO("GRADSYNC_TEST_SEED = " << test::test_seed());
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    const auto ranks = static_cast<std::size_t>(world);
    const Batches batches = random_batches(rng(), 4, world, 3);
    for (const bool in_accumulate : {false, true}) {
      CAPTURE(in_accumulate);
      // Runs: [the failed call,] step(0), accumulate(1), step(2).
      auto train = [&](auto& t, std::size_t r, bool fail) {
        if (fail) {
          t.model().fail = true;
          CHECK_THROWS_WITH_AS(in_accumulate ? t.accumulate(batches[3][r]) : t.step(batches[3][r]),
                               "the model failed", std::runtime_error);
          t.model().fail = false;
        }
        t.step(batches[0][r]);
        t.accumulate(batches[1][r]);
        t.step(batches[2][r]);
        if constexpr (requires { t.full_parameters(); }) {
          return t.full_parameters();
        } else {
          return std::vector<float>(t.parameters().begin(), t.parameters().end());
        }
      };
      const std::vector<ShardingStrategy> strategies(std::begin(all_strategies), std::end(all_strategies));
      for (std::size_t k = 0; k <= strategies.size(); ++k) {
        const bool replicated = k == strategies.size();
        INFO("trainer = " << (replicated ? std::string("ReplicatedTrainer") : std::string(name(strategies[k]))));
        std::vector<std::vector<float>> plain(ranks), failed(ranks);
        gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
          const auto r = static_cast<std::size_t>(comm.rank());
          auto run = [&](bool fail) {
            if (replicated) {
              ReplicatedTrainer t(comm, Throwing{model_for(comm.rank()), false}, momentum_sgd(), ReplicatedTrainerOptions{});
              return train(t, r, fail);
            }
            ShardedTrainer t(comm, Throwing{model_for(comm.rank()), false}, momentum_sgd(),
                             options_for(strategies[k], world));
            if (fail && strategies[k] == ShardingStrategy::HybridShard && world > 1) {
              // Under HybridShard a throw in a step ends the trainer on every
              // rank (hybrid_groups.hpp says why): the next step fails, naming it.
              t.model().fail = true;
              CHECK_THROWS_WITH_AS(in_accumulate ? t.accumulate(batches[3][r]) : t.step(batches[3][r]),
                                   "the model failed", std::runtime_error);
              t.model().fail = false;
              CHECK_THROWS_WITH_AS(t.step(batches[0][r]), doctest::Contains("'s model threw in"), gradsync::Error);
              return plain[r];
            }
            return train(t, r, fail);
          };
          plain[r] = run(false);
          failed[r] = run(true);
        });
        for (std::size_t r = 0; r < ranks; ++r) {
          CAPTURE(r);
          CHECK(bitwise_equal(failed[r], plain[r]));
        }
      }
    }
  }
}

// FSDP's SHARD_GRAD_OP inside no_sync keeps the gathered parameters until
// the synced step's backward: one gather per unit per accumulation window,
// in its first micro-step, and then every unit gathered beside every
// gradient buffer, which is memory_need()'s NoSync figure, reached. FullShard
// and HybridShard still gather in every micro-step (twice a unit, the last
// of forward once) and free after each backward. Results: the accumulation
// case above checks them bitwise against ReplicatedTrainer.
TEST_CASE("accumulation: ShardGradOp under NoSync gathers each unit once per window, and holds what memory_need says") {
  const std::uint64_t seed = test::rng_for("accumulation gathers")();
  INFO("GRADSYNC_TEST_SEED = " << test::test_seed());
  constexpr std::size_t windows = 2;
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    const auto ranks = static_cast<std::size_t>(world);
    const Batches batches = random_batches(seed + static_cast<std::uint64_t>(world), 4, world, 3);
    for (const ShardingStrategy strategy :
         {ShardingStrategy::ShardGradOp, ShardingStrategy::FullShard, ShardingStrategy::HybridShard}) {
      INFO("strategy = " << std::string(name(strategy)));
      for (const std::size_t K : {std::size_t{1}, std::size_t{2}, std::size_t{4}}) {
        CAPTURE(K);
        ShardedTrainerOptions o = options_for(strategy, world);
        o.accumulation = AccumulationMode::NoSync;
        // Per rank and micro-step (windows·K of them): the units gathered, in order.
        std::vector<std::vector<std::vector<std::size_t>>> gathered(ranks);
        std::vector<std::size_t> peak(ranks), need(ranks), units(ranks);
        gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
          const auto r = static_cast<std::size_t>(comm.rank());
          ShardedTrainer t(comm, model_for(comm.rank()), momentum_sgd(), o);
          for (std::size_t w = 0; w < windows; ++w) {
            for (std::size_t k = 0; k < K; ++k) {
              if (k + 1 < K) {
                t.accumulate(batches[k][r]);
              } else {
                t.step(batches[k][r]);
              }
              std::vector<std::size_t> these;
              for (const auto& e : t.trace()) {
                if (e.collective == Collective::all_gather) these.push_back(e.unit);
              }
              gathered[r].push_back(std::move(these));
            }
          }
          peak[r] = t.peak_transient_bytes();
          need[r] = t.memory_need().transient();
          units[r] = t.unit_count();
        });
        for (std::size_t r = 0; r < ranks; ++r) {
          CAPTURE(r);
          REQUIRE(gathered[r].size() == windows * K);
          std::vector<std::size_t> in_order(units[r]);
          for (std::size_t u = 0; u < in_order.size(); ++u) in_order[u] = u;
          const std::size_t per_step = [&] {
            std::size_t n = 0;
            for (const auto& e : expected_trace(strategy, units[r], o.keep_last_forward_unit)) {
              n += e.collective == Collective::all_gather;
            }
            return n;
          }();
          for (std::size_t i = 0; i < gathered[r].size(); ++i) {
            CAPTURE(i);
            if (strategy == ShardingStrategy::ShardGradOp) {
              // The window's first micro-step gathers each unit once, in forward order; the rest gather nothing.
              if (i % K == 0) {
                CHECK(gathered[r][i] == in_order);
              } else {
                CHECK(gathered[r][i].empty());
              }
            } else {
              CHECK(gathered[r][i].size() == per_step);
            }
          }
          CHECK(peak[r] <= need[r]);
          if (strategy == ShardingStrategy::ShardGradOp && K > 1) CHECK(peak[r] == need[r]);
        }
      }
    }
  }
}

}  // namespace test_train_sharded_schedule
