// ShardedTrainer's offload: the master and gradient shards and
// the optimizer's state in a HostOffloadSpace, the shards reached only by
// copies. Offloaded runs equal the plain ones bitwise, the bytes copied, the
// space's allocations and the memory need equal their formulas,
// memory_budget covers the compute side only, and checkpoints save and load
// the offloaded state. Also: a memory_budget or an offload that differs
// between ranks throws on every rank.
#include <doctest/doctest.h>

#include <gradsync/core/host_offload_space.hpp>
#include <gradsync/gradsync.hpp>
#include <gradsync/train/checkpoint/sharded_checkpoint.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "support/common.hpp"
#include "support/refusals.hpp"
#include "support/sanitizers.hpp"
#include "test_train_checkpoint.hpp"
#include "test_train_sharded_schedule.hpp"
#include "test_train_squares.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_train_offload {

using gradsync::AccumulationMode;
using gradsync::Communicator;
using gradsync::HostOffloadSpace;
using gradsync::MemoryNeed;
using gradsync::ShardedTrainer;
using gradsync::ShardedTrainerOptions;
using gradsync::ShardingStrategy;
using gradsync::Threads;
using test_squares::joined;
using test_squares::Scale;
using test_squares::Squares;

namespace {

constexpr ShardingStrategy offloadable[] = {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp,
                                            ShardingStrategy::HybridShard};

/// HybridShard's groups: two where the world is even, else one.
int shard_size_for(int world) { return world % 2 == 0 ? world / 2 : world; }

/// Ranks a unit is sharded over.
std::size_t shards(ShardingStrategy s, int world) {
  return static_cast<std::size_t>(s == ShardingStrategy::HybridShard ? shard_size_for(world) : world);
}

std::size_t chunk(std::size_t p, std::size_t n) { return (p + n - 1) / n; }

/// body(world, sizes, strategy) for N = 1..4 and every offloadable strategy,
/// with random unit sizes per N (drawn from `salt`'s generator), all of it
/// captured for a failure's message.
template <class F>
void for_each_world_and_strategy(std::string_view salt, F body) {
  auto rng = test::rng_for(salt);
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    const std::vector<std::size_t> sizes = test_squares::random_sizes(rng, world, 60);
    INFO("seed = " << test::test_seed() << ", sizes = " << joined(sizes));
    for (const ShardingStrategy s : offloadable) {
      INFO("strategy = " << name(s));
      body(world, sizes, s);
    }
  }
}

/// What one rank ends with: its master shard, its gathered parameters.
struct Outcome {
  std::vector<float> shard, full;
};

template <class Opt>
std::vector<Outcome> train(const std::vector<std::vector<test_schedule::Batch<float>>>& batches, int world, Opt opt,
                           ShardedTrainerOptions o, bool offload) {
  std::vector<Outcome> out(static_cast<std::size_t>(world));
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    ShardedTrainerOptions mine = o;
    // One space per rank, as one per process (or GPU) would be.
    if (offload) mine.offload = std::make_shared<HostOffloadSpace>();
    ShardedTrainer trainer(comm, test_schedule::model_for(comm.rank()), opt, mine);
    const auto r = static_cast<std::size_t>(comm.rank());
    for (const auto& step : batches) trainer.step(step[r]);
    out[r].shard.assign(trainer.shard().begin(), trainer.shard().end());
    out[r].full = trainer.full_parameters();
  });
  return out;
}

template <class Opt>
void check_bitwise(const char* opt_name, Opt opt) {
  const std::uint64_t seed = test::test_seed();
  INFO("seed = " << seed << ", optimizer = " << std::string(opt_name));
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    const auto batches = test_schedule::random_batches(seed + static_cast<std::uint64_t>(world), 6, world, 3);
    for (const ShardingStrategy s : offloadable) {
      INFO("strategy = " << name(s));
      for (const bool prefetch : {false, true}) {
        CAPTURE(prefetch);
        ShardedTrainerOptions o;
        o.strategy = s;
        o.shard_size = shard_size_for(world);
        o.collective.deterministic = true;
        if (prefetch) {
          o.forward_prefetch = true;
          o.backward_prefetch = gradsync::BackwardPrefetch::BackwardPre;
        }
        const std::vector<Outcome> plain = train(batches, world, opt, o, false);
        const std::vector<Outcome> offloaded = train(batches, world, opt, o, true);
        for (std::size_t r = 0; r < plain.size(); ++r) {
          CAPTURE(r);
          CHECK(!plain[r].shard.empty());
          CHECK(test_schedule::bitwise_equal(offloaded[r].shard, plain[r].shard));
          CHECK(test_schedule::bitwise_equal(offloaded[r].full, plain[r].full));
        }
      }
    }
  }
}

}  // namespace

// Units of 25, 36, 7 and 1 elements (most not divisible by N = 2..4, one
// smaller than N), 6 steps, deterministic reductions.
TEST_CASE("offload: SGD with momentum trains bitwise as without offload, every sharded strategy, N = 1..4") {
  check_bitwise("Sgd", gradsync::Sgd<float>({.lr = 0.05, .momentum = 0.9}));
}

TEST_CASE("offload: Adam trains bitwise as without offload, every sharded strategy, N = 1..4") {
  check_bitwise("Adam", gradsync::Adam<float>({.lr = 0.01}));
}

// Per rank and step, c_u = ⌈P_u/n⌉ over the n ranks a unit is sharded over:
// every gather copies its chunk in, c_u elements, and every reduction copies
// the reduced chunk out. FullShard and HybridShard gather each unit twice
// but the last of forward (kept for backward) once: in 4·(2Σc_u − c_last),
// out 4·Σc_u. ShardGradOp gathers once: in and out 4·Σc_u. NoSync
// accumulation over K micro-steps reduces once and gathers K times, but
// ShardGradOp once (it keeps the gathered units until the synced step).
TEST_CASE("offload: bytes copied per step equal the formula, as reported and as the space counted them") {
  for_each_world_and_strategy("offload bytes", [](int world, const auto& sizes, ShardingStrategy s) {
    const std::size_t n = shards(s, world);
    std::size_t chunks = 0;
    for (const std::size_t p : sizes) chunks += chunk(p, n);
    const bool twice = s != ShardingStrategy::ShardGradOp;
    const std::size_t in_per_pass = 4 * (twice ? 2 * chunks - chunk(sizes.back(), n) : chunks);
    const std::size_t out_per_step = 4 * chunks;
    for (const std::size_t k : {std::size_t{1}, std::size_t{3}}) {
      CAPTURE(k);
      std::vector<std::size_t> in(static_cast<std::size_t>(world)), out(in), counted_in(in), counted_out(in);
      gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
        const auto space = std::make_shared<HostOffloadSpace>();
        ShardedTrainerOptions o{.strategy = s, .shard_size = shard_size_for(world)};
        o.accumulation = AccumulationMode::NoSync;
        o.offload = space;
        ShardedTrainer trainer(comm, Squares{sizes, 5}, gradsync::Adam<float>(), o);
        trainer.step(Scale{2.0f});
        const std::size_t in0 = space->copied_in(), out0 = space->copied_out();
        for (std::size_t i = 1; i < k; ++i) trainer.accumulate(Scale{1.0f + static_cast<float>(i)});
        trainer.step(Scale{1.0f + static_cast<float>(comm.rank())});
        const auto r = static_cast<std::size_t>(comm.rank());
        in[r] = trainer.last_step().offload_in_bytes;
        out[r] = trainer.last_step().offload_out_bytes;
        counted_in[r] = space->copied_in() - in0;
        counted_out[r] = space->copied_out() - out0;
      });
      for (int r = 0; r < world; ++r) {
        CAPTURE(r);
        const auto i = static_cast<std::size_t>(r);
        CHECK(in[i] == (twice ? k : 1) * in_per_pass);
        CHECK(out[i] == out_per_step);
        CHECK(counted_in[i] == in[i]);
        CHECK(counted_out[i] == out[i]);
      }
    }
  });
}

// With c_u = ⌈P_u/n⌉, e = 4 bytes, S optimizer elements per parameter:
// offloaded (2 + S)·e·Σc_u; on the compute side nothing persistent, the
// gathered units as without offload, and gradient buffers of (n + 1)·c_u
// (FullShard one, ShardGradOp two). The space itself holds the two shards
// and Adam's two moments, none of them in the optimizer's own vectors.
TEST_CASE("offload: memory_need equals its formula, the peak reaches it, the space holds the shards") {
  for_each_world_and_strategy("offload memory", [](int world, const auto& sizes, ShardingStrategy s) {
    const std::size_t n = shards(s, world);
    std::size_t chunks = 0, c_max = 0;
    for (const std::size_t p : sizes) {
      chunks += chunk(p, n);
      c_max = std::max(c_max, chunk(p, n));
    }
    const bool gsop = s == ShardingStrategy::ShardGradOp;
    const std::size_t gathered = 4 * (gsop ? n * chunks : n * c_max);
    const std::size_t buffers = 4 * (gsop ? 2 : 1) * (n + 1) * c_max;
    std::vector<MemoryNeed> need(static_cast<std::size_t>(world));
    std::vector<std::size_t> peak(need.size()), persistent(need.size()), held(need.size()), state(need.size());
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      const auto space = std::make_shared<HostOffloadSpace>();
      ShardedTrainerOptions o{.strategy = s, .shard_size = shard_size_for(world)};
      o.offload = space;
      ShardedTrainer trainer(comm, Squares{sizes, 7}, gradsync::Adam<float>(), o);
      trainer.step(Scale{1.0f});
      const auto r = static_cast<std::size_t>(comm.rank());
      need[r] = trainer.memory_need();
      peak[r] = trainer.peak_transient_bytes();
      persistent[r] = trainer.persistent_bytes();
      held[r] = space->allocated();
      state[r] = trainer.optimizer().state_elements();
  });
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    const auto i = static_cast<std::size_t>(r);
    CHECK(need[i].persistent() == 0);
    CHECK(persistent[i] == 0);
    CHECK(need[i].offloaded == (2 + 2) * 4 * chunks);
    CHECK(need[i].gathered == gathered);
    CHECK(need[i].gradient_buffers == buffers);
    CHECK(need[i].total() == gathered + buffers);
    CHECK(held[i] == (2 + 2) * 4 * chunks);
    CHECK(held[i] == need[i].offloaded);
    CHECK(state[i] == 0);
    CHECK(peak[i] <= need[i].transient());
    // FullShard's bound is reached: the largest unit gathered for backward beside its buffer.
    if (!gsop) CHECK(peak[i] == need[i].transient());
  }
  });
}

TEST_CASE("offload: a budget that fits only the compute side is refused without offload and trains with it") {
  for_each_world_and_strategy("offload budget", [](int world, const auto& sizes, ShardingStrategy s) {
    std::vector<std::string> refused(static_cast<std::size_t>(world));
    std::vector<int> trained(refused.size(), 0);
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      ShardedTrainerOptions o{.strategy = s, .shard_size = shard_size_for(world)};
      o.offload = std::make_shared<HostOffloadSpace>();
      const std::size_t budget =
          ShardedTrainer(comm, Squares{sizes, 3}, gradsync::Adam<float>(), o).memory_need().total();
      o.memory_budget = budget;
      const auto r = static_cast<std::size_t>(comm.rank());
      ShardedTrainer fits(comm, Squares{sizes, 3}, gradsync::Adam<float>(), o);
      fits.step(Scale{1.0f});
      trained[r] = fits.persistent_bytes() + fits.peak_transient_bytes() <= budget ? 1 : 0;
      o.offload = nullptr;
      try {
        ShardedTrainer plain(comm, Squares{sizes, 3}, gradsync::Adam<float>(), o);
      } catch (const gradsync::InvalidArgument& e) {
        refused[r] = e.what();
      }
  });
  for (std::size_t r = 0; r < refused.size(); ++r) {
    CAPTURE(r);
    INFO(refused[r]);
    CHECK(trained[r] == 1);
    CHECK(refused[r].find("over the memory_budget") != std::string::npos);
  }
  });
}

TEST_CASE("offload: with bfloat16 gathers and reductions too, bitwise as without offload") {
  const std::uint64_t seed = test::test_seed();
  INFO("seed = " << seed);
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    const auto batches = test_schedule::random_batches(seed + 17 + static_cast<std::uint64_t>(world), 4, world, 3);
    for (const ShardingStrategy s : offloadable) {
      INFO("strategy = " << name(s));
      ShardedTrainerOptions o;
      o.strategy = s;
      o.shard_size = shard_size_for(world);
      o.collective.deterministic = true;
      o.param_dtype = gradsync::DataType::bfloat16;
      o.reduce_dtype = gradsync::DataType::bfloat16;
      const auto adam = gradsync::Adam<float>({.lr = 0.01});
      const std::vector<Outcome> plain = train(batches, world, adam, o, false);
      const std::vector<Outcome> offloaded = train(batches, world, adam, o, true);
      for (std::size_t r = 0; r < plain.size(); ++r) {
        CAPTURE(r);
        CHECK(test_schedule::bitwise_equal(offloaded[r].shard, plain[r].shard));
      }
    }
  }
}

namespace {

/// An offload space that notes which thread each copy ran on.
class ThreadNotingSpace final : public gradsync::OffloadSpace {
 public:
  const char* name() const noexcept override { return "thread-noting"; }
  void* allocate(std::size_t bytes) override { return inner_.allocate(bytes); }
  void deallocate(void* p, std::size_t bytes) noexcept override { inner_.deallocate(p, bytes); }
  void copy_in(void* compute, const void* offloaded, std::size_t bytes) override {
    note();
    inner_.copy_in(compute, offloaded, bytes);
  }
  void copy_out(void* offloaded, const void* compute, std::size_t bytes) override {
    note();
    inner_.copy_out(offloaded, compute, bytes);
  }
  void wait() override {}
  std::vector<std::thread::id> threads() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return threads_;
  }

 private:
  void note() {
    const std::lock_guard<std::mutex> lock(mutex_);
    threads_.push_back(std::this_thread::get_id());
  }
  HostOffloadSpace inner_;
  mutable std::mutex mutex_;
  std::vector<std::thread::id> threads_;
};

}  // namespace

// The copies are part of the worker's gather and reduction jobs, which is
// what lets them overlap the rank's compute (prefetch: the next unit's).
TEST_CASE("offload: every copy of a step runs on the progress worker, not on the rank's thread") {
  auto rng = test::rng_for("offload threads");
  for (int world = 1; world <= 3; ++world) {
    CAPTURE(world);
    const std::vector<std::size_t> sizes = test_squares::random_sizes(rng, world, 60);
    INFO("seed = " << test::test_seed() << ", sizes = " << joined(sizes));
    std::vector<std::size_t> copies(static_cast<std::size_t>(world)), on_rank_thread(copies);
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      const auto space = std::make_shared<ThreadNotingSpace>();
      ShardedTrainerOptions o;
      o.offload = space;
      o.forward_prefetch = true;
      o.backward_prefetch = gradsync::BackwardPrefetch::BackwardPre;
      ShardedTrainer trainer(comm, Squares{sizes, 2}, gradsync::Sgd<float>(), o);
      trainer.step(Scale{1.0f});
      trainer.step(Scale{2.0f});
      const auto r = static_cast<std::size_t>(comm.rank());
      const std::vector<std::thread::id> threads = space->threads();
      copies[r] = threads.size();
      on_rank_thread[r] = static_cast<std::size_t>(std::ranges::count(threads, std::this_thread::get_id()));
    });
    for (std::size_t r = 0; r < copies.size(); ++r) {
      CAPTURE(r);
      // Two steps of 2·5 − 1 gathers and 5 reductions.
      CHECK(copies[r] == 2 * (2 * sizes.size() - 1 + sizes.size()));
      CHECK(on_rank_thread[r] == 0);
    }
  }
}

TEST_CASE("offload: refused with NoShard at construction, and for sharded accumulation, on every rank") {
  const std::vector<std::size_t> sizes{5, 9};
  for (int world = 1; world <= 3; ++world) {
    CAPTURE(world);
    std::vector<std::string> no_shard(static_cast<std::size_t>(world)), accumulate(no_shard);
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      ShardedTrainerOptions o{.strategy = ShardingStrategy::NoShard};
      o.offload = std::make_shared<HostOffloadSpace>();
      try {
        ShardedTrainer trainer(comm, Squares{sizes, 1}, gradsync::Sgd<float>(), o);
      } catch (const gradsync::InvalidArgument& e) {
        no_shard[r] = e.what();
      }
      o.strategy = ShardingStrategy::FullShard;
      ShardedTrainer trainer(comm, Squares{sizes, 1}, gradsync::Sgd<float>(), o);
      try {
        trainer.accumulate(Scale{1.0f});
      } catch (const gradsync::InvalidArgument& e) {
        accumulate[r] = e.what();
      }
      // Still usable: the refusal came before any communication.
      trainer.step(Scale{1.0f});
    });
    for (std::size_t r = 0; r < no_shard.size(); ++r) {
      CAPTURE(r);
      CHECK(no_shard[r].find("offload needs a sharded strategy") != std::string::npos);
      CHECK(accumulate[r].find("needs AccumulationMode::NoSync") != std::string::npos);
    }
  }
}

namespace {

/// Squares' two unit sizes in [1, 1000], then for each world of 2 to 4 ranks
/// an odd rank, drawn from the test seed's stream `seed_name` (the seed and
/// sizes printed on failure): `body(sizes, world, odd, rng)`.
template <class Body>
void at_worlds_with_odd_rank(const char* seed_name, Body body) {
  auto rng = test::rng_for(seed_name);
  std::uniform_int_distribution<std::size_t> d(1, 1000);
  const std::vector<std::size_t> sizes{d(rng), d(rng)};
  INFO("seed = " << test::test_seed() << ", sizes = " << joined(sizes));
  for (int world = 2; world <= 4; ++world) {
    CAPTURE(world);
    const int odd = std::uniform_int_distribution<int>(0, world - 1)(rng);
    CAPTURE(odd);
    body(sizes, world, odd, rng);
  }
}

}  // namespace

TEST_CASE("memory_budget: a rank given a different budget makes every rank throw the same error") {
  at_worlds_with_odd_rank("budget agreement", [](const std::vector<std::size_t>& sizes, int world, int odd, auto& rng) {
    // Both budgets fit, so only the disagreement can refuse.
    const std::size_t budget = std::size_t{1} << 30;
    const std::size_t other = budget + 1 + std::uniform_int_distribution<std::size_t>(1, 1000)(rng);
    for (const bool replicated : {false, true}) {
      CAPTURE(replicated);
      const std::vector<std::string> what = test::refusals_on_threads(world, [&](Communicator<Threads>& comm) {
        const std::size_t mine = comm.rank() == odd ? other : budget;
        if (replicated) {
          gradsync::ReplicatedTrainerOptions o;
          o.memory_budget = mine;
          gradsync::ReplicatedTrainer trainer(comm, Squares{sizes, 1}, gradsync::Sgd<float>(), o);
        } else {
          ShardedTrainer trainer(comm, Squares{sizes, 1}, gradsync::Sgd<float>(), {.memory_budget = mine});
        }
      });
      INFO(what[0]);
      CHECK(what[0].find("different ") != std::string::npos);
      CHECK(what[0].find("memory_budget") != std::string::npos);
      CHECK(what[0].find(std::to_string(other) + " on world rank " + std::to_string(odd)) != std::string::npos);
      for (const std::string& w : what) CHECK(w == what[0]);
    }
  });
}

TEST_CASE("offload: ranks that differ in whether they offload all throw the same error, before any step") {
  at_worlds_with_odd_rank("offload agreement", [](const std::vector<std::size_t>& sizes, int world, int odd, auto&) {
    for (const bool odd_offloads : {false, true}) {
      CAPTURE(odd_offloads);
      for (const bool budget_too : {false, true}) {
        CAPTURE(budget_too);
        const std::vector<std::string> what = test::refusals_on_threads(world, [&](Communicator<Threads>& comm) {
          ShardedTrainerOptions o{.strategy = ShardingStrategy::FullShard};
          if ((comm.rank() == odd) == odd_offloads) o.offload = std::make_shared<HostOffloadSpace>();
          // Budgets that fit either way, so that only the disagreement refuses.
          if (budget_too) o.memory_budget = (std::size_t{1} << 30) + (comm.rank() == odd ? 7 : 0);
          ShardedTrainer trainer(comm, Squares{sizes, 1}, gradsync::Adam<float>(), o);
        });
        INFO(what[0]);
        CHECK(what[0].find("different settings: ") != std::string::npos);
        CHECK(what[0].find(std::string("ShardedTrainerOptions::offload: ")) != std::string::npos);
        CHECK(what[0].find((odd_offloads ? "a space on world rank " : "none on world rank ") + std::to_string(odd)) !=
              std::string::npos);
        CHECK(what[0].find("Give every rank an offload space, or none") != std::string::npos);
        CHECK((what[0].find("memory_budget") != std::string::npos) == budget_too);
        for (const std::string& w : what) CHECK(w == what[0]);
      }
    }
  });
}

namespace {

/// A HostOffloadSpace that also knows where its live allocations lie.
class RecordingSpace final : public gradsync::OffloadSpace {
 public:
  const char* name() const noexcept override { return "recording"; }
  void* allocate(std::size_t bytes) override {
    void* p = inner_.allocate(bytes);
    const std::lock_guard<std::mutex> lock(mutex_);
    live_[p] = bytes;
    ++allocations_;
    return p;
  }
  void deallocate(void* p, std::size_t bytes) noexcept override {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      live_.erase(p);
    }
    inner_.deallocate(p, bytes);
  }
  void copy_in(void* compute, const void* offloaded, std::size_t bytes) override {
    inner_.copy_in(compute, offloaded, bytes);
  }
  void copy_out(void* offloaded, const void* compute, std::size_t bytes) override {
    inner_.copy_out(offloaded, compute, bytes);
  }
  void wait() override {}

  std::size_t allocated() const noexcept { return inner_.allocated(); }
  std::size_t allocations() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return allocations_;
  }
  /// `s` is non-empty and lies inside one live allocation of this space.
  bool holds(std::span<const float> s) const {
    if (s.empty()) return false;
    const std::lock_guard<std::mutex> lock(mutex_);
    const std::less<> before;
    const auto* first = reinterpret_cast<const std::byte*>(s.data());
    const std::byte* last = first + s.size_bytes();
    for (const auto& [p, bytes] : live_) {
      const auto* at = static_cast<const std::byte*>(p);
      if (!before(first, at) && !before(at + bytes, last)) return true;
    }
    return false;
  }

 private:
  HostOffloadSpace inner_;
  mutable std::mutex mutex_;
  std::map<void*, std::size_t> live_;
  std::size_t allocations_ = 0;
};

/// What one rank saw of where its optimizer's state lives.
struct StatePlace {
  std::size_t at_start = 0, after_steps = 0, allocations = 0, left = 0;
  MemoryNeed need;
  std::size_t persistent = 0, own = 0, buffers = 0, in_space = 0, buffer_size_ok = 0;
  std::size_t plain_own = 0, plain_persistent = 0;
};

/// With S = `slots` state elements per parameter: the space holds
/// (2 + S)·4·Σc_u from construction to the trainer's end, the optimizer's
/// S buffers of Σc_u elements lie inside it, and its own vectors hold
/// nothing; the same optimizer without offload keeps S·Σc_u in them.
template <class Opt>
void check_state_in_space(const char* opt_name, Opt opt, std::size_t slots) {
  INFO("optimizer = " << std::string(opt_name));
  for_each_world_and_strategy(std::string("offload state ") + opt_name,
                              [&](int world, const auto& sizes, ShardingStrategy s) {
    const std::size_t n = shards(s, world);
    std::size_t chunks = 0;
    for (const std::size_t p : sizes) chunks += chunk(p, n);
    std::vector<StatePlace> seen(static_cast<std::size_t>(world));
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      StatePlace& me = seen[static_cast<std::size_t>(comm.rank())];
      const auto space = std::make_shared<RecordingSpace>();
      ShardedTrainerOptions o{.strategy = s, .shard_size = shard_size_for(world)};
      o.offload = space;
      {
        ShardedTrainer trainer(comm, Squares{sizes, 4}, opt, o);
        me.at_start = space->allocated();
        trainer.step(Scale{1.0f + static_cast<float>(comm.rank())});
        trainer.step(Scale{2.0f});
        me.after_steps = space->allocated();
        me.allocations = space->allocations();
        me.need = trainer.memory_need();
        me.persistent = trainer.persistent_bytes();
        me.own = trainer.optimizer().state_elements();
        const auto state = trainer.optimizer().state();
        me.buffers = state.buffers.size();
        for (const auto& b : state.buffers) {
          me.in_space += space->holds(b.second) ? 1 : 0;
          me.buffer_size_ok += b.second.size() == chunks ? 1 : 0;
        }
      }
      me.left = space->allocated();
      o.offload = nullptr;
      ShardedTrainer plain(comm, Squares{sizes, 4}, opt, o);
      plain.step(Scale{1.0f});
      me.plain_own = plain.optimizer().state_elements();
      me.plain_persistent = plain.persistent_bytes();
    });
    const std::size_t offloaded = (2 + slots) * 4 * chunks;
    for (std::size_t r = 0; r < seen.size(); ++r) {
      CAPTURE(r);
      const StatePlace& me = seen[r];
      CHECK(me.at_start == offloaded);
      CHECK(me.after_steps == offloaded);
      CHECK(me.allocations == 2 + (slots == 0 ? 0 : 1));
      CHECK(me.need.offloaded == offloaded);
      CHECK(me.need.optimizer_state == 0);
      CHECK(me.need.persistent() == 0);
      CHECK(me.persistent == 0);
      CHECK(me.own == 0);
      CHECK(me.buffers == slots);
      CHECK(me.in_space == slots);
      CHECK(me.buffer_size_ok == slots);
      CHECK(me.left == 0);
      CHECK(me.plain_own == slots * chunks);
      CHECK(me.plain_persistent == offloaded);
    }
  });
}

}  // namespace

// S = 0 (SGD), 1 (momentum), 2 (Adam, AdamW): what the space allocated,
// memory_need, where state() points, what the optimizer itself holds.
TEST_CASE("offload: the optimizer's state is allocated from the space, S·4·Σc bytes, lives there, goes with the trainer") {
  check_state_in_space("Sgd", gradsync::Sgd<float>({.lr = 0.05}), 0);
  check_state_in_space("Sgd momentum", gradsync::Sgd<float>({.lr = 0.05, .momentum = 0.9}), 1);
  check_state_in_space("Adam", gradsync::Adam<float>({.lr = 0.01}), 2);
  check_state_in_space("AdamW", gradsync::AdamW<float>({.lr = 0.01}), 2);
}

namespace {

/// One rank's training state, padding included.
struct Resumed {
  std::vector<float> shard;
  std::vector<std::vector<float>> opt;
  std::uint64_t opt_steps = 0;
  std::size_t trainer_steps = 0;
  /// Offloaded after the load: optimizer buffers inside the space, elements in its own vectors.
  std::size_t in_space = 0, own = 0;
};

Scale batch_of(int step, int rank) { return Scale{1.0f + 0.25f * static_cast<float>(step) + 0.125f * static_cast<float>(rank)}; }

template <class Trainer>
void read_state(Trainer& t, Resumed& r) {
  const auto shard = std::as_const(t).shard();
  r.shard.assign(shard.begin(), shard.end());
  const auto st = t.optimizer().state();
  r.opt.clear();
  for (const auto& b : st.buffers) r.opt.emplace_back(b.second.begin(), b.second.end());
  r.opt_steps = st.steps;
  r.trainer_steps = t.step_count();
}

}  // namespace

// 3 steps, save (full or sharded), a fresh trainer with other values loads,
// 3 more: bitwise where 6 straight steps end, offloaded on either side or
// both; loaded into an offloaded trainer, the state is still in its space.
TEST_CASE("offload: save and resume into and out of an offloaded trainer, bitwise, the state staying in the space") {
  using gradsync::CheckpointFormat;
  // Under a sanitizer, each (world, strategy) cell runs one of the six
  // (format, offloaded side) pairs, in turn, so that each pair still runs
  // twice over the twelve cells; the plain build runs all six in each.
  std::size_t cell = 0;
  for_each_world_and_strategy("offload checkpoint", [&cell](int world, const auto& sizes, ShardingStrategy s) {
    const std::size_t this_cell = cell++;
    auto check = [&](const char* opt_name, auto opt) {
      INFO("optimizer = " << std::string(opt_name));
      std::size_t pair = 0;
      for (const CheckpointFormat format : {CheckpointFormat::full, CheckpointFormat::sharded}) {
        CAPTURE(format == CheckpointFormat::full);
        for (const auto& which : {std::pair{true, true}, {false, true}, {true, false}}) {
          if (test::sanitized && pair++ % 6 != this_cell % 6) continue;
          // Named, not a structured binding: lambdas below capture them (Clang 14).
          const bool save_offloaded = which.first, load_offloaded = which.second;
          CAPTURE(save_offloaded);
          CAPTURE(load_offloaded);
          test_checkpoint::TempDir dir;
          const auto rank_count = static_cast<std::size_t>(world);
          std::vector<Resumed> straight(rank_count), resumed(rank_count);
          auto options = [&](bool offload) {
            ShardedTrainerOptions o{.strategy = s, .shard_size = shard_size_for(world)};
            o.collective.deterministic = true;
            if (offload) o.offload = std::make_shared<RecordingSpace>();
            return o;
          };
          gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
            ShardedTrainer t(comm, Squares{sizes, 4}, opt, options(load_offloaded));
            for (int k = 0; k < 6; ++k) t.step(batch_of(k, comm.rank()));
            read_state(t, straight[static_cast<std::size_t>(comm.rank())]);
          });
          gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
            ShardedTrainer t(comm, Squares{sizes, 4}, opt, options(save_offloaded));
            for (int k = 0; k < 3; ++k) t.step(batch_of(k, comm.rank()));
            gradsync::save_checkpoint(t, dir.path, {}, {.format = format});
          });
          gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
            const ShardedTrainerOptions o = options(load_offloaded);
            ShardedTrainer t(comm, Squares{sizes, 99}, opt, o);
            gradsync::load_checkpoint(t, dir.path);
            Resumed& me = resumed[static_cast<std::size_t>(comm.rank())];
            if (load_offloaded) {
              const auto& space = static_cast<const RecordingSpace&>(*o.offload);
              for (const auto& b : t.optimizer().state().buffers) me.in_space += space.holds(b.second) ? 1 : 0;
              me.own = t.optimizer().state_elements();
            }
            for (int k = 3; k < 6; ++k) t.step(batch_of(k, comm.rank()));
            read_state(t, me);
          });
          for (std::size_t r = 0; r < rank_count; ++r) {
            CAPTURE(r);
            CHECK(test_schedule::bitwise_equal(resumed[r].shard, straight[r].shard));
            REQUIRE(resumed[r].opt.size() == straight[r].opt.size());
            for (std::size_t k = 0; k < straight[r].opt.size(); ++k) {
              CHECK(test_schedule::bitwise_equal(resumed[r].opt[k], straight[r].opt[k]));
            }
            CHECK(resumed[r].opt_steps == 6);
            CHECK(resumed[r].trainer_steps == 6);
            CHECK(resumed[r].in_space == (load_offloaded ? straight[r].opt.size() : 0));
            CHECK(resumed[r].own == 0);
          }
        }
      }
    };
    check("Sgd momentum", gradsync::Sgd<float>({.lr = 0.05, .momentum = 0.9}));
    check("Adam", gradsync::Adam<float>({.lr = 0.01}));
  });
}

}  // namespace test_train_offload
