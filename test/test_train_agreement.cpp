// Ranks that would train different models while every count matches: units
// asked for in another order, different options or optimizers, a learning
// rate changed on one rank, clipping that differs. Each must end in the same
// InvalidArgument on every rank, naming what differs and who, within the
// deadline; none may return as if the step had worked.

#include <doctest/doctest.h>

#include <gradsync/gradsync.hpp>
#include <gradsync/train/checkpoint/replicated_checkpoint.hpp>
#include <gradsync/train/checkpoint/async_checkpointer.hpp>
#include <gradsync/train/checkpoint/sharded_checkpoint.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "support/common.hpp"
#include "support/temp_dir.hpp"
#include "test_train_squares.hpp"
#include "test_train_swapping.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// the trainer tests as one unity translation unit.
namespace test_train_agreement {

using gradsync::Communicator;
using gradsync::ShardedTrainer;
using gradsync::ShardedTrainerOptions;
using gradsync::ShardingStrategy;
using gradsync::Threads;
using test_squares::Faulty;
using test_squares::Scale;
using Clock = std::chrono::steady_clock;

using test_swapping::Swapping;

struct Outcome {
  std::string kind = "returned";
  std::string what;
};

/// Runs body on n ranks with a 10 s deadline: each rank's outcome, and the
/// slowest rank's seconds.
std::pair<std::vector<Outcome>, double> run(int n, const std::function<void(Communicator<Threads>&)>& body) {
  std::vector<Outcome> out(static_cast<std::size_t>(n));
  const auto t0 = Clock::now();
  try {
    gradsync::run_threads(n, gradsync::ThreadsOptions{.timeout = std::chrono::seconds(10)}, [&](Communicator<Threads>& c) {
      Outcome& o = out[static_cast<std::size_t>(c.rank())];
      try {
        body(c);
      } catch (const gradsync::InvalidArgument& e) {
        o = {"InvalidArgument", e.what()};
        throw;
      } catch (const std::exception& e) {
        o = {"other", e.what()};
        throw;
      }
    });
  } catch (const std::exception&) {
  }
  return {out, std::chrono::duration<double>(Clock::now() - t0).count()};
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST_CASE("ShardedTrainer: a rank that asks for another unit of equal size fails every rank, naming both units") {
  auto rng = test::rng_for("sharded unit identity");
  CAPTURE(test::test_seed());
  for (const ShardingStrategy strategy : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp,
                                          ShardingStrategy::NoShard, ShardingStrategy::HybridShard}) {
    for (int n = 3; n <= 5; ++n) {
      const int odd = static_cast<int>(rng() % static_cast<unsigned>(n));
      const std::size_t a = rng() % 3, b = a + 1 + rng() % (3 - a);  // 0 <= a < b <= 3
      const std::size_t bad_step = 1 + rng() % 3;
      INFO(gradsync::name(strategy) << ", N = " << n << ", rank " << odd << " swaps fc" << a << " and fc" << b
                                    << " in step " << bad_step);
      const auto [got, seconds] = run(n, [&](Communicator<Threads>& comm) {
        Swapping m{.rank = comm.rank(), .odd = odd, .a = a, .b = b, .bad_step = bad_step};
        ShardedTrainerOptions o{.strategy = strategy};
        if (strategy == ShardingStrategy::HybridShard) o.shard_size = n == 4 ? 2 : 1;
        ShardedTrainer trainer(comm, m, gradsync::Sgd<float>({.lr = 0.1}), o);
        for (std::size_t s = 0; s < 4; ++s) trainer.step(Scale{1.0f});
      });
      for (int r = 0; r < n; ++r) {
        const Outcome& o = got[static_cast<std::size_t>(r)];
        INFO("rank " << r << ": " << o.kind << ": " << o.what);
        CHECK(o.kind == "InvalidArgument");
        CHECK(contains(o.what, "ranks disagree"));
        CHECK(contains(o.what, "step " + std::to_string(bad_step) + ", "));
        // Which pair is met first depends on the strategy (forward gathers,
        // backward reductions): the swapped units are the ones named.
        CHECK(contains(o.what, "'fc" + std::to_string(a) + "'"));
        CHECK(contains(o.what, "'fc" + std::to_string(b) + "'"));
        // Under HybridShard the groups number their ranks anew: the world rank comes first.
        if (strategy == ShardingStrategy::HybridShard) {
          CHECK(contains(o.what, "world rank " + std::to_string(odd) + " (rank "));
        } else {
          CHECK(contains(o.what, "rank " + std::to_string(odd) + " called"));
        }
      }
      CHECK(seconds < 5.0);
    }
  }
}

/// Each way a rank's configuration can differ, as a trainer body that
/// builds the odd rank's trainer differently and takes two steps.
struct Divergence {
  const char* name;
  const char* field;     ///< what the message names
  std::string ours;      ///< the value on the other ranks, as printed
  std::string theirs;    ///< the odd rank's
  std::function<void(Communicator<Threads>&, bool odd)> body;
};

template <class Opt>
void sharded_steps(Communicator<Threads>& comm, Opt opt, ShardedTrainerOptions o = {}) {
  ShardedTrainer trainer(comm, test_squares::Squares{{10, 7, 3}, 1}, std::move(opt), o);
  for (int s = 0; s < 2; ++s) trainer.step(Scale{1.0f});
}

template <class Opt>
void replicated_steps(Communicator<Threads>& comm, Opt opt, gradsync::ReplicatedTrainerOptions o = {}) {
  gradsync::ReplicatedTrainer trainer(comm, test_squares::Squares{{10, 7, 3}, 1}, std::move(opt), o);
  for (int s = 0; s < 2; ++s) trainer.step(Scale{1.0f});
}

/// Ranks whose ShardedTrainers (SGD) differ in their options only: `ours` on
/// the other ranks, `theirs` on the odd one.
Divergence sharded_options(const char* name, const char* field, std::string ours, std::string theirs,
                           const ShardedTrainerOptions& ours_o, const ShardedTrainerOptions& theirs_o) {
  return {name, field, std::move(ours), std::move(theirs), [ours_o, theirs_o](auto& c, bool odd) {
            sharded_steps(c, gradsync::Sgd<float>(), odd ? theirs_o : ours_o);
          }};
}

/// The same for ReplicatedTrainers.
Divergence replicated_options(const char* name, const char* field, std::string ours, std::string theirs,
                              const gradsync::ReplicatedTrainerOptions& ours_o,
                              const gradsync::ReplicatedTrainerOptions& theirs_o) {
  return {name, field, std::move(ours), std::move(theirs), [ours_o, theirs_o](auto& c, bool odd) {
            replicated_steps(c, gradsync::Sgd<float>(), odd ? theirs_o : ours_o);
          }};
}

std::vector<Divergence> divergences() {
  using gradsync::Adam;
  using gradsync::AdamW;
  using gradsync::Sgd;
  return {
      {"ShardedTrainer, Sgd lr", "optimizer lr", "0.4", "0.1",
       [](auto& c, bool odd) { sharded_steps(c, Sgd<float>({.lr = odd ? 0.1 : 0.4})); }},
      {"ReplicatedTrainer, Sgd lr", "optimizer lr", "0.4", "0.1",
       [](auto& c, bool odd) { replicated_steps(c, Sgd<float>({.lr = odd ? 0.1 : 0.4})); }},
      {"ReplicatedTrainer, Sgd momentum", "optimizer momentum", "0.9", "0",
       [](auto& c, bool odd) { replicated_steps(c, Sgd<float>({.lr = 0.1, .momentum = odd ? 0.0 : 0.9})); }},
      {"ShardedTrainer, Adam against AdamW", "optimizer", "Adam", "AdamW",
       [](auto& c, bool odd) {
         if (odd) {
           sharded_steps(c, AdamW<float>());
         } else {
           sharded_steps(c, Adam<float>());
         }
       }},
      {"ReplicatedTrainer, Adam beta2", "optimizer beta2", "0.999", "0.99",
       [](auto& c, bool odd) { replicated_steps(c, Adam<float>({.beta2 = odd ? 0.99 : 0.999})); }},
      {"ReplicatedTrainer, an Adam that stepped before", "optimizer steps taken", "0", "1",
       [](auto& c, bool odd) {
         Adam<float> adam;
         if (odd) {
           std::vector<float> p(20, 1.0f), g(20, 0.5f);  // the model's 10 + 7 + 3 parameters
           adam.step(std::span<float>(p), std::span<const float>(g));
         }
         replicated_steps(c, std::move(adam));
       }},
      {"ShardedTrainer, Adam eps", "optimizer eps", "1e-08", "1e-06",
       [](auto& c, bool odd) { sharded_steps(c, Adam<float>({.eps = odd ? 1e-6 : 1e-8})); }},
      {"ShardedTrainer, AdamW weight decay", "optimizer weight_decay", "0.01", "0.1",
       [](auto& c, bool odd) { sharded_steps(c, AdamW<float>({.weight_decay = odd ? 0.1 : 0.01})); }},
      sharded_options("ShardedTrainer, strategy", "ShardedTrainerOptions::strategy", "FullShard", "ShardGradOp",
                      {.strategy = ShardingStrategy::FullShard}, {.strategy = ShardingStrategy::ShardGradOp}),
      sharded_options("ShardedTrainer, HybridShard shard_size", "ShardedTrainerOptions::shard_size", "0", "1",
                      {.strategy = ShardingStrategy::HybridShard, .shard_size = 0},
                      {.strategy = ShardingStrategy::HybridShard, .shard_size = 1}),
      sharded_options("ShardedTrainer, accumulation mode", "ShardedTrainerOptions::accumulation", "Sharded", "NoSync",
                      {.accumulation = gradsync::AccumulationMode::Sharded},
                      {.accumulation = gradsync::AccumulationMode::NoSync}),
      sharded_options("ShardedTrainer, param_dtype", "ShardedTrainerOptions::param_dtype", "unset", "bfloat16", {},
                      {.param_dtype = gradsync::DataType::bfloat16}),
      sharded_options("ShardedTrainer, deterministic", "ShardedTrainerOptions::collective.deterministic", "false",
                      "true", {.collective = {.deterministic = false}}, {.collective = {.deterministic = true}}),
      sharded_options("ShardedTrainer, backward prefetch", "ShardedTrainerOptions::backward_prefetch", "None",
                      "BackwardPre", {.backward_prefetch = gradsync::BackwardPrefetch::None},
                      {.backward_prefetch = gradsync::BackwardPrefetch::BackwardPre}),
      sharded_options("ShardedTrainer, wrap policy", "ShardedTrainerOptions::wrap", "per unit",
                      "size-based (at least 8 parameters)", {.wrap = gradsync::WrapPolicy::per_unit()},
                      {.wrap = gradsync::WrapPolicy::size_based(8)}),
      replicated_options("ReplicatedTrainer, bucket size", "GradSyncOptions::bucket_cap_bytes", "26214400", "64", {},
                         {.sync = {.bucket_cap_bytes = 64}}),
      replicated_options("ReplicatedTrainer, bf16 compression", "GradSyncOptions::compression", "none", "bf16", {},
                         {.sync = {.compression = gradsync::Compression::bf16}}),
  };
}

TEST_CASE("trainers agree on their options and optimizer at construction, naming each rank's value") {
  auto rng = test::rng_for("trainer settings agreement");
  CAPTURE(test::test_seed());
  for (const Divergence& d : divergences()) {
    const int n = 3 + static_cast<int>(rng() % 3);
    const int odd = static_cast<int>(rng() % static_cast<unsigned>(n));
    INFO(d.name << ", N = " << n << ", odd rank " << odd);
    const auto [got, seconds] = run(n, [&](Communicator<Threads>& comm) { d.body(comm, comm.rank() == odd); });
    // "optimizer lr: 0.4 on world ranks 0-1, 3, 0.1 on world rank 2": the others' value first (rank 0 holds it unless odd).
    std::vector<std::size_t> others;
    for (int r = 0; r < n; ++r) {
      if (r != odd) others.push_back(static_cast<std::size_t>(r));
    }
    const std::string ours = d.ours + " on " + gradsync::detail::rank_list(others, "world rank");
    const std::string theirs = d.theirs + " on world rank " + std::to_string(odd);
    const std::string expected = std::string(d.field) + ": " + (odd == 0 ? theirs + ", " + ours : ours + ", " + theirs);
    for (int r = 0; r < n; ++r) {
      const Outcome& o = got[static_cast<std::size_t>(r)];
      INFO("rank " << r << ": " << o.kind << ": " << o.what);
      CHECK(o.kind == "InvalidArgument");
      CHECK(contains(o.what, "ranks were given different settings: "));
      CHECK(contains(o.what, expected));
      CHECK(o.what == got[0].what);
    }
    CHECK(seconds < 5.0);
  }
}

/// Runs `train(trainer)` with trainer 0 a ReplicatedTrainer, 1 a FullShard
/// and 2 a NoShard ShardedTrainer, each on the same Squares model and SGD.
template <class Train>
void with_trainer(Communicator<Threads>& comm, int trainer, double lr, Train train) {
  const test_squares::Squares m{{10, 7, 3}, 1};
  if (trainer == 0) {
    gradsync::ReplicatedTrainer t(comm, m, gradsync::Sgd<float>({.lr = lr}));
    train(t);
  } else if (trainer < 3) {
    ShardedTrainer t(comm, m, gradsync::Sgd<float>({.lr = lr}),
                     {.strategy = trainer == 1 ? ShardingStrategy::FullShard : ShardingStrategy::NoShard});
    train(t);
  } else {
    // HybridShard: shard groups of 2 where that divides N, else of 1.
    ShardedTrainer t(comm, m, gradsync::Sgd<float>({.lr = lr}),
                     {.strategy = ShardingStrategy::HybridShard, .shard_size = comm.size() % 2 == 0 ? 2 : 1});
    train(t);
  }
}

/// Every rank threw InvalidArgument, within the deadline, naming each of `parts`.
void check_every_rank(const std::vector<Outcome>& got, double seconds, const std::vector<std::string>& parts) {
  for (std::size_t r = 0; r < got.size(); ++r) {
    const Outcome& o = got[r];
    INFO("rank " << r << ": " << o.kind << ": " << o.what);
    CHECK(o.kind == "InvalidArgument");
    for (const std::string& part : parts) CHECK(contains(o.what, part));
  }
  CHECK(seconds < 5.0);
}

/// For each of with_trainer's first `trainers` on 3 to 5 ranks, one of them odd, all
/// drawn from the stream `seed_name` of the test seed (printed on failure):
/// `body(trainer, n, odd, rng)`.
template <class Body>
void each_trainer_with_odd_rank(const char* seed_name, Body body, int trainers = 3) {
  auto rng = test::rng_for(seed_name);
  CAPTURE(test::test_seed());
  for (int trainer = 0; trainer < trainers; ++trainer) {
    const int n = 3 + static_cast<int>(rng() % 3);
    const int odd = static_cast<int>(rng() % static_cast<unsigned>(n));
    body(trainer, n, odd, rng);
  }
}

TEST_CASE("a learning rate changed on one rank fails the next step on every rank, naming both rates") {
  each_trainer_with_odd_rank("lr agreement per step", [](int trainer, int n, int odd, auto& rng) {
    const int change_at = 1 + static_cast<int>(rng() % 3);
    INFO((trainer == 0 ? "ReplicatedTrainer" : trainer == 1 ? "ShardedTrainer FullShard" : "ShardedTrainer NoShard")
         << ", N = " << n << ", rank " << odd << " sets lr 0.05 before step " << change_at);
    const auto [got, seconds] = run(n, [&](Communicator<Threads>& comm) {
      auto train = [&](auto& t) {
        for (int s = 1; s <= 5; ++s) {
          if (comm.rank() == odd && s == change_at) t.optimizer().set_lr(0.05);
          t.step(Scale{1.0f});
        }
      };
      with_trainer(comm, trainer, 0.25, train);
    });
    check_every_rank(got, seconds, {"optimizer lr 0.25", "optimizer lr 0.05", " " + std::to_string(change_at) + ", "});
  });
}

/// The first parameter this rank holds, read without communicating: its
/// replica's, or the first element of its shard of unit 0.
template <class T>
float first_held(T& t) {
  if constexpr (requires { t.parameters(); }) {
    return t.parameters()[0];
  } else {
    return t.unit_shard(0)[0];
  }
}

TEST_CASE("a learning rate set after forward_backward() on one rank fails every rank, even in the last step") {
  // The step's collectives carried forward_backward()'s rate; a rate set on
  // one rank before optimizer_step() must not step that rank apart unseen,
  // whether a checkpoint save or nothing at all follows. HybridShard, whose
  // ranks go on in their groups, refuses it and fails them all.
  auto rng = test::rng_for("lr set between the halves");
  CAPTURE(test::test_seed());
  for (const int trainer : {0, 1, 2, 3}) {
    const int n = 3 + static_cast<int>(rng() % 3);
    const int odd = static_cast<int>(rng() % static_cast<unsigned>(n));
    const int steps = 1 + static_cast<int>(rng() % 3);
    for (const bool save : {true, false}) {
      INFO("trainer " << trainer << ", N = " << n << ", rank " << odd << " sets lr 0.05 after forward_backward of "
                      << "step " << steps << ", the last; then " << std::string(save ? "a checkpoint save" : "nothing"));
      test::TempDir dir;
      std::vector<float> before_last(static_cast<std::size_t>(n), 0), after(static_cast<std::size_t>(n), 0);
      const auto [got, seconds] = run(n, [&](Communicator<Threads>& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        auto train = [&](auto& t) {
          for (int s = 1; s <= steps; ++s) {
            t.forward_backward(Scale{1.0f});
            before_last[r] = first_held(t);
            if (s == steps && comm.rank() == odd) t.optimizer().set_lr(0.05);
            try {
              t.optimizer_step();
            } catch (...) {
              after[r] = first_held(t);
              throw;
            }
          }
          after[r] = first_held(t);
          if (save) gradsync::save_checkpoint(t, dir.path);
        };
        with_trainer(comm, trainer, 0.25, train);
      });
      if (save && trainer == 3) {
        check_every_rank(got, seconds, {"the learning rate was set to 0.05 after forward_backward()", "0.25"});
      } else if (save) {
        // The save's collectives carry no label to read the odd rank's by
        // (a rank reads a peer's label with its own call's names): the
        // message names the two calls and the ranks.
        check_every_rank(got, seconds, {"ranks disagree on a collective", "rank " + std::to_string(odd)});
      } else {
        const Outcome& o = got[static_cast<std::size_t>(odd)];
        INFO("rank " << odd << ": " << o.kind << ": " << o.what);
        CHECK(o.kind != "returned");
        CHECK(seconds < 5.0);
      }
      if (save) CHECK(!std::filesystem::exists(gradsync::checkpoint_file(dir.path)));
      // The rank that set the rate alone never stepped at it.
      CHECK(after[static_cast<std::size_t>(odd)] == before_last[static_cast<std::size_t>(odd)]);
    }
  }
}

TEST_CASE("a learning rate set after forward_backward() on every rank alike is the step's rate") {
  for (const int trainer : {0, 1, 2}) {
    for (int n = 2; n <= 3; ++n) {
      INFO("trainer " << trainer << ", N = " << n);
      std::vector<float> late(static_cast<std::size_t>(n)), early(static_cast<std::size_t>(n));
      gradsync::run_threads(n, [&](Communicator<Threads>& comm) {
        with_trainer(comm, trainer, 0.25, [&](auto& t) {
          t.forward_backward(Scale{1.0f});
          t.optimizer().set_lr(0.125);
          t.optimizer_step();
          late[static_cast<std::size_t>(comm.rank())] = first_held(t);
        });
        with_trainer(comm, trainer, 0.125, [&](auto& t) {
          t.step(Scale{1.0f});
          early[static_cast<std::size_t>(comm.rank())] = first_held(t);
        });
      });
      CHECK(late == early);
    }
  }
}

TEST_CASE("clip_grad_norm with different max_norm on one rank fails every rank, naming both") {
  each_trainer_with_odd_rank("clip agreement", [](int trainer, int n, int odd, auto&) {
    INFO("trainer " << trainer << ", N = " << n << ", odd rank " << odd);
    const auto [got, seconds] = run(n, [&](Communicator<Threads>& comm) {
      auto train = [&](auto& t) {
        for (int s = 0; s < 3; ++s) {
          t.forward_backward(Scale{1.0f});
          t.clip_grad_norm(comm.rank() == odd ? 0.5 : 1.0);
          t.optimizer_step();
        }
      };
      with_trainer(comm, trainer, 0.1, train);
    });
    check_every_rank(got, seconds, {"clip_grad_norm(max_norm = 1, p = 2)", "clip_grad_norm(max_norm = 0.5, p = 2)"});
  });
}

/// HybridShard on n ranks in shard groups of a size drawn from n's divisors
/// (1: replica groups of all ranks; n: one shard group).
ShardedTrainerOptions hybrid_options(int n, std::mt19937_64& rng) {
  std::vector<int> divisors;
  for (int d = 1; d <= n; ++d)
    if (n % d == 0) divisors.push_back(d);
  return {.strategy = ShardingStrategy::HybridShard,
          .shard_size = divisors[static_cast<std::size_t>(rng() % divisors.size())]};
}

/// Four steps of `t` (a trainer over Faulty), each accumulate() then step()
/// where `in_accumulate`; on rank `odd` the model of step `at_step` throws
/// after `fail_after` asks, and that rank catches it and goes on, as a loop
/// that skips a bad batch would.
template <class Trainer>
void steps_with_one_throw(Trainer& t, int rank, int odd, int at_step, int fail_after, bool in_accumulate) {
  auto call = [&](bool micro) { return micro ? t.accumulate(Scale{1.0f}) : t.step(Scale{1.0f}); };
  for (int s = 1; s <= 4; ++s) {
    if (s == at_step && rank == odd) {
      t.model().fail_after = fail_after;
      try {
        call(in_accumulate);
      } catch (const std::runtime_error& e) {
        if (std::string(e.what()) != "the model failed") throw;
      }
      t.model().fail_after = -1;
    }
    if (in_accumulate) t.accumulate(Scale{1.0f});
    t.step(Scale{1.0f});
  }
}

TEST_CASE("a rank whose model throws in a step, caught and retried, fails every rank: HybridShard, ReplicatedTrainer") {
  // HybridShard: its peers wait in shard or replica group calls it will not
  // make, or have finished the step and wait for the next one on the world:
  // neither sees a call it makes elsewhere, so the throw itself must end the
  // step everywhere, before the deadline. ReplicatedTrainer: its retry's
  // buckets would otherwise pair with its peers' buckets of the step it
  // dropped, one step's gradients averaged with the next one's.
  auto rng = test::rng_for("model throws on one rank");
  CAPTURE(test::test_seed());
  const std::vector<std::size_t> sizes{10, 7, 3, 5};
  for (int round = 0; round < 12; ++round) {
    const bool hybrid = round % 2 == 0;
    const int n = 3 + static_cast<int>(rng() % 3);
    const int odd = static_cast<int>(rng() % static_cast<unsigned>(n));
    const ShardedTrainerOptions ho = hybrid_options(n, rng);
    gradsync::ReplicatedTrainerOptions ro;
    ro.sync.first_bucket_cap_bytes = ro.sync.bucket_cap_bytes = 8 * sizeof(float);  // a bucket a unit or so
    const int at_step = 1 + static_cast<int>(rng() % 3);
    const int fail_after = static_cast<int>(rng() % (2 * sizes.size() + 1));
    const bool in_accumulate = rng() % 2 == 0;
    INFO((hybrid ? "HybridShard, shard_size " + std::to_string(ho.shard_size) : std::string("ReplicatedTrainer"))
         << ", N = " << n << ", rank " << odd << "'s model throws after " << fail_after << " asks in "
         << std::string(in_accumulate ? "accumulate()" : "step()") << " of step " << at_step);
    const auto [got, seconds] = run(n, [&](Communicator<Threads>& comm) {
      if (hybrid) {
        ShardedTrainer t(comm, Faulty{{sizes, 1}}, gradsync::Sgd<float>({.lr = 0.1}), ho);
        steps_with_one_throw(t, comm.rank(), odd, at_step, fail_after, in_accumulate);
      } else {
        gradsync::ReplicatedTrainer t(comm, Faulty{{sizes, 1}}, gradsync::Sgd<float>({.lr = 0.1}), ro);
        steps_with_one_throw(t, comm.rank(), odd, at_step, fail_after, in_accumulate);
      }
    });
    for (std::size_t r = 0; r < got.size(); ++r) {
      const Outcome& o = got[r];
      INFO("rank " << r << ": " << o.kind << ": " << o.what);
      CHECK(o.kind != "returned");
      // HybridShard fails every communicator with the model's words; the
      // others meet the disagreement at the next bucket.
      if (hybrid) CHECK(contains(o.what, "rank " + std::to_string(odd) + "'s model threw in"));
    }
    CHECK(seconds < 5.0);
  }
}

TEST_CASE("HybridShard: ranks that make different calls between steps fail every rank at once") {
  // One rank saves, evaluates, gathers the parameters, clips or accumulates
  // where the others step. Its first call may be in a group its peers never
  // call in: each such call starts with a labelled world agreement.
  auto rng = test::rng_for("HybridShard calls that differ");
  CAPTURE(test::test_seed());
  const char* const calls[] = {"a full save", "a sharded save", "evaluate", "full_parameters", "clip_grad_norm",
                               "accumulate"};
  for (int call = 0; call < 6; ++call) {
    const int n = 3 + static_cast<int>(rng() % 3);
    const int odd = static_cast<int>(rng() % static_cast<unsigned>(n));
    const ShardedTrainerOptions o = hybrid_options(n, rng);
    const int at_step = 1 + static_cast<int>(rng() % 2);
    INFO("N = " << n << ", shard_size " << o.shard_size << ", rank " << odd << " calls " << std::string(calls[call])
                << " before step " << at_step);
    test::TempDir dir;
    const auto [got, seconds] = run(n, [&](Communicator<Threads>& comm) {
      ShardedTrainer t(comm, test_squares::Squares{{10, 7, 3, 5}, 1}, gradsync::Sgd<float>({.lr = 0.1}), o);
      for (int s = 1; s <= 3; ++s) {
        if (s == at_step && comm.rank() == odd) {
          switch (call) {
            case 0: gradsync::save_checkpoint(t, dir.path / "full.safetensors"); break;
            case 1:
              gradsync::save_checkpoint(t, dir.path / "sharded", {}, {.format = gradsync::CheckpointFormat::sharded});
              break;
            case 2: t.evaluate([](const auto& ctx) { return ctx.params(0)->flat_params[0]; }); break;
            case 3: t.full_parameters(); break;
            case 4: t.forward_backward(Scale{1.0f}); t.clip_grad_norm(1.0); t.optimizer_step(); break;
            default: t.accumulate(Scale{1.0f});
          }
        }
        t.step(Scale{1.0f});
      }
    });
    for (std::size_t r = 0; r < got.size(); ++r) {
      const Outcome& o = got[r];
      INFO("rank " << r << ": " << o.kind << ": " << o.what);
      CHECK(o.kind != "returned");
    }
    CHECK(seconds < 5.0);
  }
}

TEST_CASE("a checkpoint's save where one rank's learning rate differs fails every rank and commits nothing") {
  // The file records rank 0's rate: saved and loaded, the ranks would
  // agree unseen on a rate one of them never had.
  each_trainer_with_odd_rank("save agreement", [](int trainer, int n, int odd, auto& rng) {
    const bool async = rng() % 2 == 0;
    INFO("trainer " << trainer << ", N = " << n << ", rank " << odd << " sets lr 0.5 before the "
                    << std::string(async ? "asynchronous " : "") << "save");
    test::TempDir dir;
    const auto [got, seconds] = run(n, [&](Communicator<Threads>& comm) {
      with_trainer(comm, trainer, 0.25, [&](auto& t) {
        t.step(Scale{1.0f});
        if (comm.rank() == odd) t.optimizer().set_lr(0.5);
        if (async) {
          gradsync::AsyncCheckpointer ckpt(t);
          ckpt.save(dir.path);
          ckpt.wait();
        } else {
          gradsync::save_checkpoint(t, dir.path);
        }
      });
    });
    check_every_rank(got, seconds, {"start of a checkpoint's save", "optimizer lr 0.25", "optimizer lr 0.5"});
    CHECK(!std::filesystem::exists(gradsync::checkpoint_file(dir.path)));
  }, 4);
}

TEST_CASE("a checkpoint's save where one rank's sampler differs fails every rank and commits nothing") {
  // The file records one sampler state, rank 0's: resumed, every rank would
  // read an order that one of them never had.
  each_trainer_with_odd_rank("sampler save agreement", [](int trainer, int n, int odd, auto& rng) {
    const bool async = rng() % 2 == 0;
    const int how = static_cast<int>(rng() % 3);
    const char* what[] = {"another seed", "no set_epoch(1)", "one batch more"};
    INFO("trainer " << trainer << ", N = " << n << ", rank " << odd << " has " << what[how] << " before the "
                    << std::string(async ? "asynchronous " : "") << "save");
    test::TempDir dir;
    const auto [got, seconds] = run(n, [&](Communicator<Threads>& comm) {
      const bool odd_rank = comm.rank() == odd;
      gradsync::DistributedSampler sampler(40, comm.size(), comm.rank(), {.seed = how == 0 && odd_rank ? 7u : 3u});
      if (how != 1 || !odd_rank) sampler.set_epoch(1);
      for (int b = 0; b < (how == 2 && odd_rank ? 2 : 1); ++b) sampler.advance(2);
      with_trainer(comm, trainer, 0.25, [&](auto& t) {
        t.step(Scale{1.0f});
        if (async) {
          gradsync::AsyncCheckpointer ckpt(t, sampler);
          ckpt.save(dir.path);
          ckpt.wait();
        } else {
          gradsync::save_checkpoint(t, sampler, dir.path);
        }
      });
    });
    check_every_rank(got, seconds, {"the ranks' DistributedSamplers differ", "nothing was saved"});
    CHECK(!std::filesystem::exists(gradsync::checkpoint_file(dir.path)));
  }, 4);
}

namespace {

/// Loads `path` into a fresh trainer `trainer` of with_trainer's: its first
/// held value before the load in before[rank], and where the load throws,
/// after it in after[rank] (its step count must still be 0).
void load_into_fresh(Communicator<Threads>& comm, int trainer, const std::filesystem::path& path,
                     std::vector<float>& before, std::vector<float>& after) {
  with_trainer(comm, trainer, 0.25, [&](auto& t) {
    const auto r = static_cast<std::size_t>(comm.rank());
    before[r] = first_held(t);
    try {
      gradsync::load_checkpoint(t, path);
    } catch (...) {
      after[r] = first_held(t);
      CHECK(t.step_count() == 0);
      throw;
    }
  });
}

/// On `n` ranks: `save(comm, ours, theirs)` writes two checkpoints, then
/// rank `odd` loads `theirs` into a fresh trainer `trainer` of
/// with_trainer's, the others `ours`. Every rank must throw InvalidArgument
/// naming each of `parts`, and none may have loaded anything.
template <class Save>
void check_odd_load_refused(int trainer, int n, int odd, Save save, const std::vector<std::string>& parts) {
  test::TempDir ours, theirs;
  std::vector<float> before(static_cast<std::size_t>(n)), after(before);
  const auto [got, seconds] = run(n, [&](Communicator<Threads>& comm) {
    save(comm, ours.path, theirs.path);
    load_into_fresh(comm, trainer, comm.rank() == odd ? theirs.path : ours.path, before, after);
  });
  check_every_rank(got, seconds, parts);
  CHECK(after == before);
}

}  // namespace

TEST_CASE("a checkpoint's save where only some ranks pass their sampler compares those, and saves") {
  // A rank may save without one (it evaluates, say): the file records rank
  // 0's, which the ranks that passed theirs agree on.
  each_trainer_with_odd_rank("sampler on some ranks", [](int trainer, int n, int odd, auto&) {
    INFO("trainer " << trainer << ", N = " << n << ", rank " << odd << " saves without its sampler");
    test::TempDir dir;
    const auto [got, seconds] = run(n, [&](Communicator<Threads>& comm) {
      gradsync::DistributedSampler sampler(40, comm.size(), comm.rank(), {.seed = 3});
      sampler.set_epoch(1);
      sampler.advance(2);
      with_trainer(comm, trainer, 0.25, [&](auto& t) {
        t.step(Scale{1.0f});
        if (comm.rank() == odd) {
          gradsync::save_checkpoint(t, dir.path);
        } else {
          gradsync::save_checkpoint(t, sampler, dir.path);
        }
      });
    });
    for (std::size_t r = 0; r < got.size(); ++r) {
      const Outcome& o = got[r];
      INFO("rank " << r << ": " << o.kind << ": " << o.what);
      CHECK(o.kind == "returned");
    }
    CHECK(std::filesystem::exists(gradsync::checkpoint_file(dir.path)));
  }, 4);
}

TEST_CASE("ranks that load different checkpoints fail every rank and load nothing") {
  // A stale copy on one node: the same run saved at two steps.
  each_trainer_with_odd_rank("load agreement", [](int trainer, int n, int odd, auto&) {
    INFO("trainer " << trainer << ", N = " << n << ", rank " << odd << " loads the checkpoint of step 2, the others "
                    << "that of step 1");
    auto save = [&](Communicator<Threads>& comm, const std::filesystem::path& early,
                    const std::filesystem::path& late) {
      with_trainer(comm, trainer, 0.25, [&](auto& t) {
        t.step(Scale{1.0f});
        gradsync::save_checkpoint(t, early);
        t.step(Scale{1.0f});
        gradsync::save_checkpoint(t, late);
      });
    };
    check_odd_load_refused(trainer, n, odd, save, {"the ranks read different training states", "step 1", "step 2"});
  }, 4);
}

TEST_CASE("ranks that load two runs' checkpoints of the same step and learning rate fail every rank") {
  // Alike in every scalar: only the tensors' contents tell the two saves apart.
  each_trainer_with_odd_rank("load fingerprint", [](int trainer, int n, int odd, auto&) {
    INFO("trainer " << trainer << ", N = " << n << ", rank " << odd << " loads the other run's checkpoint");
    auto save = [&](Communicator<Threads>& comm, const std::filesystem::path& one,
                    const std::filesystem::path& other) {
      with_trainer(comm, trainer, 0.25, [&](auto& t) {
        t.step(Scale{1.0f});
        gradsync::save_checkpoint(t, one);
      });
      with_trainer(comm, trainer, 0.25, [&](auto& t) {
        t.step(Scale{2.0f});
        gradsync::save_checkpoint(t, other);
      });
    };
    check_odd_load_refused(trainer, n, odd, save, {"the ranks read different training states", "step 1"});
  }, 4);
}

TEST_CASE("a rank that accumulates one micro-batch more than the others fails every rank at the step") {
  // Where no collective of the micro-steps tells the ranks apart
  // (ReplicatedTrainer, whose micro-steps only add locally; NoSync), each
  // would weigh its micro-batches by its own count; where they do (Sharded),
  // the extra micro-step's reductions match the peers' step's, and in the
  // last step the peers would return with its partial sum in their update.
  auto rng = test::rng_for("micro-batch count agreement");
  CAPTURE(test::test_seed());
  const std::pair<int, gradsync::AccumulationMode> configs[] = {
      {0, gradsync::AccumulationMode::Sharded},
      {int(ShardingStrategy::ShardGradOp), gradsync::AccumulationMode::NoSync},
      {int(ShardingStrategy::NoShard), gradsync::AccumulationMode::NoSync},
      {int(ShardingStrategy::NoShard), gradsync::AccumulationMode::Sharded},
      {int(ShardingStrategy::FullShard), gradsync::AccumulationMode::NoSync}};
  // Under OnNonfinite::ignore there is no agreement on finite values to
  // carry the count; it must be agreed all the same.
  for (std::size_t c = 0; c < 2 * std::size(configs); ++c) {
    const int n = 3 + static_cast<int>(rng() % 3);
    const int odd = static_cast<int>(rng() % static_cast<unsigned>(n));
    const int extra_at = 1 + static_cast<int>(rng() % 3);
    const bool replicated = c % std::size(configs) == 0;
    const auto policy = c < std::size(configs) ? gradsync::OnNonfinite::throw_error : gradsync::OnNonfinite::ignore;
    const auto& config = configs[c % std::size(configs)];
    INFO("config " << c << " (" << std::string(gradsync::name(policy)) << "), N = " << n << ", rank " << odd
                    << " accumulates once more before step " << extra_at << " of 3");
    const auto [got, seconds] = run(n, [&](Communicator<Threads>& comm) {
      auto train = [&](auto& t) {
        for (int s = 1; s <= 3; ++s) {
          t.accumulate(Scale{1.0f});
          if (s == extra_at && comm.rank() == odd) t.accumulate(Scale{1.0f});
          t.step(Scale{1.0f});
        }
      };
      const test_squares::Squares m{{10, 7, 3}, 1};
      if (replicated) {
        gradsync::ReplicatedTrainer t(comm, m, gradsync::Sgd<float>({.lr = 0.1}), {.on_nonfinite = policy});
        train(t);
      } else {
        ShardedTrainer t(comm, m, gradsync::Sgd<float>({.lr = 0.1}),
                         {.strategy = static_cast<ShardingStrategy>(config.first),
                          .accumulation = config.second,
                          .on_nonfinite = policy});
        train(t);
      }
    });
    check_every_rank(got, seconds, {"ranks disagree"});
    if (c % std::size(configs) < 3) check_every_rank(got, seconds, {"of 2 micro-batches", "of 3 micro-batches"});
  }
}

TEST_CASE("two trainers on one communicator, stepped in another order on one rank, fail every rank") {
  // Alike in every shape and setting, they differ only in their values: each
  // rank's first trainer is the others' first (rank 0's values broadcast), so a
  // rank that steps its second one first would mix one's data into the other's.
  each_trainer_with_odd_rank("trainer ordinal", [](int trainer, int n, int odd, auto&) {
    INFO("trainer " << trainer << ", N = " << n << ", rank " << odd << " steps the second trainer first");
    const auto [got, seconds] = run(n, [&](Communicator<Threads>& comm) {
      with_trainer(comm, trainer, 0.25, [&](auto& a) {
        with_trainer(comm, trainer, 0.25, [&](auto& b) {
          for (int s = 0; s < 2; ++s) {
            if (comm.rank() == odd) {
              b.step(Scale{1.0f});
              a.step(Scale{1.0f});
            } else {
              a.step(Scale{1.0f});
              b.step(Scale{1.0f});
            }
          }
        });
      });
    });
    check_every_rank(got, seconds, {"ranks disagree", "trainer 2 of its communicator, "});
  }, 4);
}

TEST_CASE("two GradSyncs on one communicator, finished in another order on one rank, fail every rank") {
  // Alike in units and options: each bucket of one matches the other's in
  // every field but the GradSync's number on the communicator.
  auto rng = test::rng_for("GradSync ordinal");
  CAPTURE(test::test_seed());
  for (int round = 0; round < 3; ++round) {
    const int n = 3 + static_cast<int>(rng() % 3);
    const int odd = static_cast<int>(rng() % static_cast<unsigned>(n));
    const bool overlap = rng() % 2 == 0;
    INFO("N = " << n << ", rank " << odd << " finishes the second GradSync first, overlap " << overlap);
    const auto [got, seconds] = run(n, [&](Communicator<Threads>& comm) {
      std::vector<float> fa(24, float(comm.rank())), fb(24, float(comm.rank() + 1));
      gradsync::GradSyncOptions o;
      o.overlap = overlap;
      gradsync::GradSync<Threads, float> a(comm, {std::span<float>(fa)}, o);
      gradsync::GradSync<Threads, float> b(comm, {std::span<float>(fb)}, o);
      auto sync = [](auto& s) {
        s.ready(0);
        s.finish();
      };
      if (comm.rank() == odd) {
        sync(b);
        sync(a);
      } else {
        sync(a);
        sync(b);
      }
    });
    check_every_rank(got, seconds, {"ranks disagree", "trainer 2 of its communicator, "});
  }
}

TEST_CASE("a label given in GradSync's collective options keeps each bucket's own: rates that differ still fail") {
  // The caller's label would otherwise stand in for the bucket's (sync
  // count, bucket, learning rate), and ranks stepping apart would match.
  auto rng = test::rng_for("GradSync caller label");
  CAPTURE(test::test_seed());
  for (const bool trainer : {false, true}) {
    const int n = 3 + static_cast<int>(rng() % 3);
    const int odd = static_cast<int>(rng() % static_cast<unsigned>(n));
    INFO((trainer ? "ReplicatedTrainer, on_nonfinite ignore" : "GradSync") << ", N = " << n << ", rank " << odd
                                                                           << " at another learning rate");
    const auto [got, seconds] = run(n, [&](Communicator<Threads>& comm) {
      const double lr = comm.rank() == odd ? 0.5 : 0.25;
      gradsync::GradSyncOptions o;
      o.collective.label = {.id = 7};
      if (trainer) {
        gradsync::ReplicatedTrainer t(comm, test_squares::Squares{{10, 7, 3}, 1}, gradsync::Sgd<float>({.lr = 0.25}),
                                      {.sync = o, .on_nonfinite = gradsync::OnNonfinite::ignore});
        t.step(Scale{1.0f});
        t.optimizer().set_lr(lr);
        t.step(Scale{1.0f});
      } else {
        std::vector<float> flat(24, float(comm.rank()));
        gradsync::GradSync<Threads, float> sync(comm, {std::span<float>(flat)}, o);
        sync.set_agreed_lr(lr);
        sync.ready(0);
        sync.finish();
      }
    });
    check_every_rank(got, seconds, {"ranks disagree", "optimizer lr 0.25", "optimizer lr 0.5"});
  }
}

TEST_CASE("ranks that agree train as before: labels and settings refuse nothing") {
  // The same model on every rank, with every option that is agreed, set alike.
  for (int n = 3; n <= 4; ++n) {
    gradsync::run_threads(n, [&](Communicator<Threads>& comm) {
      const test_squares::Squares m{{10, 7, 3}, 1};
      ShardedTrainer s(comm, m, gradsync::AdamW<float>({.lr = 0.01}),
                       {.strategy = ShardingStrategy::HybridShard, .shard_size = n == 4 ? 2 : 0});
      gradsync::ReplicatedTrainer r(comm, m, gradsync::Sgd<float>({.lr = 0.1, .momentum = 0.9}));
      for (int k = 0; k < 3; ++k) {
        s.optimizer().set_lr(0.01 / (k + 1));
        s.forward_backward(Scale{1.0f});
        s.clip_grad_norm(0.5);
        s.optimizer_step();
        r.forward_backward(Scale{1.0f});
        r.clip_grad_norm(0.5);
        r.optimizer_step();
      }
      CHECK(s.stats().steps == 3);
    });
  }
}

}  // namespace test_train_agreement
