// ShardedTrainer over the Mpi backend, one rank per mpirun process (2 to 4):
// parity with ReplicatedTrainer for every strategy and optimizer, bitwise
// under deterministic; the collectives of a step, and on each process's
// timeline file; an asynchronous checkpoint written while the processes
// train on; a rank whose units differ; a rank that asks for another unit of
// equal size; and HybridShard's processes parting ways. The runs and
// expectations are the Threads tests' own (test_train_sharded_schedule.hpp,
// test_train_swapping.hpp); each process checks its rank and compares
// hashes with the others.
#include <doctest/doctest.h>

#include <gradsync/backend/mpi.hpp>
#include <gradsync/gradsync.hpp>
#include <gradsync/train/checkpoint/async_checkpointer.hpp>
#include <gradsync/train/checkpoint/sharded_checkpoint.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "../support/common.hpp"
#include "../support/temp_dir.hpp"
#include "../support/trace_events.hpp"
#include "../support/unit_disagreement.hpp"
#include "../support/world.hpp"
#include "../test_train_sharded_schedule.hpp"
#include "../test_train_squares.hpp"
#include "../test_train_swapping.hpp"

// Everything in this file is in its own namespace: the Mpi suites compile it
// in one translation unit with other test files (test/mpi/meson.build).
namespace test_train_sharded_mpi {

using gradsync::Mpi;
using test_squares::LowSquares;
using test_squares::Scale;
using test_squares::Squares;
using test_train::Declared;
using namespace test_schedule;

namespace {

/// True when every process passes the same bytes.
bool same_on_every_rank(const void* p, std::size_t bytes) {
  const int n = test::mpi_size();
  std::vector<std::uint64_t> mine(static_cast<std::size_t>(n));
  mine[static_cast<std::size_t>(test::mpi_rank())] = test::hash_bytes(p, bytes);
  const std::vector<std::uint64_t> all = test::all_values(n, mine);
  for (const std::uint64_t h : all) {
    if (h != all[0]) return false;
  }
  return true;
}
bool same_on_every_rank(const std::vector<float>& v) { return same_on_every_rank(v.data(), v.size() * sizeof(float)); }
bool same_on_every_rank(const std::string& s) { return same_on_every_rank(s.data(), s.size()); }

/// Runs `body(world, batches)` with the processes' world and `steps` random
/// steps of `b` samples a rank, drawn from the test seed's stream
/// `seed_name`; the seed and the world are printed on failure.
template <class Body>
void with_mpi_batches(const char* seed_name, int steps, std::size_t b, Body body) {
  const int world = test::mpi_size();
  const auto batches = random_batches(test::rng_for(seed_name)(), steps, world, b);
  INFO("GRADSYNC_TEST_SEED = " << test::test_seed() << ", world = " << world);
  body(world, batches);
}

/// Random Squares unit sizes for this world, drawn from `salt`'s generator.
std::vector<std::size_t> squares_sizes(const char* salt) {
  auto rng = test::rng_for(salt);
  return test_squares::random_sizes(rng, test::mpi_size());
}

/// What a Squares case prints on failure.
std::string squares_case(const std::vector<std::size_t>& sizes) {
  return "GRADSYNC_TEST_SEED = " + std::to_string(test::test_seed()) + ", world = " +
         std::to_string(test::mpi_size()) + ", sizes = " + test_squares::joined(sizes);
}

/// The strategies this world runs: HybridShard where it splits into groups.
std::vector<ShardingStrategy> strategies_for(int world) {
  std::vector<ShardingStrategy> s;
  for (const ShardingStrategy x : all_strategies) {
    if (x != ShardingStrategy::HybridShard || hybrid_shard_size(world) > 0) s.push_back(x);
  }
  return s;
}

template <class Opt>
void check_parity(const char* opt_name, const Opt& opt) {
  const int world = test::mpi_size();
  const auto batches = random_batches(test::rng_for(opt_name)(), 20, world, 3);
  INFO("GRADSYNC_TEST_SEED = " << test::test_seed() << ", world = " << world << ", optimizer = " << opt_name);
  test::run_world(world, [&](Communicator<Mpi>& comm) {
    for (const bool deterministic : {false, true}) {
      CAPTURE(deterministic);
      const std::vector<float> replicated = replicated_parameters(comm, batches, opt, deterministic);
      CHECK(same_on_every_rank(replicated));
      for (const ShardingStrategy s : strategies_for(world)) {
        INFO("strategy = " << std::string(name(s)));
        ShardedTrainerOptions o = options_for(s, world);
        o.collective.deterministic = deterministic;
        const std::vector<float> sharded = sharded_parameters(comm, batches, opt, o);
        CHECK(same_on_every_rank(sharded));
        check_matches_replicated(sharded, replicated, s, deterministic);
      }
    }
  });
}

}  // namespace

TEST_CASE("mpi parity: SGD, 20 steps, every strategy equals ReplicatedTrainer (bitwise when deterministic)") {
  check_parity("SGD", gradsync::Sgd<float>({.lr = 0.1}));
}

TEST_CASE("mpi parity: momentum SGD") { check_parity("momentum", gradsync::Sgd<float>({.lr = 0.05, .momentum = 0.9})); }

TEST_CASE("mpi parity: Adam") { check_parity("Adam", gradsync::Adam<float>({.lr = 0.01})); }

TEST_CASE("mpi parity: AdamW") { check_parity("AdamW", gradsync::AdamW<float>({.lr = 0.01, .weight_decay = 0.1})); }

TEST_CASE("mpi trace: the collectives of one step, in order and counted, the same on every rank") {
  with_mpi_batches("mpi trace", 2, 2, [&](int world, const Batches& batches) {
    test::run_world(world, [&](Communicator<Mpi>& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      for (const ShardingStrategy s : strategies_for(world)) {
        for (const bool keep : {true, false}) {
          INFO("strategy = " << std::string(name(s)) << ", keep_last_forward_unit = " << keep);
          ShardedTrainerOptions o = options_for(s, world);
          o.keep_last_forward_unit = keep;
          ShardedTrainer trainer(comm, model_for(comm.rank()), gradsync::Sgd<float>({.lr = 0.05, .momentum = 0.9}), o);
          trainer.step(batches[0][r]);
          const std::uint64_t before = comm.sequence();
          trainer.step(batches[1][r]);
          const std::uint64_t calls = comm.sequence() - before;
          const Trace expected = expected_trace(s, layers.size(), keep);
          const std::string got = describe(trainer.trace());
          CHECK(got == describe(expected));
          CHECK(same_on_every_rank(got));
          // Nothing else on the communicator but the buffers' broadcast and the
          // agreement on finite gradients (HybridShard's collectives run on its
          // split communicators).
          if (s != ShardingStrategy::HybridShard) CHECK(calls == expected.size() + 2);
        }
      }
    });
  });
}

TEST_CASE("mpi timeline: each process's file holds its step's collectives, and the ranks' steps share one clock") {
  with_mpi_batches("mpi timeline", 1, 2, [&](int world, const Batches& batches) {
    for (const ShardingStrategy s : strategies_for(world)) {
      INFO("strategy = " << std::string(name(s)));
      const test::TempDir out;  // this process's own: each rank reads back the file it wrote
      test::run_world(world, [&](Communicator<Mpi>& comm) {
        comm.trace_to(out.path.string());
        ShardedTrainer trainer(comm, model_for(comm.rank()), gradsync::Sgd<float>({.lr = 0.05}), options_for(s, world));
        trainer.step(batches[0][static_cast<std::size_t>(comm.rank())]);
        const test::TraceFile f = test::read_trace(comm.write_trace());
        std::map<std::string, std::size_t> expected;
        for (const auto& e : expected_trace(s, layers.size(), true)) ++expected[std::string(name(e.collective))];
        // In a HybridShard group of one rank the reduce-scatter is a copy, not a call.
        if (s == ShardingStrategy::HybridShard && hybrid_shard_size(world) == 1) expected.erase("ReduceScatter");
        std::map<std::string, std::size_t> on_worker;
        double from = -1, to = -1;
        for (const test::TraceLine& e : f.events) {
          CHECK(e.pid == comm.rank());
          if (e.name == "step 1") from = e.ts, to = e.ts + e.dur;
        }
        REQUIRE(from >= 0);
        for (const test::TraceLine& e : f.events) {
          if (e.cat == "communication" && !test::trace_field(e.line, "seq").empty() &&
              f.thread_names.at(e.tid) == "progress worker" && e.ts >= from && e.ts + e.dur <= to) {
            ++on_worker[e.name];
            CHECK(test::trace_field(e.line, "backend") == "Mpi");
          }
        }
        const auto words = [](const std::map<std::string, std::size_t>& m) {
          std::string t;
          for (const auto& [k, n] : m) t += k + " x" + std::to_string(n) + "; ";
          return t;
        };
        CHECK(words(on_worker) == words(expected));
        // CLOCK_MONOTONIC is one clock for the host's processes: every rank's
        // step, which waits in collectives for all the others, overlaps every other's.
        const auto us = [](double t) { return static_cast<std::uint64_t>(t); };
        std::vector<std::uint64_t> mine(static_cast<std::size_t>(world));
        mine[static_cast<std::size_t>(comm.rank())] = us(from);
        const std::vector<std::uint64_t> starts = test::all_values(world, mine);
        mine[static_cast<std::size_t>(comm.rank())] = us(to) + 1;
        const std::vector<std::uint64_t> ends = test::all_values(world, mine);
        CHECK(*std::max_element(starts.begin(), starts.end()) <= *std::min_element(ends.begin(), ends.end()));
      });
    }
  });
}

// Across processes, each rank writing its own values unit by unit (init_unit:
// one wrapped unit held at a time, one broadcast each): every strategy starts
// from rank 0's. (bind's path is the parity cases': their Mlp binds, with
// values that differ by rank.)
TEST_CASE("mpi async checkpoint: saved while the processes step on, it loads as the state at save(), both layouts") {
  with_mpi_batches("mpi async checkpoint", 4, 3, [&](int world, const Batches& batches) {
    test::run_world(world, [&](Communicator<Mpi>& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      // One directory for every process: rank 0's, its path broadcast as integers.
      std::optional<test::TempDir> dir;
      std::vector<std::int32_t> path_chars(4096, 0);
      if (r == 0) {
        dir.emplace();
        const std::string p = dir->path.string();
        REQUIRE(p.size() < path_chars.size());
        std::copy(p.begin(), p.end(), path_chars.begin());
      }
      gradsync::Broadcast<>{}(comm, std::span<std::int32_t>(path_chars), 0);
      std::string root;
      for (const std::int32_t c : path_chars) {
        if (c == 0) break;
        root += static_cast<char>(c);
      }
      for (const gradsync::CheckpointFormat format : {gradsync::CheckpointFormat::full, gradsync::CheckpointFormat::sharded}) {
        const std::string layout = format == gradsync::CheckpointFormat::full ? "full" : "sharded";
        for (const ShardingStrategy s : strategies_for(world)) {
          INFO("layout = " << layout << ", strategy = " << std::string(name(s)));
          ShardedTrainerOptions o = options_for(s, world);
          o.collective.deterministic = true;
          const gradsync::Adam<float> adam({.lr = 0.01});
          ShardedTrainer t(comm, model_for(comm.rank()), adam, o);
          gradsync::AsyncCheckpointer ckpt(t);
          ckpt.reserve({.format = format});
          t.step(batches[0][r]);
          t.step(batches[1][r]);
          const std::vector<float> at_save = t.full_parameters();
          const std::string target = root + "/ckpt-" + std::string(name(s)) + "-" + layout;
          ckpt.save(target, {}, {.format = format});
          t.step(batches[2][r]);
          ckpt.wait();
          CHECK(!ckpt.pending());
          // Other initial values, then the checkpoint: the parameters and Adam's state at save().
          ShardedTrainer u(comm, model_for(comm.rank() + 7), adam, o);
          gradsync::load_checkpoint(u, target);
          CHECK(u.full_parameters() == at_save);
          u.step(batches[2][r]);
          const std::vector<float> resumed = u.full_parameters(), trained = t.full_parameters();
          CHECK(resumed == trained);
          CHECK(same_on_every_rank(resumed));
        }
      }
    });
  });
}

TEST_CASE("mpi construction: init_unit starts every strategy from rank 0's values, a wrapped unit at a time") {
  const int world = test::mpi_size();
  const std::vector<std::size_t> sizes = squares_sizes("mpi construction");
  INFO(squares_case(sizes));
  const std::vector<float> expected = test_squares::initial_values(sizes, 5);
  test::run_world(world, [&](Communicator<Mpi>& comm) {
    const std::uint64_t seed = 5 + 3 * static_cast<std::uint64_t>(comm.rank());
    for (const ShardingStrategy s : strategies_for(world)) {
      INFO("strategy = " << std::string(name(s)));
      ShardedTrainer trainer(comm, Squares{sizes, seed}, gradsync::Sgd<float>({.lr = 0.1}), options_for(s, world));
      std::size_t largest = 0;
      for (std::size_t w = 0; w < trainer.unit_count(); ++w) largest = std::max(largest, trainer.unit_size(w));
      CHECK(trainer.construction_bytes() == (s != ShardingStrategy::NoShard ? largest * sizeof(float) : 0));
      CHECK(bitwise_equal(trainer.full_parameters(), expected));
      trainer.step(Scale{1.0f + static_cast<float>(comm.rank())});
      CHECK(same_on_every_rank(trainer.full_parameters()));
    }
  });
}

// A model computing in bfloat16 over MPI: every strategy, and
// ReplicatedTrainer, which under the deterministic option the non-hybrid
// strategies equal bitwise (NoSync accumulation, as ReplicatedTrainer's).
TEST_CASE("mpi bfloat16 compute: every strategy and ReplicatedTrainer agree, bitwise when deterministic") {
  const int world = test::mpi_size();
  const std::vector<std::size_t> sizes = squares_sizes("mpi bf16 compute");
  INFO(squares_case(sizes));
  const auto adam = gradsync::Adam<float>({.lr = 0.01});
  test::run_world(world, [&](Communicator<Mpi>& comm) {
    const auto r = static_cast<float>(comm.rank());
    auto train = [&](auto& t) {
      for (int k = 0; k < 3; ++k) {
        t.accumulate(Scale{1.0f + r});
        t.step(Scale{0.5f * r});
      }
    };
    gradsync::ReplicatedTrainerOptions ro;
    ro.sync.collective.deterministic = true;
    ReplicatedTrainer replicated(comm, LowSquares{Squares{sizes, 5}}, adam, ro);
    train(replicated);
    const std::vector<float> reference(replicated.parameters().begin(), replicated.parameters().end());
    CHECK(same_on_every_rank(reference));
    for (const ShardingStrategy s : strategies_for(world)) {
      INFO("strategy = " << std::string(name(s)));
      ShardedTrainerOptions o = options_for(s, world);
      o.accumulation = gradsync::AccumulationMode::NoSync;
      o.collective.deterministic = true;
      ShardedTrainer trainer(comm, LowSquares{Squares{sizes, 5}}, adam, o);
      train(trainer);
      const std::vector<float> p = trainer.full_parameters();
      CHECK(same_on_every_rank(p));
      if (s != ShardingStrategy::HybridShard) {
        CHECK(bitwise_equal(p, reference));
      } else {
        // Summed in another order, the master may round to another bfloat16.
        CHECK(worst_relative(p, reference) <= 3 * 0.01 * std::ldexp(1.0, -7));
      }
    }
    // Reduced in bfloat16 from the model's own gradient buffer.
    ShardedTrainerOptions rb = options_for(ShardingStrategy::FullShard, world);
    rb.reduce_dtype = gradsync::DataType::bfloat16;
    ShardedTrainer low_reduced(comm, LowSquares{Squares{sizes, 5}}, adam, rb);
    train(low_reduced);
    const std::vector<float> p = low_reduced.full_parameters();
    CHECK(same_on_every_rank(p));
    CHECK(worst_relative(p, reference) <= 3 * 0.01 * std::ldexp(1.0, -6));
  });
}

TEST_CASE("mpi units: a rank whose units differ makes every rank throw the same error, within the deadline") {
  const std::vector<gradsync::UnitSpec> mine{{"fc1", {{"weight", {3, 5}}}, {}}, {"fc2", {{"weight", {5, 3}}}, {}}};
  auto transposed = mine;
  transposed[1].params[0].shape = {3, 5};
  const int world = test::mpi_size();
  const int odd = world - 1;
  test::run_world(world, [&](Communicator<Mpi>& comm) {
    comm.set_timeout(std::chrono::seconds(10));
    std::string message;
    int constructed = 0;
    const auto t0 = std::chrono::steady_clock::now();
    test::catch_message(message, [&] {
      ShardedTrainer trainer(comm, Declared<float>{comm.rank() == odd ? transposed : mine}, gradsync::Sgd<float>());
      constructed = 1;
    });
    // Well inside the deadline: the ranks agreed on the error, none waited it out.
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
    test::check_unit_disagreement("ShardedTrainer", {message}, {constructed}, 1, odd);
    CHECK(same_on_every_rank(message));
  });
}

TEST_CASE("mpi labels: a rank that asks for another unit of equal size fails every rank, naming both units") {
  const int world = test::mpi_size();
  auto rng = test::rng_for("mpi sharded unit identity");
  for (const ShardingStrategy strategy : all_strategies) {
    // The same draws on every process: the job shares one seed.
    const int odd = static_cast<int>(rng() % static_cast<unsigned>(world));
    const std::size_t a = rng() % 3, b = a + 1 + rng() % (3 - a);  // 0 <= a < b <= 3
    const std::size_t bad_step = 1 + rng() % 3;
    INFO("GRADSYNC_TEST_SEED = " << test::test_seed() << ", world = " << world << ", " << std::string(name(strategy))
                                 << ", rank " << odd << " swaps fc" << a << " and fc" << b << " in step " << bad_step);
    test::run_world(world, [&](Communicator<Mpi>& comm) {
      comm.set_timeout(std::chrono::seconds(10));
      std::string message = "returned";
      const auto t0 = std::chrono::steady_clock::now();
      test::catch_message(message, [&] {
        test_swapping::Swapping m{.rank = comm.rank(), .odd = odd, .a = a, .b = b, .bad_step = bad_step};
        ShardedTrainerOptions o{.strategy = strategy};
        if (strategy == ShardingStrategy::HybridShard) o.shard_size = world == 4 ? 2 : 1;
        ShardedTrainer trainer(comm, m, gradsync::Sgd<float>({.lr = 0.1}), o);
        for (std::size_t s = 0; s < 4; ++s) trainer.step(Scale{1.0f});
      });
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      INFO("rank " << comm.rank() << " after " << seconds << " s: " << message);
      CHECK(seconds < 5.0);
      CHECK(message.find("ranks disagree") != std::string::npos);
      CHECK(message.find("step " + std::to_string(bad_step) + ", ") != std::string::npos);
      CHECK(message.find("'fc" + std::to_string(a) + "'") != std::string::npos);
      CHECK(message.find("'fc" + std::to_string(b) + "'") != std::string::npos);
      CHECK(message.find("rank " + std::to_string(odd)) != std::string::npos);
    });
  }
}

TEST_CASE("mpi HybridShard: a model that throws on one process, or a save on one, fails every process at once") {
  // The processes would otherwise wait in different communicators (shard
  // group, replica group, world) for the whole deadline.
  const int world = test::mpi_size();
  auto rng = test::rng_for("mpi HybridShard parting");
  for (int round = 0; round < 4; ++round) {
    // The same draws on every process: the job shares one seed.
    const int odd = static_cast<int>(rng() % static_cast<unsigned>(world));
    const int shard_size = world % 2 == 0 && rng() % 2 == 0 ? 2 : 1;
    const bool save = round % 2 == 1;
    const int fail_after = static_cast<int>(rng() % 9);
    INFO("GRADSYNC_TEST_SEED = " << test::test_seed() << ", world = " << world << ", shard_size " << shard_size
                                 << ", rank " << odd << (save ? " saves" : " throws after ") << (save ? 0 : fail_after)
                                 << " before step 2");
    const test::TempDir dir;  // this process's own: only the odd rank's save would write
    test::run_world(world, [&](Communicator<Mpi>& comm) {
      comm.set_timeout(std::chrono::seconds(10));
      std::string message = "returned";
      const auto t0 = std::chrono::steady_clock::now();
      test::catch_message(message, [&] {
        ShardedTrainer t(comm, test_squares::Faulty{{{10, 7, 3, 5}, 1}}, gradsync::Sgd<float>({.lr = 0.1}),
                         {.strategy = ShardingStrategy::HybridShard, .shard_size = shard_size});
        for (int s = 1; s <= 3; ++s) {
          if (s == 2 && comm.rank() == odd && save) gradsync::save_checkpoint(t, dir.path / "ckpt.safetensors");
          if (s == 2 && comm.rank() == odd && !save) {
            t.model().fail_after = fail_after;
            try {
              t.step(Scale{1.0f});
            } catch (const std::runtime_error& e) {
              if (std::string(e.what()) != "the model failed") throw;
            }
            t.model().fail_after = -1;
          }
          t.step(Scale{1.0f});
        }
      });
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      INFO("rank " << comm.rank() << " after " << seconds << " s: " << message);
      CHECK(seconds < 5.0);
      CHECK(message != "returned");
      if (!save) CHECK(message.find("rank " + std::to_string(odd) + "'s model threw in") != std::string::npos);
    });
  }
}

}  // namespace test_train_sharded_mpi
