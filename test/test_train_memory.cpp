// What the trainers hold per rank: persistent bytes against the formula,
// the measured peak of transient bytes against its prediction, and the
// memory_budget that refuses a configuration before it starts.
#include <doctest/doctest.h>

#include <gradsync/gradsync.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "support/common.hpp"
#include "support/refusals.hpp"
#include "support/sanitizers.hpp"
#include "test_train_sharded_schedule.hpp"
#include "test_train_squares.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_train_memory {

using gradsync::MemoryNeed;
using namespace test_schedule;
using namespace test_squares;

namespace {

/// Σ⌈P/N⌉ over the units: the elements of one rank's shard, padding included.
std::size_t padded_chunks(const std::vector<std::size_t>& sizes, std::size_t n) {
  std::size_t c = 0;
  for (const std::size_t p : sizes) c += (p + n - 1) / n;
  return c;
}

std::size_t sum(const std::vector<std::size_t>& sizes) {
  std::size_t s = 0;
  for (const std::size_t p : sizes) s += p;
  return s;
}

/// Runs body(world, n, sizes) at N = world = 1..4, each with its own
/// random unit sizes from the generator of `salt`; the seed and the sizes
/// are printed on failure.
template <class Body>
void at_worlds_with_sizes(const std::string& salt, Body body) {
  auto rng = test::rng_for(salt);
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    const auto n = static_cast<std::size_t>(world);
    const std::vector<std::size_t> sizes = random_sizes(rng, world);
    INFO("seed = " << test::test_seed() << ", sizes = " << joined(sizes));
    body(world, n, sizes);
  }
}

/// Per rank, with c_u = ⌈P_u/N⌉: a gathered unit is N·c_u elements, and so
/// is its gradient buffer (the reduce-scatter writes into the shard).
std::size_t gathered(std::size_t p, std::size_t n) { return n * ((p + n - 1) / n); }
std::size_t gradient_buffer(std::size_t p, std::size_t n) { return gathered(p, n); }

/// On each trainer in turn: a micro-step of factor 1 + r, then a step of r/2.
template <class... Trainers>
void accumulate_then_step(float r, Trainers&... trainers) {
  ((trainers.accumulate(Scale{1.0f + r}), trainers.step(Scale{0.5f * r})), ...);
}

template <class Opt>
void check_persistent_and_peak(const char* opt_name, Opt opt, std::size_t state) {
  INFO("optimizer = " << std::string(opt_name));
  const std::string salt = std::string("memory persistent ") + opt_name;
  at_worlds_with_sizes(salt, [&](int world, std::size_t n, const std::vector<std::size_t>& sizes) {
    const std::size_t psi = sum(sizes), chunks = padded_chunks(sizes, n);
    std::size_t g_max = 0, g_sum = 0, r_max = 0;
    for (const std::size_t p : sizes) {
      g_max = std::max(g_max, gathered(p, n));
      g_sum += gathered(p, n);
      r_max = std::max(r_max, gradient_buffer(p, n));
    }
    for (const ShardingStrategy s : all_strategies) {
      INFO("strategy = " << name(s));
      const bool sharded = s != ShardingStrategy::NoShard;
      // Padding included: every rank holds ⌈P/N⌉ per unit, whatever it owns.
      const std::size_t elements = sharded ? chunks : psi;
      gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
        const ShardedTrainerOptions o{.strategy = s};
        ShardedTrainer trainer(comm, Squares{sizes, 7}, opt, o);
        trainer.step(Scale{1.0f + static_cast<float>(comm.rank())});
        trainer.step(Scale{0.5f});
        // What the trainer really holds, against the formula.
        CHECK(trainer.shard().size() == elements);
        CHECK(trainer.optimizer().state_elements() == state * elements);
        CHECK(trainer.persistent_bytes() == (2 + state) * 4 * elements);
        const MemoryNeed need = trainer.memory_need();
        CHECK(need.params == 4 * elements);
        CHECK(need.grads == 4 * elements);
        CHECK(need.optimizer_state == 4 * state * elements);
        CHECK(need.persistent() == trainer.persistent_bytes());
        switch (s) {
          case ShardingStrategy::NoShard:
            CHECK(need.transient() == 0);
            CHECK(trainer.peak_transient_bytes() == 0);
            break;
          case ShardingStrategy::ShardGradOp:
            CHECK(need.gathered == 4 * g_sum);
            CHECK(need.gradient_buffers == 4 * 2 * r_max);
            // Every unit is gathered at the end of forward, when the first
            // backward unit (the last) gets its buffer.
            CHECK(trainer.peak_transient_bytes() >= 4 * (g_sum + gradient_buffer(sizes.back(), n)));
            CHECK(trainer.peak_transient_bytes() <= need.transient());
            break;
          case ShardingStrategy::FullShard:
          case ShardingStrategy::HybridShard:
            // The largest unit's backward holds it gathered and its buffer: exact.
            CHECK(need.gathered == 4 * g_max);
            CHECK(need.gradient_buffers == 4 * r_max);
            CHECK(trainer.peak_transient_bytes() == need.transient());
            break;
        }
      });
    }
    // DDP: everything on every rank; buckets are reduced in place, so no buffers.
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      ReplicatedTrainer trainer(comm, Squares{sizes, 7}, opt);
      trainer.step(Scale{1.0f + static_cast<float>(comm.rank())});
      CHECK(trainer.parameters().size() == psi);
      CHECK(trainer.optimizer().state_elements() == state * psi);
      CHECK(trainer.persistent_bytes() == (2 + state) * 4 * psi);
      CHECK(trainer.memory_need().persistent() == trainer.persistent_bytes());
      CHECK(trainer.memory_need().transient() == 0);
      CHECK(trainer.peak_transient_bytes() == 0);
    });
  });
}

}  // namespace

TEST_CASE("memory: persistent bytes are (2 + S)·4·Σ⌈P/N⌉ (Ψ: NoShard, DDP); transient peak vs prediction") {
  SUBCASE("SGD") { check_persistent_and_peak("SGD", gradsync::Sgd<float>({.lr = 0.01}), 0); }
  SUBCASE("momentum") { check_persistent_and_peak("momentum", gradsync::Sgd<float>({.lr = 0.01, .momentum = 0.9}), 1); }
  SUBCASE("Adam") { check_persistent_and_peak("Adam", gradsync::Adam<float>({.lr = 0.01}), 2); }
  SUBCASE("AdamW") { check_persistent_and_peak("AdamW", gradsync::AdamW<float>({.lr = 0.01}), 2); }
}

TEST_CASE("memory: bf16 compression's bucket buffers are DDP's transient bytes, 2·Ψ") {
  const std::vector<std::size_t> sizes{25, 36, 7};
  gradsync::run_threads(3, [&](Communicator<Threads>& comm) {
    ReplicatedTrainerOptions o;
    o.sync.compression = gradsync::Compression::bf16;
    ReplicatedTrainer trainer(comm, Squares{sizes, 7}, gradsync::Sgd<float>(), o);
    CHECK(trainer.memory_need().gradient_buffers == 2 * sum(sizes));
    CHECK(trainer.peak_transient_bytes() == trainer.memory_need().transient());
  });
}

// docs/FSDP.md's case: eight 2048×2048 + bias units (U = 4,196,352, Ψ = 33.6M),
// Adam, N = 4, 256 MiB per rank. DDP needs 16Ψ = 512 MiB, ShardGradOp
// 16·Σ⌈U/4⌉ + 4·N·Σ⌈U/4⌉ + 2 gradient buffers = 288 MiB; FullShard
// 16·Σ⌈U/4⌉ + 4U + 4U = 160 MiB (U is a multiple of 4: no padding).
TEST_CASE("memory_budget: at 256 MiB per rank DDP and ShardGradOp are refused, FullShard trains, and so does a bfloat16 model's ShardGradOp") {
  // Under the sanitizers, the same case 64 times smaller (8.0, 4.5 and 2.5
  // MiB against 4 MiB): instrumented, the full size's passes over 33.6M
  // elements per rank take minutes. (test::sanitized, not __SANITIZE_*:
  // Clang, which builds CI's ASan+UBSan suite, defines no such macro, so that
  // suite ran the full size until 2026-12-02.)
  constexpr std::size_t side = test::sanitized ? 256 : 2048;
  constexpr std::size_t budget = test::sanitized ? std::size_t{4} << 20 : std::size_t{256} << 20;
  constexpr std::size_t unit = side * side + side;
  const std::vector<std::size_t> sizes(8, unit);
  constexpr int world = 4;
  const std::size_t chunks = padded_chunks(sizes, world);
  const std::size_t formula = 16 * chunks + 4 * unit + 4 * unit;

  std::vector<std::string> refused(2 * world);
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    ReplicatedTrainerOptions ddp;
    ddp.memory_budget = budget;
    try {
      ReplicatedTrainer trainer(comm, Squares{sizes, 3}, gradsync::Adam<float>(), ddp);
    } catch (const gradsync::InvalidArgument& e) {
      refused[r] = e.what();
    }
    try {
      ShardedTrainer trainer(comm, Squares{sizes, 3}, gradsync::Adam<float>(),
                             {.strategy = ShardingStrategy::ShardGradOp, .memory_budget = budget});
    } catch (const gradsync::InvalidArgument& e) {
      refused[world + r] = e.what();
    }
  });
  for (std::size_t r = 0; r < refused.size(); ++r) {
    CAPTURE(r);
    INFO(refused[r]);
    CHECK(refused[r].find("over the memory_budget of " + MemoryNeed::mib(budget)) != std::string::npos);
    CHECK(refused[r].find("persistent") != std::string::npos);
    CHECK(refused[r].find("transient") != std::string::npos);
  }
  // DDP's need, exactly: parameters, gradients, Adam's two moments on Ψ.
  CHECK(refused[0].find("needs " + MemoryNeed::mib(16 * 8 * unit)) != std::string::npos);
  // ShardGradOp: its shards, every unit gathered, two gradient buffers; and what FullShard would need.
  const std::size_t c = (unit + world - 1) / world;
  CHECK(refused[world].find("needs " + MemoryNeed::mib(16 * chunks + 4 * world * chunks + 2 * 4 * world * c)) !=
        std::string::npos);
  const std::size_t full_shard = 16 * chunks + 4 * world * c + 4 * world * c;
  CHECK(full_shard == formula);
  CHECK(refused[world].find("FullShard would need " + MemoryNeed::mib(full_shard)) != std::string::npos);

  std::vector<std::size_t> peak(world), need(world);
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    ShardedTrainer trainer(comm, Squares{sizes, 3}, gradsync::Adam<float>(),
                           {.strategy = ShardingStrategy::FullShard, .memory_budget = budget});
    trainer.step(Scale{1.0f + static_cast<float>(comm.rank())});
    trainer.step(Scale{1.0f});
    CHECK(trainer.optimizer().state_elements() == 2 * chunks);
    const auto r = static_cast<std::size_t>(comm.rank());
    peak[r] = trainer.persistent_bytes() + trainer.peak_transient_bytes();
    need[r] = trainer.memory_need().total();
    CHECK(need[r] == full_shard);
  });
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    const auto i = static_cast<std::size_t>(r);
    CHECK(peak[i] <= need[i]);
    CHECK(peak[i] <= budget);
    CHECK(static_cast<double>(peak[i]) <= 1.05 * static_cast<double>(formula));
  }

  // A model computing in bfloat16 (compute_type): ShardGradOp's gathered
  // units take 2·ΣG bytes, its gradient 2·max G more beside the two fp32
  // buffers, and it trains in the budget fp32 ShardGradOp was refused
  // (232.1 MiB at full size, 3.8 MiB under the sanitizers).
  const std::size_t g = world * c;
  const std::size_t low_need = 16 * chunks + 2 * 8 * g + 2 * 4 * g + 2 * g;
  CHECK(low_need < budget);
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    ShardedTrainer trainer(comm, LowSquares{Squares{sizes, 3}}, gradsync::Adam<float>(),
                           {.strategy = ShardingStrategy::ShardGradOp, .memory_budget = budget});
    trainer.step(Scale{1.0f + static_cast<float>(comm.rank())});
    trainer.step(Scale{1.0f});
    CHECK(trainer.memory_need().total() == low_need);
    CHECK(trainer.persistent_bytes() + trainer.peak_transient_bytes() <= low_need);
  });
}

TEST_CASE("memory_budget: 0 is no limit, and a budget one byte short of the need is refused on every rank") {
  auto rng = test::rng_for("memory budget edge");
  std::uniform_int_distribution<std::size_t> d(1, 300);
  const std::vector<std::size_t> sizes{d(rng), d(rng), d(rng)};
  INFO("seed = " << test::test_seed() << ", sizes = " << joined(sizes));
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    for (const ShardingStrategy s : all_strategies) {
      INFO("strategy = " << name(s));
      std::vector<int> refused(static_cast<std::size_t>(world), 0);
      gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
        ShardedTrainer unlimited(comm, Squares{sizes, 1}, gradsync::Sgd<float>(), {.strategy = s});
        const std::size_t exact = unlimited.memory_need().total();
        ShardedTrainer fits(comm, Squares{sizes, 1}, gradsync::Sgd<float>(), {.strategy = s, .memory_budget = exact});
        fits.step(Scale{1.0f});
        CHECK(fits.persistent_bytes() + fits.peak_transient_bytes() <= exact);
        try {
          ShardedTrainer short_by_one(comm, Squares{sizes, 1}, gradsync::Sgd<float>(),
                                      {.strategy = s, .memory_budget = exact - 1});
        } catch (const gradsync::InvalidArgument&) {
          refused[static_cast<std::size_t>(comm.rank())] = 1;
        }
      });
      for (const int r : refused) CHECK(r == 1);
    }
    std::vector<int> refused(static_cast<std::size_t>(world), 0);
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      const std::size_t exact = 8 * sum(sizes);
      ReplicatedTrainerOptions o;
      o.memory_budget = exact;
      ReplicatedTrainer fits(comm, Squares{sizes, 1}, gradsync::Sgd<float>(), o);
      fits.step(Scale{1.0f});
      o.memory_budget = exact - 1;
      try {
        ReplicatedTrainer short_by_one(comm, Squares{sizes, 1}, gradsync::Sgd<float>(), o);
      } catch (const gradsync::InvalidArgument&) {
        refused[static_cast<std::size_t>(comm.rank())] = 1;
      }
    });
    for (const int r : refused) CHECK(r == 1);
  }
}

// Construction: the model writes its initial values, rank 0's are broadcast
// and each rank keeps its chunks. With init_unit a sharded trainer holds one
// wrapped unit in full at a time, with bind every parameter, and under
// NoShard nothing beside its shard, which is the model.
TEST_CASE("memory: construction holds one wrapped unit (init_unit), every parameter (bind), nothing (NoShard)") {
  at_worlds_with_sizes("memory construction", [&](int world, std::size_t, std::vector<std::size_t> sizes) {
    // A unit without parameters is written and kept like any other.
    sizes.insert(sizes.begin() + 1, 0);
    const std::vector<float> expected = initial_values(sizes, 11);
    for (const std::size_t min_params : {std::size_t{0}, std::size_t{30}}) {
      CAPTURE(min_params);
      for (const ShardingStrategy s : all_strategies) {
        INFO("strategy = " << name(s));
        gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
          ShardedTrainerOptions o = options_for(s, world);
          if (min_params != 0) o.wrap = gradsync::WrapPolicy::size_based(min_params);
          // Each rank writes its own values; rank 0's (seed 11) must win.
          const std::uint64_t seed = 11 + 2 * static_cast<std::uint64_t>(comm.rank());
          ShardedTrainer by_unit(comm, Squares{sizes, seed}, gradsync::Adam<float>(), o);
          ShardedTrainer at_once(comm, BindSquares{Squares{sizes, seed}}, gradsync::Adam<float>(), o);
          std::size_t largest = 0;
          for (std::size_t w = 0; w < by_unit.unit_count(); ++w) largest = std::max(largest, by_unit.unit_size(w));
          const bool sharded = s != ShardingStrategy::NoShard;
          CHECK(by_unit.construction_bytes() == (sharded ? 4 * largest : 0));
          CHECK(at_once.construction_bytes() == (sharded ? 4 * sum(sizes) : 0));
          CHECK(by_unit.memory_need().construction == by_unit.construction_bytes());
          CHECK(at_once.memory_need().construction == at_once.construction_bytes());
          // A unit in full is never more than its gathered size: init_unit adds nothing to the need.
          CHECK(by_unit.memory_need().total() == by_unit.memory_need().persistent() + by_unit.memory_need().transient());
          const std::vector<float> a = by_unit.full_parameters(), b = at_once.full_parameters();
          CHECK(bitwise_equal(a, expected));
          CHECK(bitwise_equal(b, expected));
          // And the shards train alike.
          by_unit.step(Scale{1.0f});
          at_once.step(Scale{1.0f});
          CHECK(bitwise_equal(by_unit.full_parameters(), at_once.full_parameters()));
        });
      }
    }
  });
}

// Eight equal units under FullShard: bind's Ψ at construction is four times
// the transient part (two units), so the budget that init_unit's need fits
// exactly refuses the same model with bind only, saying why, on every rank.
TEST_CASE("memory_budget: construction's full copy is counted; the refusal names init_unit") {
  const std::vector<std::size_t> sizes(8, 97);
  for (int world = 2; world <= 4; ++world) {
    CAPTURE(world);
    std::vector<std::string> refused(static_cast<std::size_t>(world));
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      ShardedTrainer fits(comm, Squares{sizes, 1}, gradsync::Adam<float>(), {});
      const MemoryNeed need = fits.memory_need();
      CHECK(need.construction < need.transient());
      const std::size_t budget = need.total();
      ShardedTrainer within(comm, Squares{sizes, 1}, gradsync::Adam<float>(), {.memory_budget = budget});
      within.step(Scale{1.0f});
      CHECK(within.persistent_bytes() + within.peak_transient_bytes() <= budget);
      CHECK(within.persistent_bytes() + within.construction_bytes() <= budget);
      try {
        ShardedTrainer at_once(comm, BindSquares{Squares{sizes, 1}}, gradsync::Adam<float>(), {.memory_budget = budget});
      } catch (const gradsync::InvalidArgument& e) {
        refused[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    for (const std::string& what : refused) {
      INFO(what);
      CHECK(what.find("at construction, instead of the transient part, " + MemoryNeed::mib(4 * sum(sizes))) !=
            std::string::npos);
      CHECK(what.find("init_unit(u, view)") != std::string::npos);
    }
  }
}

namespace {

using RingSharded = ShardedTrainer<Squares, gradsync::Sgd<float>, Communicator<Threads>, gradsync::Ring>;
using RingReplicated = ReplicatedTrainer<Squares, gradsync::Sgd<float>, Communicator<Threads>, gradsync::Ring>;

/// Times are non-negative, the overlap is within what was communicated, and bytes are fp32 elements.
void check_times(const gradsync::StepStats& s, std::size_t element_bytes) {
  CHECK(s.compute_seconds >= 0);
  CHECK(s.gather_seconds >= 0);
  CHECK(s.reduce_seconds >= 0);
  CHECK(s.optimizer_seconds >= 0);
  CHECK(s.exposed_comm_seconds >= 0);
  CHECK(s.hidden_comm_seconds() <= s.gather_seconds + s.reduce_seconds);
  CHECK(s.sent_bytes == element_bytes * s.sent_elements);
}

}  // namespace

// Per rank, c_u = ⌈P_u/N⌉ and Ψ' = N·Σc_u the padded model: Ring's
// all-gather and reduce-scatter send N−1 of N blocks, (N−1)·c_u each, so
// FullShard sends 3(N−1)/N·Ψ' (two gathers and a reduce-scatter per unit)
// less (N−1)·c of the unit kept from forward to backward (gathered once);
// ShardGradOp 2(N−1)/N·Ψ'; NoShard and DDP all-reduce Ψ, all ranks together
// 2(N−1)·Ψ (the ring's blocks are uneven when N does not divide a bucket).
TEST_CASE("step statistics: elements sent per step equal the formula for every strategy and DDP") {
  at_worlds_with_sizes("step statistics", [&](int world, std::size_t n, const std::vector<std::size_t>& sizes) {
    const std::size_t chunks = padded_chunks(sizes, n), psi = sum(sizes);
    const std::size_t kept = (sizes.back() + n - 1) / n;
    std::vector<std::size_t> sent(n);
    auto total = [&] {
      std::size_t t = 0;
      for (const std::size_t s : sent) t += s;
      return t;
    };
    for (const bool keep : {true, false}) {
      CAPTURE(keep);
      gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
        RingSharded trainer(comm, Squares{sizes, 5}, gradsync::Sgd<float>({.lr = 0.1}),
                            {.strategy = ShardingStrategy::FullShard, .keep_last_forward_unit = keep});
        for (int step = 0; step < 2; ++step) {
          trainer.step(Scale{1.0f + static_cast<float>(comm.rank() + step)});
          const gradsync::StepStats s = trainer.last_step();
          CHECK(s.sent_elements == (n - 1) * (3 * chunks - (keep ? kept : 0)));
          check_times(s, 4);
          CHECK(s.compute_seconds > 0);
        }
      });
    }
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      RingSharded trainer(comm, Squares{sizes, 5}, gradsync::Sgd<float>({.lr = 0.1}),
                          {.strategy = ShardingStrategy::ShardGradOp});
      trainer.step(Scale{1.0f + static_cast<float>(comm.rank())});
      CHECK(trainer.last_step().sent_elements == 2 * (n - 1) * chunks);
      check_times(trainer.last_step(), 4);
    });
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      RingSharded trainer(comm, Squares{sizes, 5}, gradsync::Sgd<float>({.lr = 0.1}),
                          {.strategy = ShardingStrategy::NoShard});
      trainer.step(Scale{1.0f + static_cast<float>(comm.rank())});
      CHECK(trainer.last_step().gather_seconds == 0);
      check_times(trainer.last_step(), 4);
      sent[static_cast<std::size_t>(comm.rank())] = trainer.last_step().sent_elements;
    });
    CHECK(total() == 2 * (n - 1) * psi);
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      RingReplicated trainer(comm, Squares{sizes, 5}, gradsync::Sgd<float>({.lr = 0.1}));
      trainer.step(Scale{1.0f + static_cast<float>(comm.rank())});
      CHECK(trainer.last_step().gather_seconds == 0);
      check_times(trainer.last_step(), 4);
      sent[static_cast<std::size_t>(comm.rank())] = trainer.last_step().sent_elements;
      // A step's compute counts its accumulate() micro-steps, as the trainer's total does.
      const double before = trainer.stats().compute_seconds;
      trainer.accumulate(Scale{1.0f});
      trainer.accumulate(Scale{2.0f});
      trainer.step(Scale{1.0f});
      CHECK(trainer.last_step().compute_seconds == trainer.stats().compute_seconds - before);
    });
    CHECK(total() == 2 * (n - 1) * psi);
  });
}

// 4 ranks as 2 replicas × 2 shards: a FullShard step within the pair
// (c = ⌈P/2⌉, one block of two sent per collective), then each gradient
// shard all-reduced across the 2 replicas, which on two ranks sends c.
TEST_CASE("step statistics: HybridShard sends FullShard's within the group plus its shards across replicas") {
  auto rng = test::rng_for("step statistics hybrid");
  const std::vector<std::size_t> sizes = random_sizes(rng, 4);
  INFO("seed = " << test::test_seed() << ", sizes = " << joined(sizes));
  const std::size_t chunks = padded_chunks(sizes, 2), kept = (sizes.back() + 1) / 2;
  gradsync::run_threads(4, [&](Communicator<Threads>& comm) {
    RingSharded trainer(comm, Squares{sizes, 5}, gradsync::Sgd<float>({.lr = 0.1}),
                        {.strategy = ShardingStrategy::HybridShard, .shard_size = 2});
    trainer.step(Scale{1.0f + static_cast<float>(comm.rank())});
    CHECK(trainer.last_step().sent_elements == 3 * chunks - kept + chunks);
    check_times(trainer.last_step(), 4);
  });
}

TEST_CASE("step statistics: bf16 compression sends DDP's elements in 2 bytes each") {
  const std::vector<std::size_t> sizes{30, 12};
  std::vector<std::size_t> sent(3);
  gradsync::run_threads(3, [&](Communicator<Threads>& comm) {
    ReplicatedTrainerOptions o;
    o.sync.compression = gradsync::Compression::bf16;
    RingReplicated trainer(comm, Squares{sizes, 5}, gradsync::Sgd<float>({.lr = 0.1}), o);
    trainer.step(Scale{1.0f});
    check_times(trainer.last_step(), 2);
    sent[static_cast<std::size_t>(comm.rank())] = trainer.last_step().sent_elements;
  });
  CHECK(sent[0] + sent[1] + sent[2] == 2 * 2 * 42);
}

namespace {

using gradsync::AccumulationMode;
using gradsync::BackwardPrefetch;

/// A prefetch under FullShard: the next unit's gather beside the one in use.
struct PrefetchCase {
  const char* name;
  bool forward;
  BackwardPrefetch backward;
};

constexpr PrefetchCase prefetch_cases[] = {{"BackwardPre", false, BackwardPrefetch::BackwardPre},
                                           {"BackwardPost", false, BackwardPrefetch::BackwardPost},
                                           {"forward_prefetch", true, BackwardPrefetch::None},
                                           {"forward and BackwardPre", true, BackwardPrefetch::BackwardPre}};

}  // namespace

// docs/FSDP.md's 4(1+d)·U_max + 4·U_max: a prefetched unit adds one gathered unit
// (d = 1), and since a unit's gradient buffer waits for the previous unit's
// reduce-scatter, there is still one buffer. Units of one size make the
// backward's peak (units i and i−1 gathered, i's buffer) the formula exactly.
TEST_CASE("memory: prefetch adds one gathered unit to FullShard's transient need, and the peak reaches it") {
  auto rng = test::rng_for("memory prefetch");
  std::uniform_int_distribution<std::size_t> d(1, 60);
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    const auto n = static_cast<std::size_t>(world);
    const std::size_t p = d(rng);
    const std::vector<std::size_t> equal(4, p);
    const std::vector<std::size_t> mixed = random_sizes(rng, world);
    INFO("seed = " << test::test_seed() << ", equal units of " << p << ", mixed = " << mixed[0] << ", " << mixed[1]
                   << ", " << mixed[2] << ", " << mixed[3] << ", " << mixed[4]);
    std::size_t g_max = 0;
    for (const std::size_t q : mixed) g_max = std::max(g_max, gathered(q, n));
    for (const PrefetchCase& c : prefetch_cases) {
      INFO("prefetch = " << c.name);
      for (const ShardingStrategy s : {ShardingStrategy::FullShard, ShardingStrategy::HybridShard}) {
        INFO("strategy = " << name(s));
        gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
          const ShardedTrainerOptions o{
              .strategy = s, .forward_prefetch = c.forward, .backward_prefetch = c.backward};
          ShardedTrainer trainer(comm, Squares{equal, 3}, gradsync::Adam<float>(), o);
          trainer.step(Scale{1.0f + static_cast<float>(comm.rank())});
          trainer.step(Scale{0.5f});
          const MemoryNeed need = trainer.memory_need();
          CHECK(need.gathered == 4 * 2 * gathered(p, n));
          CHECK(need.gradient_buffers == 4 * gradient_buffer(p, n));
          CHECK(trainer.peak_transient_bytes() <= need.transient());
          if (c.backward != BackwardPrefetch::None) {
            CHECK(trainer.peak_transient_bytes() == need.transient());
          } else {
            // Forward holds two gathered units; backward one and its buffer.
            CHECK(trainer.peak_transient_bytes() == 4 * 2 * gathered(p, n));
          }
          // The limit of one gathered unit lets no prefetch through: FullShard's need without it, exactly.
          ShardedTrainerOptions one = o;
          one.limit_all_gathers = 1;
          ShardedTrainer limited(comm, Squares{equal, 3}, gradsync::Adam<float>(), one);
          limited.step(Scale{1.0f});
          CHECK(limited.memory_need().gathered == 4 * gathered(p, n));
          CHECK(limited.peak_transient_bytes() == limited.memory_need().transient());
          // Units of different sizes: a bound.
          ShardedTrainer uneven(comm, Squares{mixed, 3}, gradsync::Adam<float>(), o);
          uneven.step(Scale{1.0f});
          CHECK(uneven.memory_need().gathered == 4 * 2 * g_max);
          CHECK(uneven.peak_transient_bytes() <= uneven.memory_need().transient());
        });
      }
      // ShardGradOp keeps every unit gathered anyway: prefetch changes nothing.
      gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
        const ShardedTrainerOptions o{.strategy = ShardingStrategy::ShardGradOp,
                                      .forward_prefetch = c.forward,
                                      .backward_prefetch = c.backward};
        ShardedTrainer trainer(comm, Squares{mixed, 3}, gradsync::Sgd<float>(), o);
        trainer.step(Scale{1.0f});
        ShardedTrainer plain(comm, Squares{mixed, 3}, gradsync::Sgd<float>(),
                             {.strategy = ShardingStrategy::ShardGradOp});
        CHECK(trainer.memory_need().transient() == plain.memory_need().transient());
        CHECK(trainer.peak_transient_bytes() <= trainer.memory_need().transient());
      });
    }
  }
}

namespace {

struct Tick {};

/// Units of `sizes`, asked for in order in forward and in `backward_order`
/// in backward: the model protocol fixes neither order.
struct AnyOrder {
  using value_type = float;
  std::vector<std::size_t> sizes, backward_order;

  std::vector<gradsync::UnitSpec> units() const {
    std::vector<gradsync::UnitSpec> v;
    for (std::size_t u = 0; u < sizes.size(); ++u) v.push_back({"u" + std::to_string(u), {{"w", {sizes[u]}}}, {}});
    return v;
  }
  void init_unit(std::size_t, const gradsync::UnitView<float>& v) const {
    for (float& x : v.flat_params) x = 0.5f;
  }
  double forward_backward(const Tick&, const gradsync::StepContext<float>& ctx) const {
    for (std::size_t u = 0; u < sizes.size(); ++u) auto p = ctx.params(u);
    for (const std::size_t u : backward_order) {
      auto p = ctx.params(u);
      for (std::size_t i = 0; i < p->flat_params.size(); ++i) p->flat_grads[i] += p->flat_params[i];
      ctx.ready(u);
    }
    return 0;
  }
};

}  // namespace

// A prefetch guesses the next unit from the one asked for; in another order
// than the guess (backward in forward order, say) the guessed unit may have
// had its turn already, and without a gather limit such units stayed
// gathered to the step's end, past the need that memory_budget is held to.
TEST_CASE("memory: the transient need bounds the peak whatever order the model takes units in, at any gather limit") {
  auto rng = test::rng_for("memory any order");
  CAPTURE(test::test_seed());
  for (int round = 0; round < 3; ++round) {
    const int world = 2 + static_cast<int>(rng() % 4);
    AnyOrder model{random_sizes(rng, world), {}};
    for (std::size_t u = 0; u < model.sizes.size(); ++u) model.backward_order.push_back(u);
    if (round > 0) std::shuffle(model.backward_order.begin(), model.backward_order.end(), rng);
    INFO("N = " << world << ", backward order " << joined(model.backward_order));
    for (const PrefetchCase& c : prefetch_cases) {
      for (const std::size_t limit : {std::size_t{0}, std::size_t{2}, std::size_t{3}}) {
        INFO("prefetch = " << c.name << ", limit_all_gathers = " << limit);
        gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
          const ShardedTrainerOptions o{.strategy = ShardingStrategy::FullShard,
                                        .forward_prefetch = c.forward,
                                        .backward_prefetch = c.backward,
                                        .limit_all_gathers = limit};
          ShardedTrainer trainer(comm, model, gradsync::Sgd<float>({.lr = 0.1}), o);
          trainer.step(Tick{});
          trainer.step(Tick{});
          CHECK(trainer.peak_transient_bytes() <= trainer.memory_need().transient());
        });
      }
    }
  }
}

// NoSync keeps every wrapped unit's gradient buffer (the padded unit) from
// the first micro-step's backward to the step's reduction: Σ R in place of
// one buffer. The last unit of backward (unit 0) sees them all.
TEST_CASE("memory: NoSync accumulation holds every gradient buffer; Sharded accumulation one, as a step") {
  at_worlds_with_sizes("memory accumulation", [&](int world, std::size_t n, const std::vector<std::size_t>& sizes) {
    std::size_t g_max = 0, r_sum = 0, r_max = 0;
    for (const std::size_t p : sizes) {
      g_max = std::max(g_max, gathered(p, n));
      r_sum += gradient_buffer(p, n);
      r_max = std::max(r_max, gradient_buffer(p, n));
    }
    for (const BackwardPrefetch b : {BackwardPrefetch::None, BackwardPrefetch::BackwardPre}) {
      CAPTURE(static_cast<int>(b));
      const std::size_t g = (b == BackwardPrefetch::None ? 1 : 2) * g_max;
      gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
        const float f = 1.0f + static_cast<float>(comm.rank());
        ShardedTrainer no_sync(comm, Squares{sizes, 3}, gradsync::Sgd<float>(),
                               {.accumulation = AccumulationMode::NoSync, .backward_prefetch = b});
        CHECK(no_sync.memory_need().gathered == 4 * g);
        CHECK(no_sync.memory_need().gradient_buffers == 4 * r_sum);
        for (int k = 0; k < 3; ++k) no_sync.accumulate(Scale{f});
        no_sync.step(Scale{f});
        CHECK(no_sync.peak_transient_bytes() <= no_sync.memory_need().transient());
        CHECK(no_sync.peak_transient_bytes() >= 4 * (r_sum + gathered(sizes.front(), n)));

        ShardedTrainer sharded(comm, Squares{sizes, 3}, gradsync::Sgd<float>(), {.backward_prefetch = b});
        CHECK(sharded.memory_need().gathered == 4 * g);
        CHECK(sharded.memory_need().gradient_buffers == 4 * r_max);
        for (int k = 0; k < 3; ++k) sharded.accumulate(Scale{f});
        sharded.step(Scale{f});
        CHECK(sharded.peak_transient_bytes() <= sharded.memory_need().transient());
        if (b == BackwardPrefetch::None) CHECK(sharded.peak_transient_bytes() == sharded.memory_need().transient());
      });
    }
  });
}

TEST_CASE("memory: the formula is over wrapped units, and a NoSync budget counts its unsharded gradients") {
  auto rng = test::rng_for("memory wrapped");
  // At least 120 elements: size_based(60) makes two wrapped units or more.
  std::uniform_int_distribution<std::size_t> d(20, 50);
  const std::vector<std::size_t> sizes{d(rng), d(rng), d(rng), d(rng), d(rng), d(rng)};
  INFO("seed = " << test::test_seed() << ", sizes = " << joined(sizes));
  constexpr int world = 3;
  std::vector<int> refused(world, 0);
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    ShardedTrainerOptions o{.wrap = gradsync::WrapPolicy::size_based(60)};
    ShardedTrainer trainer(comm, Squares{sizes, 2}, gradsync::Adam<float>(), o);
    std::size_t g_max = 0, chunks = 0;
    for (const auto& u : trainer.plan().units) {
      g_max = std::max(g_max, u.gathered_bytes);
      chunks += u.shard;
    }
    const MemoryNeed need = trainer.memory_need();
    CHECK(need.persistent() == 16 * chunks);
    CHECK(need.gathered == g_max);
    CHECK(need.gradient_buffers == g_max);
    trainer.step(Scale{1.0f});
    CHECK(trainer.peak_transient_bytes() == need.transient());

    o.accumulation = AccumulationMode::NoSync;
    ShardedTrainer no_sync(comm, Squares{sizes, 2}, gradsync::Adam<float>(), o);
    CHECK(no_sync.memory_need().gradient_buffers == 4 * world * chunks);
    // Sharded accumulation's need fits this budget, NoSync's does not.
    o.memory_budget = need.total();
    try {
      ShardedTrainer over(comm, Squares{sizes, 2}, gradsync::Adam<float>(), o);
    } catch (const gradsync::InvalidArgument& e) {
      refused[static_cast<std::size_t>(comm.rank())] = std::string(e.what()).find("memory_budget") != std::string::npos;
    }
  });
  for (const int r : refused) CHECK(r == 1);
}

// Elements are what the formula says whatever the wire type; bytes are 2
// per element of a bfloat16 collective. A step's figures cover its
// micro-steps: K of them under Sharded accumulation send K steps' worth.
TEST_CASE("step statistics: prefetch, mixed precision and accumulation keep the element formula") {
  at_worlds_with_sizes("step statistics merged", [&](int world, std::size_t n, const std::vector<std::size_t>& sizes) {
    const std::size_t chunks = padded_chunks(sizes, n);
    const std::size_t kept = (sizes.back() + n - 1) / n;
    // FullShard: two gathers and a reduce-scatter per unit, the kept unit gathered once.
    const std::size_t gathers = (n - 1) * (2 * chunks - kept), reductions = (n - 1) * chunks;
    for (const PrefetchCase& c : prefetch_cases) {
      INFO("prefetch = " << c.name);
      gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
        RingSharded trainer(comm, Squares{sizes, 5}, gradsync::Sgd<float>({.lr = 0.1}),
                            {.forward_prefetch = c.forward, .backward_prefetch = c.backward});
        trainer.step(Scale{1.0f + static_cast<float>(comm.rank())});
        CHECK(trainer.last_step().sent_elements == gathers + reductions);
        check_times(trainer.last_step(), 4);
      });
    }
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      ShardedTrainerOptions o;
      o.param_dtype = gradsync::DataType::bfloat16;
      RingSharded gathers_low(comm, Squares{sizes, 5}, gradsync::Sgd<float>({.lr = 0.1}), o);
      gathers_low.step(Scale{1.0f});
      CHECK(gathers_low.last_step().sent_elements == gathers + reductions);
      CHECK(gathers_low.last_step().sent_bytes == 2 * gathers + 4 * reductions);
      o.reduce_dtype = gradsync::DataType::bfloat16;
      RingSharded both_low(comm, Squares{sizes, 5}, gradsync::Sgd<float>({.lr = 0.1}), o);
      both_low.step(Scale{1.0f});
      CHECK(both_low.last_step().sent_elements == gathers + reductions);
      check_times(both_low.last_step(), 2);
    });
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      constexpr std::size_t k = 3;
      RingSharded sharded(comm, Squares{sizes, 5}, gradsync::Sgd<float>({.lr = 0.1}), {});
      for (std::size_t i = 0; i + 1 < k; ++i) sharded.accumulate(Scale{1.0f});
      sharded.step(Scale{1.0f});
      CHECK(sharded.last_step().sent_elements == k * (gathers + reductions));
      // NoSync: K micro-steps' gathers, one reduction.
      RingSharded no_sync(comm, Squares{sizes, 5}, gradsync::Sgd<float>({.lr = 0.1}),
                          {.accumulation = AccumulationMode::NoSync});
      for (std::size_t i = 0; i + 1 < k; ++i) no_sync.accumulate(Scale{1.0f});
      no_sync.step(Scale{1.0f});
      CHECK(no_sync.last_step().sent_elements == k * gathers + reductions);
      check_times(no_sync.last_step(), 4);
    });
  });
}

// param_dtype bfloat16 under ShardGradOp: a unit kept from its forward to its
// backward (and across NoSync micro-steps) keeps the bfloat16 copy its gather
// received, and an fp32 one only while the model holds it, so the gathered
// part is 2·ΣG + 4·max G bytes instead of 4·ΣG, where that is less (not where
// one unit is most of the model); the result is bitwise FullShard's, which
// gathers every time.
TEST_CASE("memory: ShardGradOp keeps its gathered units in bfloat16 under param_dtype bfloat16, exactly") {
  auto check = [](int world, std::size_t n, const std::vector<std::size_t>& sizes) {
    INFO("sizes = " << joined(sizes));
    std::size_t g_max = 0, g_sum = 0;
    for (const std::size_t p : sizes) {
      g_max = std::max(g_max, gathered(p, n));
      g_sum += gathered(p, n);
    }
    const std::size_t g_last = gathered(sizes.back(), n), r_last = gradient_buffer(sizes.back(), n);
    const bool low = 2 * g_sum + 4 * g_max < 4 * g_sum;
    CAPTURE(low);
    for (const AccumulationMode mode : {AccumulationMode::Sharded, AccumulationMode::NoSync}) {
      INFO("accumulation = " << (mode == AccumulationMode::NoSync ? "NoSync" : "Sharded"));
      gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
        ShardedTrainerOptions o{.strategy = ShardingStrategy::ShardGradOp, .accumulation = mode};
        o.collective.deterministic = true;
        ShardedTrainer plain(comm, Squares{sizes, 7}, gradsync::Adam<float>({.lr = 0.01}), o);
        o.param_dtype = gradsync::DataType::bfloat16;
        ShardedTrainer kept(comm, Squares{sizes, 7}, gradsync::Adam<float>({.lr = 0.01}), o);
        o.strategy = ShardingStrategy::FullShard;
        ShardedTrainer regathered(comm, Squares{sizes, 7}, gradsync::Adam<float>({.lr = 0.01}), o);
        const auto r = static_cast<float>(comm.rank());
        for (int step = 0; step < 2; ++step) accumulate_then_step(r, kept, plain, regathered);
        CHECK(plain.memory_need().gathered == 4 * g_sum);
        CHECK(kept.memory_need().gathered == (low ? 2 * g_sum + 4 * g_max : 4 * g_sum));
        CHECK(kept.peak_transient_bytes() <= kept.memory_need().transient());
        // Backward starts with the last unit (widened to fp32 again, beside
        // every unit's bfloat16 copy) and its gradient buffer.
        CHECK(kept.peak_transient_bytes() >= (low ? 2 * g_sum + 4 * g_last : 4 * g_sum) + 4 * r_last);
        CHECK(plain.peak_transient_bytes() >= 4 * g_sum + 4 * r_last);
        // Keeping is not gathering: the same collectives as in fp32.
        CHECK(kept.last_step().sent_elements == plain.last_step().sent_elements);
        CHECK(bitwise_equal(kept.full_parameters(), regathered.full_parameters()));
      });
    }
  };
  at_worlds_with_sizes("memory kept bf16", [&](int world, std::size_t n, const std::vector<std::size_t>& sizes) {
    check(world, n, sizes);
    // Eight equal units: keeping bfloat16 copies pays. One unit most of the model: it does not.
    check(world, n, std::vector<std::size_t>(8, 30));
    check(world, n, {5, 200, 7});
  });
}

// A model whose compute_type is bfloat16 (LowSquares) sees each gathered
// unit in bfloat16 and writes bfloat16 gradients: gathered units and the
// gradient being filled take 2 bytes an element, the master shard, the
// optimizer and the reduction (reduce_dtype unset) stay fp32.
TEST_CASE("bfloat16 compute: the model sees bfloat16 units, trains within bfloat16 tolerance, holds half the gathered bytes") {
  using gradsync::bfloat16;
  const auto adam = gradsync::Adam<float>({.lr = 0.01});
  at_worlds_with_sizes("bf16 compute", [&](int world, std::size_t n_world, const std::vector<std::size_t>& sizes) {
    for (const ShardingStrategy strategy :
         {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp, ShardingStrategy::HybridShard}) {
      for (const AccumulationMode mode : {AccumulationMode::Sharded, AccumulationMode::NoSync}) {
        INFO("strategy = " << name(strategy)
                           << ", accumulation = " << (mode == AccumulationMode::NoSync ? "NoSync" : "Sharded"));
        ShardedTrainerOptions o = options_for(strategy, world);
        o.accumulation = mode;
        // Ranks a unit is split over.
        const std::size_t n = o.shard_size != 0 ? static_cast<std::size_t>(o.shard_size) : n_world;
        std::size_t g_max = 0, g_sum = 0;
        for (const std::size_t p : sizes) {
          g_max = std::max(g_max, gathered(p, n));
          g_sum += gathered(p, n);
        }
        std::vector<std::vector<float>> lows(n_world);
        gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
          ShardedTrainer plain(comm, Squares{sizes, 7}, adam, o);
          ShardedTrainer low(comm, LowSquares{Squares{sizes, 7}}, adam, o);
          // Offloaded (NoSync: sharded accumulation refuses offload), the
          // same bfloat16 units are gathered from copies of the shards.
          ShardedTrainerOptions off = o;
          off.offload = std::make_shared<gradsync::HostOffloadSpace>();
          std::optional<ShardedTrainer<LowSquares, gradsync::Adam<float>, Communicator<Threads>>> low_off;
          if (mode == AccumulationMode::NoSync) low_off.emplace(comm, LowSquares{Squares{sizes, 7}}, adam, off);
          // Reduced in bfloat16 too: from the model's own gradient buffer,
          // except under NoSync, which sums micro-steps in fp32.
          ShardedTrainerOptions rb = o;
          rb.reduce_dtype = gradsync::DataType::bfloat16;
          ShardedTrainer low_rb(comm, LowSquares{Squares{sizes, 7}}, adam, rb);
          const auto r = static_cast<float>(comm.rank());
          for (int step = 0; step < 3; ++step) {
            accumulate_then_step(r, plain, low, low_rb);
            if (low_off) accumulate_then_step(r, *low_off);
          }
          if (low_off) CHECK(bitwise_equal(low_off->full_parameters(), low.full_parameters()));
          // Memory: the persistent part is fp32's; the gathered units are
          // in 2 bytes, and the model's gradient adds 2·max G.
          const MemoryNeed fp32 = plain.memory_need(), bf16 = low.memory_need();
          CHECK(bf16.persistent() == fp32.persistent());
          CHECK(low.persistent_bytes() == plain.persistent_bytes());
          CHECK(fp32.gathered == 4 * (strategy == ShardingStrategy::ShardGradOp ? g_sum : g_max));
          CHECK(bf16.gathered == 2 * (strategy == ShardingStrategy::ShardGradOp ? g_sum : g_max));
          CHECK(bf16.gradient_buffers == fp32.gradient_buffers + 2 * g_max);
          CHECK(low.peak_transient_bytes() <= bf16.transient());
          // FullShard's largest unit holds it, its bfloat16 gradient and its
          // fp32 buffer at once when it is folded: the need, exactly.
          if (strategy != ShardingStrategy::ShardGradOp && mode == AccumulationMode::Sharded) {
            CHECK(low.peak_transient_bytes() == bf16.transient());
          }
          CHECK(low.plan().units.front().gathered_bytes == 2 * gathered(sizes.front(), n));
          const MemoryNeed rb_need = low_rb.memory_need();
          CHECK(rb_need.gathered == bf16.gathered);
          CHECK(low_rb.peak_transient_bytes() <= rb_need.transient());
          if (world > 1 && mode == AccumulationMode::Sharded) {
            // No fp32 gradient buffer: FullShard's transient part is half fp32's.
            CHECK(rb_need.gradient_buffers == 2 * (strategy == ShardingStrategy::ShardGradOp ? 2 : 1) * g_max);
            if (strategy != ShardingStrategy::ShardGradOp) {
              CHECK(2 * rb_need.transient() == fp32.transient());
              CHECK(low_rb.peak_transient_bytes() == rb_need.transient());
            }
          } else {
            CHECK(rb_need.gradient_buffers == bf16.gradient_buffers);
          }
          for (const auto& e : low_rb.trace()) {
            if (e.collective == gradsync::Collective::reduce_scatter) {
              CHECK(e.bytes == (world > 1 ? 2 : 4) * gathered(sizes[e.unit], n));
            }
          }
          // The wire: gathers in bfloat16, the reduction in fp32.
          for (const auto& e : low.trace()) {
            const std::size_t g = gathered(sizes[e.unit], n);
            if (e.collective == gradsync::Collective::all_gather) CHECK(e.bytes == 2 * g);
            if (e.collective == gradsync::Collective::reduce_scatter) CHECK(e.bytes == 4 * g);
          }
          // What the model sees is the fp32 master rounded to bfloat16, once.
          const std::vector<float> master = low.full_parameters();
          lows[static_cast<std::size_t>(comm.rank())] = master;
          low.evaluate([&](const gradsync::StepContext<bfloat16>& ctx) {
            std::size_t at = 0;
            for (std::size_t u = 0; u < sizes.size(); ++u) {
              const auto p = ctx.params(u);
              for (const bfloat16 x : p->flat_params) CHECK(x == bfloat16(master[at++]));
            }
          });
          // Each parameter the model sees and each gradient it writes is
          // rounded to 2^-9 relative, so a gradient is off by ε ≲ 2^-8.
          // Adam's update lr·m/√v does not move when every gradient is
          // scaled alike, and moves by at most lr·2ε when they are not:
          // 3 steps stay within 3·lr·2^-7 = 2.3e-4 (measured over 8 seeds at
          // N = 1..4: up to 1.1e-5). Reduced in bfloat16, each of up to
          // N − 1 = 3 partial sums is rounded too: ε ≲ 5·2^-9, within
          // 3·lr·2^-6 = 4.7e-4 (measured: up to 4.3e-5).
          const std::vector<float> reference = plain.full_parameters();
          const double drift = worst_relative(master, reference);
          CAPTURE(drift);
          CHECK(drift <= 3 * 0.01 * std::ldexp(1.0, -7));
          CHECK(!bitwise_equal(master, reference));
          const double drift_rb = worst_relative(low_rb.full_parameters(), reference);
          CAPTURE(drift_rb);
          CHECK(drift_rb <= 3 * 0.01 * std::ldexp(1.0, -6));
        });
        for (const auto& x : lows) CHECK(bitwise_equal(x, lows.front()));
      }
    }
  });
}

// ReplicatedTrainer lends a bfloat16 model bfloat16 copies of every
// parameter and gradient: the model's arithmetic is the same as under a
// sharded trainer, so under the deterministic option the two are bitwise
// equal, as for a float model.
TEST_CASE("bfloat16 compute under ReplicatedTrainer and NoShard: bitwise FullShard's when deterministic; 4·Ψ more bytes kept") {
  using gradsync::bfloat16;
  const auto adam = gradsync::Adam<float>({.lr = 0.01});
  at_worlds_with_sizes("bf16 compute replicated", [&](int world, std::size_t, const std::vector<std::size_t>& sizes) {
    const std::size_t psi = sum(sizes);
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      ShardedTrainerOptions o{.strategy = ShardingStrategy::FullShard, .accumulation = AccumulationMode::NoSync};
      o.collective.deterministic = true;
      gradsync::ReplicatedTrainerOptions ro;
      ro.sync.collective.deterministic = true;
      ShardedTrainer sharded(comm, LowSquares{Squares{sizes, 7}}, adam, o);
      o.strategy = ShardingStrategy::NoShard;
      ShardedTrainer no_shard(comm, LowSquares{Squares{sizes, 7}}, adam, o);
      ReplicatedTrainer replicated(comm, LowSquares{Squares{sizes, 7}}, adam, ro);
      ReplicatedTrainer plain(comm, Squares{sizes, 7}, adam, ro);
      const auto r = static_cast<float>(comm.rank());
      for (int step = 0; step < 3; ++step) accumulate_then_step(r, sharded, no_shard, replicated, plain);
      const std::vector<float> params(replicated.parameters().begin(), replicated.parameters().end());
      CHECK(bitwise_equal(sharded.full_parameters(), params));
      CHECK(bitwise_equal(no_shard.full_parameters(), params));
      CHECK(no_shard.persistent_bytes() == 16 * psi + 4 * psi);
      CHECK(no_shard.memory_need().persistent() == no_shard.persistent_bytes());
      no_shard.evaluate([&](const gradsync::StepContext<bfloat16>& ctx) {
        std::size_t at = 0;
        for (std::size_t u = 0; u < sizes.size(); ++u) {
          const auto p = ctx.params(u);
          for (const bfloat16 x : p->flat_params) CHECK(x == bfloat16(params[at++]));
        }
      });
      const std::vector<float> reference(plain.parameters().begin(), plain.parameters().end());
      CHECK(!bitwise_equal(params, reference));
      CHECK(worst_relative(params, reference) <= 3 * 0.01 * std::ldexp(1.0, -7));
      // Adam: (2 + 2)·4·Ψ, and the bfloat16 parameters and gradients.
      CHECK(replicated.persistent_bytes() == 16 * psi + 4 * psi);
      CHECK(replicated.memory_need().persistent() == replicated.persistent_bytes());
      // The model sees the master rounded to bfloat16, also after the
      // parameters were changed outside a step.
      replicated.parameters()[0] = 1.0f + 0x1p-12f;
      replicated.evaluate([&](const gradsync::StepContext<bfloat16>& ctx) {
        std::size_t at = 0;
        for (std::size_t u = 0; u < sizes.size(); ++u) {
          const auto p = ctx.params(u);
          for (const bfloat16 x : p->flat_params) CHECK(x == bfloat16(replicated.parameters()[at++]));
        }
      });
    });
  });
}

namespace {

/// LowSquares with a buffer in its first unit.
struct LowSquaresWithBuffer : LowSquares {
  std::vector<gradsync::UnitSpec> units() const {
    std::vector<gradsync::UnitSpec> u = LowSquares::units();
    u.front().buffers.push_back({"running_mean", {3}});
    return u;
  }
};

}  // namespace

TEST_CASE("bfloat16 compute: a float32 param_dtype and buffers (both trainers) throw on every rank") {
  for (int world = 1; world <= 3; ++world) {
    CAPTURE(world);
    auto refused = [&](auto model, ShardedTrainerOptions o, const char* needle) {
      INFO("expected: " << std::string(needle));
      const std::vector<std::string> messages = test::refusals_on_threads(
          world, [&](Communicator<Threads>& comm) { ShardedTrainer trainer(comm, model, gradsync::Sgd<float>(), o); });
      for (const std::string& m : messages) {
        INFO(m);
        CHECK(m.find(needle) != std::string::npos);
      }
    };
    const LowSquares model{Squares{{5, 8}, 3}};
    ShardedTrainerOptions f32;
    f32.param_dtype = gradsync::DataType::float32;
    refused(model, f32, "leave ShardedTrainerOptions::param_dtype unset or make it bfloat16, not float");
    refused(LowSquaresWithBuffer{model}, {}, "declares buffers (unit 'u0', 'running_mean')");
    const std::vector<std::string> messages = test::refusals_on_threads(world, [&](Communicator<Threads>& comm) {
      ReplicatedTrainer trainer(comm, LowSquaresWithBuffer{model}, gradsync::Sgd<float>());
    });
    for (const std::string& m : messages) CHECK(m.find("declares buffers (unit 'u0', 'running_mean')") != std::string::npos);
  }
}

}  // namespace test_train_memory
