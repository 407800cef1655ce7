// Checkpoints of the training state: optimizer and sampler state,
// ReplicatedTrainer's save/load, exact resume, bad files.
#include <doctest/doctest.h>

#include <gradsync/checkpoint/safetensors_reader.hpp>
#include <gradsync/gradsync.hpp>
#include <gradsync/train/checkpoint/replicated_checkpoint.hpp>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "support/common.hpp"
#include "test_train_checkpoint.hpp"
#include "test_train_model.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_train_checkpoint {

using namespace test_checkpoint::names;

namespace {

constexpr std::size_t in = 5, out = 3;
const std::vector<std::size_t> layers{in, 7, 6, out};

/// Deterministic reductions: a resumed run can then be held to the bits.
ReplicatedTrainerOptions exact() {
  ReplicatedTrainerOptions o;
  o.sync.collective.deterministic = true;
  o.sync.first_bucket_cap_bytes = 64;
  o.sync.bucket_cap_bytes = 256;
  return o;
}

Batch<float> batch_of(std::span<const std::size_t> idx) { return test_checkpoint::batch_of(idx, in, out); }

template <class Trainer>
void train_steps(Trainer& trainer, DistributedSampler& sampler, int steps, std::size_t b,
                 std::vector<std::size_t>* seen = nullptr) {
  test_checkpoint::train_steps(trainer, sampler, steps, b, in, out, seen);
}

// Before Snapshot: its defaulted == looks this up where it is declared.
bool operator==(const gradsync::SamplerState& a, const gradsync::SamplerState& b) {
  return a.seed == b.seed && a.epoch == b.epoch && a.consumed == b.consumed && a.length == b.length &&
         a.shuffle == b.shuffle && a.drop_last == b.drop_last;
}

/// Everything a resumed run must reproduce, from one rank.
struct Snapshot {
  std::vector<float> params, buffers;
  std::vector<std::vector<float>> opt_buffers;
  std::vector<double> hyper;
  std::uint64_t opt_steps = 0;
  std::size_t trainer_steps = 0;
  gradsync::SamplerState sampler;
  bool operator==(const Snapshot&) const = default;
};

template <class Trainer>
Snapshot snapshot(Trainer& trainer, const DistributedSampler& sampler) {
  Snapshot s;
  s.params.assign(trainer.parameters().begin(), trainer.parameters().end());
  s.buffers.assign(trainer.buffers().begin(), trainer.buffers().end());
  const auto st = trainer.optimizer().state();
  for (const auto& [name, data] : st.buffers) s.opt_buffers.emplace_back(data.begin(), data.end());
  for (const auto& [name, value] : st.hyperparameters) s.hyper.push_back(value);
  s.opt_steps = st.steps;
  s.trainer_steps = trainer.step_count();
  s.sampler = sampler.state();
  return s;
}

/// The samples of the sampler's dataset: 37 is divisible by none of 2..4.
constexpr std::size_t dataset = 37;
constexpr std::size_t batch = 3;

/// A ReplicatedTrainer of `model` (exact()) and a sampler of seed `seed`
/// over the dataset, after `steps` steps of `batch` samples a rank:
/// `then(trainer, sampler)`.
template <class Opt, class Then>
void after_steps(Communicator<Threads>& comm, const Mlp<float>& model, Opt opt, std::uint64_t seed, int steps,
                 Then then) {
  ReplicatedTrainer trainer(comm, model, std::move(opt), exact());
  DistributedSampler sampler(dataset, comm.size(), comm.rank(), {.seed = seed});
  train_steps(trainer, sampler, steps, batch);
  then(trainer, sampler);
}

template <class Opt>
void check_resume(int world, Opt make_opt(double), const char* what) {
  CAPTURE(world);
  CAPTURE(what);
  TempDir dir;
  std::vector<Snapshot> straight(static_cast<std::size_t>(world)), resumed(straight.size());
  // The run that does not stop, and one that stops after 10 steps.
  auto from_the_start = [&](Communicator<Threads>& comm, int steps, auto then) {
    after_steps(comm, Mlp<float>{layers, 7 + std::uint64_t(comm.rank())}, make_opt(0.05), 11, steps, then);
  };
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    from_the_start(comm, 20, [&](auto& trainer, const DistributedSampler& sampler) {
      straight[std::size_t(comm.rank())] = snapshot(trainer, sampler);
    });
  });
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    from_the_start(comm, 10, [&](auto& trainer, const DistributedSampler& sampler) {
      gradsync::save_checkpoint(trainer, sampler, dir.path, {{"schedule.warmup", "done"}});
    });
  });
  // Fresh communicator, trainer, model (other initial values), optimizer
  // (other learning rate) and sampler (other seed and epoch): the load must
  // overwrite every piece of them.
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    ReplicatedTrainer trainer(comm, Mlp<float>{layers, 1000 + std::uint64_t(comm.rank())}, make_opt(0.5), exact());
    DistributedSampler sampler(dataset, comm.size(), comm.rank(), {.seed = 99});
    sampler.set_epoch(5);
    const auto meta = gradsync::load_checkpoint(trainer, sampler, dir.path);
    CHECK(meta == gradsync::checkpoint::Metadata{{"schedule.warmup", "done"}});
    CHECK(trainer.step_count() == 10);
    train_steps(trainer, sampler, 10, batch);
    resumed[std::size_t(comm.rank())] = snapshot(trainer, sampler);
  });
  for (std::size_t r = 0; r < straight.size(); ++r) {
    CAPTURE(r);
    CHECK(resumed[r].params == straight[r].params);
    CHECK(resumed[r].buffers == straight[r].buffers);
    CHECK(resumed[r].opt_buffers == straight[r].opt_buffers);
    CHECK(resumed[r].hyper == straight[r].hyper);
    CHECK(resumed[r].opt_steps == straight[r].opt_steps);
    CHECK(resumed[r].trainer_steps == 20);
    CHECK(resumed[r] == straight[r]);
  }
}

}  // namespace

TEST_CASE("optimizer state: state() and load_state() carry Sgd, Adam and AdamW on exactly") {
  auto rng = test::rng_for("optimizer state");
  CAPTURE(test::test_seed());
  std::normal_distribution<float> normal;
  const std::size_t n = 1 + rng() % 50;
  CAPTURE(n);
  auto draw = [&] {
    std::vector<float> v(n);
    for (float& x : v) x = normal(rng);
    return v;
  };
  const std::vector<float> p0 = draw();
  std::vector<std::vector<float>> grads;
  for (int s = 0; s < 6; ++s) grads.push_back(draw());
  auto run = [&]<class Opt>(Opt a, Opt fresh) {
    std::vector<float> pa = p0;
    for (int s = 0; s < 3; ++s) a.step(std::span<float>(pa), std::span<const float>(grads[std::size_t(s)]));
    const auto st = a.state();
    gradsync::OptimizerState<float> copy{st.steps, {}, {}};
    for (const auto& h : st.hyperparameters) copy.hyperparameters.push_back(h.second);
    for (const auto& b : st.buffers) copy.buffers.emplace_back(b.second.begin(), b.second.end());
    fresh.load_state(std::move(copy));
    CHECK(fresh.lr() == a.lr());
    std::vector<float> pb = pa;
    for (int s = 3; s < 6; ++s) {
      a.step(std::span<float>(pa), std::span<const float>(grads[std::size_t(s)]));
      fresh.step(std::span<float>(pb), std::span<const float>(grads[std::size_t(s)]));
    }
    CHECK(pa == pb);
  };
  run(gradsync::Sgd<float>({.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true}),
      gradsync::Sgd<float>({.lr = 3, .momentum = 0.5}));
  run(gradsync::Sgd<float>({.lr = 0.1, .momentum = 0.9, .dampening = 0.1}),
      gradsync::Sgd<float>({.lr = 3, .momentum = 0.5}));
  run(gradsync::Sgd<float>({.lr = 0.1}), gradsync::Sgd<float>({.lr = 3}));
  run(gradsync::Adam<float>({.lr = 0.01, .beta1 = 0.8, .weight_decay = 0.1}), gradsync::Adam<float>({.lr = 1}));
  run(gradsync::AdamW<float>({.lr = 0.01, .beta2 = 0.99}), gradsync::AdamW<float>());

  SUBCASE("names are PyTorch's") {
    const auto s = gradsync::Adam<float>().state();
    REQUIRE(s.buffers.size() == 2);
    CHECK(s.buffers[0].first == "exp_avg");
    CHECK(s.buffers[1].first == "exp_avg_sq");
    CHECK(s.kind == "Adam");
    CHECK(gradsync::AdamW<float>().state().kind == "AdamW");
    const auto m = gradsync::Sgd<float>({.momentum = 0.9}).state();
    REQUIRE(m.buffers.size() == 1);
    CHECK(m.buffers[0].first == "momentum_buffer");
    CHECK(gradsync::Sgd<float>().state().buffers.empty());
  }
  SUBCASE("a state that does not fit is refused and changes nothing") {
    gradsync::Adam<float> a({.lr = 0.25});
    CHECK_THROWS_AS(a.load_state({1, {0.1, 0.9, 0.99, 1e-8}, {{}, {}}}), gradsync::InvalidArgument);
    CHECK_THROWS_AS(a.load_state({1, {0.1, 0.9, 0.99, 1e-8, 0}, {std::vector<float>(3), std::vector<float>(4)}}),
                    gradsync::InvalidArgument);
    CHECK(a.lr() == 0.25);
    gradsync::Sgd<float> s({.lr = 0.25, .momentum = 0.9});
    CHECK_THROWS_WITH_AS(s.load_state({1, {0.1, 0, 0, 0, 0}, {std::vector<float>(3)}}),
                         doctest::Contains("into an Sgd with momentum"), gradsync::InvalidArgument);
    CHECK(s.lr() == 0.25);
  }
}

TEST_CASE("sampler: a resumed sampler continues at the next unseen sample, mid-epoch, at N = 1..4") {
  auto rng = test::rng_for("sampler resume");
  CAPTURE(test::test_seed());
  for (int world = 1; world <= 4; ++world) {
    for (bool drop_last : {false, true}) {
      const std::size_t length = std::size_t(world) + rng() % 40;  // often not divisible by N
      const std::uint64_t seed = rng();
      CAPTURE(world);
      CAPTURE(length);
      CAPTURE(drop_last);
      for (int r = 0; r < world; ++r) {
        DistributedSampler whole(length, world, r, {.seed = seed, .drop_last = drop_last});
        whole.set_epoch(3);
        const auto all = whole.indices();
        const std::size_t cut = all.empty() ? 0 : rng() % (all.size() + 1);
        CAPTURE(cut);
        whole.advance(cut);
        DistributedSampler resumed(length, world, r, {.seed = seed + 1, .drop_last = drop_last});
        resumed.set_epoch(9);
        resumed.load_state(whole.state());
        CHECK(resumed.epoch() == 3);
        CHECK(resumed.position() == cut);
        // The loop's set_epoch at the top of the epoch keeps the position.
        resumed.set_epoch(3);
        CHECK(resumed.position() == cut);
        CHECK(resumed.indices() == all);
        resumed.set_epoch(4);
        CHECK(resumed.position() == 0);
      }
    }
  }
}

TEST_CASE("sampler: across world sizes the ranks together continue the epoch's order, or are refused") {
  auto rng = test::rng_for("sampler reshard");
  CAPTURE(test::test_seed());
  const std::size_t length = 40 + rng() % 30;
  const std::uint64_t seed = rng();
  CAPTURE(length);
  // Saved at N = 4 after k samples per rank: 4k of the order are taken.
  const std::size_t k = 1 + rng() % 5;
  std::multiset<std::size_t> before;
  gradsync::SamplerState saved;
  for (int r = 0; r < 4; ++r) {
    DistributedSampler s(length, 4, r, {.seed = seed});
    const auto idx = s.indices();
    before.insert(idx.begin(), idx.begin() + std::ptrdiff_t(k));
    s.advance(k);
    saved = s.state();
  }
  CHECK(saved.consumed == 4 * k);
  // At N = 2 the rest of the epoch is every sample not yet seen, once.
  std::multiset<std::size_t> after;
  for (int r = 0; r < 2; ++r) {
    DistributedSampler s(length, 2, r, {.seed = seed + 5});
    s.load_state(saved);
    const auto idx = s.indices();
    after.insert(idx.begin() + std::ptrdiff_t(s.position()), idx.end());
  }
  std::multiset<std::size_t> every = before;
  every.insert(after.begin(), after.end());
  std::multiset<std::size_t> expected;
  for (std::size_t i = 0; i < length; ++i) expected.insert(i);
  // N = 2 pads an odd length with one repeat from the start of the order.
  if (length % 2) expected.insert(DistributedSampler(length, 1, 0, {.seed = seed}).indices().front());
  CHECK(every == expected);
  // At N = 3 a prefix of 4k samples continues only if 3 divides it.
  DistributedSampler three(length, 3, 0, {.seed = seed});
  if ((4 * k) % 3 == 0) {
    CHECK_NOTHROW(three.load_state(saved));
  } else {
    CHECK_THROWS_WITH_AS(three.load_state(saved), doctest::Contains("without repeating or skipping"),
                         gradsync::InvalidArgument);
    CHECK(three.position() == 0);
  }
  // Another dataset is refused.
  DistributedSampler other(length + 1, 4, 0, {.seed = seed});
  const std::string over = "over " + std::to_string(length) + " samples";
  CHECK_THROWS_WITH_AS(other.load_state(saved), doctest::Contains(over.c_str()), gradsync::InvalidArgument);
  CHECK_THROWS_AS(DistributedSampler(length, 2, 0).advance(length), gradsync::InvalidArgument);
}

TEST_CASE("sampler: an epoch finished at one world size resumes finished at every other") {
  // Every length up to 24 and every pair of world sizes up to 7. Without
  // drop_last the other world size may pad the epoch beyond the samples
  // taken (10 by 2 ranks, resumed by 4, whose epoch is 12); with it, N ranks
  // may leave a sample untaken that M ranks would take (9 of 10 by 3, 10 by
  // 1). Either way the resumed epoch is done: no rank takes another sample.
  for (bool drop_last : {false, true}) {
    for (std::size_t length = 1; length <= 24; ++length) {
      for (int saved_at = 1; saved_at <= 7; ++saved_at) {
        DistributedSampler done(length, saved_at, 0, {.seed = length, .drop_last = drop_last});
        done.set_epoch(2);
        done.advance(done.num_samples());
        const gradsync::SamplerState saved = done.state();
        CHECK(saved.consumed >= length);
        for (int world = 1; world <= 7; ++world) {
          CAPTURE(drop_last);
          CAPTURE(length);
          CAPTURE(saved_at);
          CAPTURE(world);
          for (int r = 0; r < world; ++r) {
            DistributedSampler s(length, world, r, {.drop_last = drop_last});
            s.load_state(saved);
            s.set_epoch(2);
            CHECK(s.position() == s.num_samples());
            s.set_epoch(3);
            CHECK(s.position() == 0);
          }
        }
      }
    }
  }
}

TEST_CASE("checkpoint file: the training state as named tensors, values as the trainer holds them") {
  TempDir dir;
  const fs::path file = dir.path / "step.safetensors";
  gradsync::run_threads(2, [&](Communicator<Threads>& comm) {
    after_steps(comm, Mlp<float>{layers, 3}, adam(), 4, 3, [&](auto& trainer, DistributedSampler& sampler) {
      gradsync::save_checkpoint(trainer, sampler, file, {{"note", "x"}});
      if (comm.rank() != 1) return;
      gradsync::checkpoint::SafetensorsReader reader(file);
      std::set<std::string> names;
      for (const auto& t : reader.tensors()) names.insert(t.spec.name);
      const std::set<std::string> expected{
          "layer0.w", "layer0.b", "layer0.seen", "layer1.w", "layer1.b", "layer2.w", "layer2.b",
          "optimizer.layer0.w.exp_avg", "optimizer.layer0.w.exp_avg_sq", "optimizer.layer0.b.exp_avg",
          "optimizer.layer0.b.exp_avg_sq", "optimizer.layer1.w.exp_avg", "optimizer.layer1.w.exp_avg_sq",
          "optimizer.layer1.b.exp_avg", "optimizer.layer1.b.exp_avg_sq", "optimizer.layer2.w.exp_avg",
          "optimizer.layer2.w.exp_avg_sq", "optimizer.layer2.b.exp_avg", "optimizer.layer2.b.exp_avg_sq",
          "trainer.step", "optimizer.step", "optimizer.lr", "optimizer.beta1", "optimizer.beta2", "optimizer.eps",
          "optimizer.weight_decay", "sampler.seed", "sampler.epoch", "sampler.consumed", "sampler.length",
          "sampler.shuffle", "sampler.drop_last"};
      CHECK(names == expected);
      CHECK(reader.tensor("layer1.w").spec.shape == std::vector<std::uint64_t>{6, 7});
      CHECK(reader.tensor("optimizer.layer1.w.exp_avg").spec.shape == std::vector<std::uint64_t>{6, 7});
      CHECK(reader.tensor("trainer.step").spec.shape.empty());
      CHECK(reader.metadata().at("note") == "x");
      CHECK(reader.metadata().at("gradsync.optimizer") == "Adam");
      // Parameters and exp_avg_sq of layer1.w, bit for bit.
      const std::size_t w1 = 7 * 5 + 7;  // layer0's w and b come first
      std::vector<float> got(42);
      reader.read("layer1.w", std::as_writable_bytes(std::span<float>(got)));
      CHECK(std::equal(got.begin(), got.end(), trainer.parameters().begin() + std::ptrdiff_t(w1)));
      reader.read("optimizer.layer1.w.exp_avg_sq", std::as_writable_bytes(std::span<float>(got)));
      const auto v = trainer.optimizer().state().buffers[1].second;
      CHECK(std::equal(got.begin(), got.end(), v.begin() + std::ptrdiff_t(w1)));
      std::uint64_t u = 0;
      reader.read("trainer.step", std::as_writable_bytes(std::span<std::uint64_t>(&u, 1)));
      CHECK(u == 3);
      reader.read("sampler.consumed", std::as_writable_bytes(std::span<std::uint64_t>(&u, 1)));
      CHECK(u == 2 * 3 * batch);
      double lr = 0;
      reader.read("optimizer.lr", std::as_writable_bytes(std::span<double>(&lr, 1)));
      CHECK(lr == trainer.optimizer().lr());
    });
  });
}

TEST_CASE("resume: 10 steps, save, a fresh trainer loads, 10 more = 20 straight, bitwise, N = 1..4") {
  for (int world = 1; world <= 4; ++world) {
    check_resume(world, adam, "Adam");
    check_resume(world, momentum_sgd, "Sgd with momentum");
  }
}

namespace {

/// Loads `path(rank)` into a fresh trainer on each of 3 ranks; a rank that
/// throws must be left as it was.
template <class Opt>
std::vector<LoadOutcome> try_load(const Mlp<float>& model, Opt opt, const std::function<fs::path(int)>& path) {
  std::vector<LoadOutcome> got(3);
  gradsync::run_threads(3, [&](Communicator<Threads>& comm) {
    after_steps(comm, model, opt, 11, 1, [&](auto& trainer, DistributedSampler& sampler) {
      const Snapshot before = snapshot(trainer, sampler);
      const LoadOutcome& o = got[std::size_t(comm.rank())] =
          outcome_of([&] { gradsync::load_checkpoint(trainer, sampler, path(comm.rank())); });
      if (!o.what.empty()) CHECK(snapshot(trainer, sampler) == before);
      if (o.what.empty()) CHECK(trainer.step_count() == 2);
    });
  });
  return got;
}

}  // namespace

TEST_CASE("bad files: every rank throws, naming the file and the tensor, and nothing is loaded on any rank") {
  TempDir dir;
  const fs::path good = dir.path / "good.safetensors";
  gradsync::run_threads(3, [&](Communicator<Threads>& comm) {
    after_steps(comm, Mlp<float>{layers, 3}, adam(), 11, 2, [&](auto& trainer, const DistributedSampler& sampler) {
      gradsync::save_checkpoint(trainer, sampler, good);
    });
  });
  auto same_file = [](fs::path p) { return [p](int) { return p; }; };

  SUBCASE("the checkpoint itself loads") {
    for (const LoadOutcome& o : try_load(Mlp<float>{layers, 5}, adam(), same_file(good))) CHECK(o.what.empty());
  }
  SUBCASE("another model's shapes") {
    all_say(try_load(Mlp<float>{{in, 8, 6, out}, 5}, adam(), same_file(good)), "InvalidArgument",
            {good.string(), "'layer0.w' is F32 [7, 5], this training state's is F32 [8, 5]"});
  }
  SUBCASE("another model's names") {
    all_say(try_load(Mlp<float>{layers, 5, true}, adam(), same_file(good)), "InvalidArgument",
            {good.string(), "has no tensor 'aux.bias'"});
  }
  SUBCASE("another optimizer") {
    all_say(try_load(Mlp<float>{layers, 5}, momentum_sgd(), same_file(good)), "InvalidArgument",
            {good.string(), "optimizer Adam", "Sgd"});
  }
  SUBCASE("a corrupted byte") {
    const fs::path bad = dir.path / "corrupt.safetensors";
    fs::copy_file(good, bad);
    std::uint64_t at = 0;
    {
      gradsync::checkpoint::SafetensorsReader r(bad);
      at = r.tensor("optimizer.layer1.b.exp_avg").offset + 5;
    }
    flip_byte(bad, at);
    all_say(try_load(Mlp<float>{layers, 5}, adam(), same_file(bad)), "Error",
            {bad.string(), "'optimizer.layer1.b.exp_avg' is corrupted"});
  }
  SUBCASE("a truncated file") {
    const fs::path bad = dir.path / "short.safetensors";
    fs::copy_file(good, bad);
    fs::resize_file(bad, fs::file_size(good) - 3);
    all_say(try_load(Mlp<float>{layers, 5}, adam(), same_file(bad)), "Error", {bad.string(), "truncated"});
  }
  SUBCASE("another dataset for the sampler") {
    std::vector<LoadOutcome> got(2);
    gradsync::run_threads(2, [&](Communicator<Threads>& comm) {
      ReplicatedTrainer trainer(comm, Mlp<float>{layers, 5}, adam(), exact());
      DistributedSampler sampler(dataset + 1, comm.size(), comm.rank());
      got[std::size_t(comm.rank())] = outcome_of([&] { gradsync::load_checkpoint(trainer, sampler, good); });
      CHECK(trainer.step_count() == 0);
    });
    all_say(got, "InvalidArgument", {"over 37 samples"});
  }
  SUBCASE("one rank cannot read it: that rank says why, the others name it, no rank hangs") {
    const fs::path missing = dir.path / "elsewhere" / "good.safetensors";
    const auto got = try_load(Mlp<float>{layers, 5}, adam(), [&](int r) { return r == 1 ? missing : good; });
    CHECK(got[1].type == "Error");
    CHECK(got[1].what.find(missing.string()) != std::string::npos);
    CHECK(got[1].what.find("cannot open") != std::string::npos);
    for (int r : {0, 2}) {
      CAPTURE(got[std::size_t(r)].what);
      CHECK(got[std::size_t(r)].type == "Error");
      CHECK(got[std::size_t(r)].what.find("failed on rank 1") != std::string::npos);
    }
  }
}

TEST_CASE("save and load refuse, on every rank before any communication, what cannot be right") {
  TempDir dir;
  std::vector<std::string> mid(3), reserved(3), unwritable(3);
  const fs::path blocker = dir.path / "a-file";
  std::ofstream(blocker) << "not a directory";
  gradsync::run_threads(3, [&](Communicator<Threads>& comm) {
    const auto r = std::size_t(comm.rank());
    ReplicatedTrainer trainer(comm, Mlp<float>{layers, 3}, adam(), exact());
    DistributedSampler sampler(dataset, comm.size(), comm.rank());
    trainer.forward_backward(batch_of(std::vector<std::size_t>{r}));
    try {
      gradsync::save_checkpoint(trainer, sampler, dir.path);
    } catch (const gradsync::InvalidArgument& e) {
      mid[r] = e.what();
    }
    CHECK_THROWS_AS(gradsync::load_checkpoint(trainer, sampler, dir.path), gradsync::InvalidArgument);
    trainer.optimizer_step();
    try {
      gradsync::save_checkpoint(trainer, sampler, dir.path, {{"gradsync.mine", "1"}});
    } catch (const gradsync::InvalidArgument& e) {
      reserved[r] = e.what();
    }
    // Rank 0 cannot create the directory: every rank throws, none hangs.
    try {
      gradsync::save_checkpoint(trainer, sampler, blocker / "ckpt");
    } catch (const std::exception& e) {
      unwritable[r] = e.what();
    }
    // The communicator is still usable, and a good save still works.
    gradsync::save_checkpoint(trainer, sampler, dir.path);
  });
  for (std::size_t r = 0; r < 3; ++r) {
    CAPTURE(r);
    CHECK(mid[r].find("between forward_backward() and optimizer_step()") != std::string::npos);
    CHECK(reserved[r].find("'gradsync.mine' is reserved") != std::string::npos);
    CHECK(!unwritable[r].empty());
    if (r != 0) CHECK(unwritable[r].find("failed on rank 0") != std::string::npos);
  }
  CHECK(gradsync::checkpoint_file(dir.path).filename() == "checkpoint-00000001.safetensors");
  CHECK(fs::exists(gradsync::checkpoint_file(dir.path)));
  CHECK(!fs::exists(blocker / "ckpt"));
}

namespace {

/// Runs this test binary again on test case `name` with GRADSYNC_CKPT_CHILD
/// set to `dir`; its exit status, or -1 if it did not end within a minute
/// (then it is killed).
int run_child(const std::string& name, const fs::path& dir) {
  const std::string filter = "--test-case=" + name;
  const std::string env = "GRADSYNC_CKPT_CHILD=" + dir.string();
  std::vector<char*> args{const_cast<char*>("/proc/self/exe"), const_cast<char*>(filter.c_str()), nullptr};
  std::vector<char*> envp;
  for (char** e = environ; *e; ++e)
    if (!std::string_view(*e).starts_with("GRADSYNC_CKPT_CHILD=")) envp.push_back(*e);
  envp.push_back(const_cast<char*>(env.c_str()));
  envp.push_back(nullptr);
  pid_t pid = 0;
  if (::posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, args.data(), envp.data()) != 0) return -2;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -3;
}

}  // namespace

// The child half runs in a process of its own: nothing of the saving
// process (heap layout, a static, a cached value) can carry the state over.
TEST_CASE("resume in a fresh process: Adam at N = 2 ends as the uninterrupted run, byte for byte") {
  constexpr int world = 2;
  if (const char* child = std::getenv("GRADSYNC_CKPT_CHILD")) {
    const fs::path dir = child;
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      ReplicatedTrainer trainer(comm, Mlp<float>{layers, 500 + std::uint64_t(comm.rank())}, adam(0.9), exact());
      DistributedSampler sampler(dataset, comm.size(), comm.rank(), {.seed = 1});
      gradsync::load_checkpoint(trainer, sampler, dir / "half");
      CHECK(trainer.step_count() == 10);
      train_steps(trainer, sampler, 10, batch);
      gradsync::save_checkpoint(trainer, sampler, dir / "resumed");
    });
    return;
  }
  TempDir dir;
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    ReplicatedTrainer straight(comm, Mlp<float>{layers, 7 + std::uint64_t(comm.rank())}, adam(), exact());
    DistributedSampler s1(dataset, comm.size(), comm.rank(), {.seed = 11});
    train_steps(straight, s1, 20, batch);
    gradsync::save_checkpoint(straight, s1, dir.path / "straight");
    ReplicatedTrainer half(comm, Mlp<float>{layers, 7 + std::uint64_t(comm.rank())}, adam(), exact());
    DistributedSampler s2(dataset, comm.size(), comm.rank(), {.seed = 11});
    train_steps(half, s2, 10, batch);
    gradsync::save_checkpoint(half, s2, dir.path / "half");
  });
  REQUIRE(run_child("resume in a fresh process*", dir.path) == 0);
  const auto bytes = [](const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    return std::vector<char>(std::istreambuf_iterator<char>(f), {});
  };
  const auto a = bytes(gradsync::checkpoint_file(dir.path / "straight"));
  const auto b = bytes(gradsync::checkpoint_file(dir.path / "resumed"));
  CHECK(!a.empty());
  CHECK(a == b);
}

}  // namespace test_train_checkpoint
