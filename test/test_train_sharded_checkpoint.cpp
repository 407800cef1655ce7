// Checkpoints of the ShardedTrainer: the full
// and the sharded layout, saved at N = 4 and loaded at N = 1, 2, 3 and into a
// ReplicatedTrainer, exact resume at the same N, and bad files.
#include <doctest/doctest.h>

#include <gradsync/checkpoint/safetensors_reader.hpp>
#include <gradsync/checkpoint/shard_index.hpp>
#include <gradsync/gradsync.hpp>
#include <gradsync/train/checkpoint/replicated_checkpoint.hpp>
#include <gradsync/train/checkpoint/sharded_checkpoint.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "support/common.hpp"
#include "test_train_checkpoint.hpp"
#include "test_train_model.hpp"
#include "test_train_sharded_schedule.hpp"
#include "test_train_squares.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_train_sharded_checkpoint {

using namespace test_checkpoint::names;
using test::test_seed;

namespace {

constexpr std::size_t in = 4, out = 2;
/// Units of 5 (P = 5: 2, 2, 1, 0 at N = 4), 14, 16 and (aux) 2 elements (1, 1, 0, 0 at N = 4).
const std::vector<std::size_t> layers{in, 1, 7, out};
/// 240 samples, 12 a step at every N (3 per rank at N = 4): the same global batches at N = 1..4.
constexpr std::size_t dataset = 240, global_batch = 12;

Mlp<float> model(std::uint64_t seed, const std::vector<std::size_t>& sizes = layers) { return {sizes, seed, true}; }

ShardedTrainerOptions exact(ShardingStrategy s) {
  ShardedTrainerOptions o;
  o.strategy = s;
  o.collective.deterministic = true;
  if (s == ShardingStrategy::HybridShard) o.shard_size = 2;
  return o;
}

template <class Trainer>
void train(Trainer& t, DistributedSampler& s, int steps) {
  test_checkpoint::train_steps(t, s, steps, global_batch / static_cast<std::size_t>(t.communicator().size()), in, out);
}

/// The training state as a ReplicatedTrainer holds it: parameters and each
/// optimizer buffer unpadded (zeros before the first step), rank 0's
/// buffers, the counters. Collective on a ShardedTrainer.
struct FullState {
  std::vector<std::vector<float>> tensors;
  std::vector<float> buffers;
  std::uint64_t opt_steps = 0;
  std::size_t trainer_steps = 0;
  bool operator==(const FullState&) const = default;
};

template <class M, class Opt, class C, class A>
FullState full_state(ShardedTrainer<M, Opt, C, A>& t) {
  const auto st = t.optimizer().state();
  FullState f;
  f.tensors.resize(1 + st.buffers.size());
  const auto shard = std::as_const(t).shard();
  for (std::size_t u = 0; u < t.unit_count(); ++u) {
    const std::size_t c = t.chunk_size(u), at = t.chunk_offset(u);
    std::vector<float> full(c * static_cast<std::size_t>(t.shard_count())), zeros(c);
    for (std::size_t k = 0; k < f.tensors.size(); ++k) {
      const std::span<const float> chunk = k == 0                              ? shard.subspan(at, c)
                                           : st.buffers[k - 1].second.empty() ? std::span<const float>(zeros)
                                                                              : st.buffers[k - 1].second.subspan(at, c);
      t.gather_chunk(u, chunk, full);
      f.tensors[k].insert(f.tensors[k].end(), full.begin(), full.begin() + std::ptrdiff_t(t.unit_size(u)));
    }
  }
  f.buffers.assign(t.buffers().begin(), t.buffers().end());
  f.opt_steps = st.steps;
  f.trainer_steps = t.step_count();
  return f;
}

template <class M, class Opt, class C, class A>
FullState full_state(ReplicatedTrainer<M, Opt, C, A>& t) {
  const auto st = t.optimizer().state();
  FullState f;
  f.tensors.emplace_back(t.parameters().begin(), t.parameters().end());
  for (const auto& b : st.buffers) {
    f.tensors.emplace_back(b.second.begin(), b.second.end());
    if (b.second.empty()) f.tensors.back().assign(t.parameters().size(), 0.0f);
  }
  f.buffers.assign(t.buffers().begin(), t.buffers().end());
  f.opt_steps = st.steps;
  f.trainer_steps = t.step_count();
  return f;
}

/// One rank's own state, padding included: what a resumed run must reproduce bit for bit.
struct RankState {
  std::vector<float> shard, buffers;
  std::vector<std::vector<float>> opt;
  std::uint64_t opt_steps = 0;
  std::size_t trainer_steps = 0;
  std::uint64_t sampler_epoch = 0, sampler_consumed = 0, sampler_seed = 0;
  bool operator==(const RankState&) const = default;
};

template <class Trainer>
RankState rank_state(Trainer& t, const DistributedSampler& s) {
  RankState r;
  const auto shard = std::as_const(t).shard();
  r.shard.assign(shard.begin(), shard.end());
  r.buffers.assign(t.buffers().begin(), t.buffers().end());
  const auto st = t.optimizer().state();
  for (const auto& b : st.buffers) r.opt.emplace_back(b.second.begin(), b.second.end());
  r.opt_steps = st.steps;
  r.trainer_steps = t.step_count();
  const auto ss = s.state();
  r.sampler_epoch = ss.epoch;
  r.sampler_consumed = ss.consumed;
  r.sampler_seed = ss.seed;
  return r;
}

const char* format_name(CheckpointFormat f) { return f == CheckpointFormat::full ? "full" : "sharded"; }

}  // namespace

TEST_CASE("sharded trainer: the layouts on disk, and the full file is a ReplicatedTrainer's, tensor for tensor") {
  const std::uint64_t seed = test_seed();
  CAPTURE(seed);
  TempDir dir;
  gradsync::run_threads(4, [&](Communicator<Threads>& comm) {
    ShardedTrainer t(comm, model(seed + std::uint64_t(comm.rank())), adam(), exact(ShardingStrategy::FullShard));
    DistributedSampler sampler(dataset, comm.size(), comm.rank(), {.seed = seed % 1000});
    train(t, sampler, 2);
    gradsync::save_checkpoint(t, sampler, dir.path / "full", {{"note", "x"}});
    gradsync::save_checkpoint(t, sampler, dir.path / "sharded", {{"note", "x"}}, {.format = CheckpointFormat::sharded});
    // A second sharded save replaces the first: one index, one set of files.
    gradsync::save_checkpoint(t, sampler, dir.path / "sharded", {{"note", "y"}}, {.format = CheckpointFormat::sharded});
    const FullState mine = full_state(t);
    if (comm.rank() != 0) return;
    gradsync::checkpoint::SafetensorsReader full(gradsync::checkpoint_file(dir.path / "full"));
    CHECK(full.metadata().at("note") == "x");
    CHECK(full.metadata().at("gradsync.world_size") == "4");
    CHECK(full.tensor("layer1.w").spec.shape == std::vector<std::uint64_t>{7, 1});
    std::vector<float> got(14);
    full.read("optimizer.layer1.w.exp_avg_sq", std::as_writable_bytes(std::span<float>(got).first(7)));
    // layer1.w starts after layer0's 5 elements.
    CHECK(std::equal(got.begin(), got.begin() + 7, mine.tensors[2].begin() + 5));
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(dir.path / "sharded")) files.push_back(e.path().filename().string());
    std::sort(files.begin(), files.end());
    // The second generation's index and shard files, and the commit file naming it; the first's are gone.
    REQUIRE(files.size() == 6);
    CHECK(files[4] == "checkpoint-00000002.index.json");
    CHECK(files[5] == "checkpoint.commit");
    CHECK(gradsync::checkpoint_file(dir.path / "sharded") == dir.path / "sharded" / files[4]);
    const auto index = gradsync::checkpoint::ShardIndex::read(dir.path / "sharded" / files[4]);
    CHECK(index.checkpoint_id() == "00000002");
    for (int r = 0; r < 4; ++r) {
      CHECK(files[std::size_t(r)] == gradsync::checkpoint::shard_file_name("checkpoint", "00000002", r, 4));
    }
    // P = 5 at N = 4 (layer0.w 4 elements, layer0.b 1): ranks 0, 1, 2 hold 2, 2, 1 elements, rank 3 none.
    const auto& w0 = index.tensor("layer0.w");
    REQUIRE(w0.pieces.size() == 2);
    CHECK(w0.pieces[1].begin == 2);
    CHECK(w0.pieces[1].file == files[1]);
    REQUIRE(index.tensor("layer0.b").pieces.size() == 1);
    CHECK(index.tensor("layer0.b").pieces[0].file == files[2]);
    CHECK(index.tensor("aux.bias").pieces.size() == 2);
    CHECK(index.tensor("trainer.step").pieces.size() == 1);
    gradsync::checkpoint::SafetensorsReader rank0(dir.path / "sharded" / files[0]);
    CHECK(rank0.metadata().at("note") == "y");
    CHECK(rank0.metadata().at("gradsync.optimizer") == "Adam");
  });
}

TEST_CASE("reshard: saved at N = 4 (empty shards), loaded at N = 1, 2, 3 and into a ReplicatedTrainer, full and sharded") {
  const std::uint64_t seed = test_seed();
  CAPTURE(seed);
  for (const CheckpointFormat format : {CheckpointFormat::full, CheckpointFormat::sharded}) {
    CAPTURE(format_name(format));
    TempDir dir;
    const fs::path path = dir.path / "ckpt";
    FullState saved;
    gradsync::run_threads(4, [&](Communicator<Threads>& comm) {
      ShardedTrainer t(comm, model(seed + std::uint64_t(comm.rank())), adam(), exact(ShardingStrategy::FullShard));
      DistributedSampler sampler(dataset, comm.size(), comm.rank(), {.seed = seed % 1000});
      train(t, sampler, 10);
      gradsync::save_checkpoint(t, sampler, path, {{"k", "v"}}, {.format = format});
      const FullState s = full_state(t);
      if (comm.rank() == 0) saved = s;
    });
    // Each new world size: a sharded trainer (another strategy or wrapping) and a replicated one.
    struct Target {
      int world;
      bool replicated;
      ShardingStrategy strategy;
      bool wrapped;
    };
    for (const Target target : {Target{1, false, ShardingStrategy::FullShard, false},
                                Target{2, false, ShardingStrategy::ShardGradOp, false},
                                Target{3, false, ShardingStrategy::FullShard, true},
                                Target{2, true, ShardingStrategy::FullShard, false}}) {
      CAPTURE(target.world);
      CAPTURE(target.replicated);
      CAPTURE(target.wrapped);
      ShardedTrainerOptions o = exact(target.strategy);
      if (target.wrapped) o.wrap = gradsync::WrapPolicy::size_based(12);
      FullState straight, loaded, resumed;
      auto run = [&](auto make) {
        gradsync::run_threads(target.world, [&](Communicator<Threads>& comm) {
          auto t = make(comm, seed + std::uint64_t(comm.rank()), 0.01);
          DistributedSampler sampler(dataset, comm.size(), comm.rank(), {.seed = seed % 1000});
          train(*t, sampler, 20);
          const FullState s = full_state(*t);
          if (comm.rank() == 0) straight = s;
        });
        gradsync::run_threads(target.world, [&](Communicator<Threads>& comm) {
          // Other initial values, learning rate, sampler seed and epoch: the load replaces them all.
          auto t = make(comm, seed + 100 + std::uint64_t(comm.rank()), 0.5);
          DistributedSampler sampler(dataset, comm.size(), comm.rank(), {.seed = seed % 1000 + 1});
          sampler.set_epoch(3);
          const auto meta = gradsync::load_checkpoint(*t, sampler, path);
          CHECK(meta == gradsync::checkpoint::Metadata{{"k", "v"}});
          const FullState l = full_state(*t);
          train(*t, sampler, 10);
          const FullState r = full_state(*t);
          if (comm.rank() == 0) {
            loaded = l;
            resumed = r;
          }
        });
      };
      if (target.replicated) {
        run([&](Communicator<Threads>& comm, std::uint64_t s, double lr) {
          return std::make_unique<ReplicatedTrainer<Mlp<float>, gradsync::Adam<float>, Communicator<Threads>>>(
              comm, model(s), adam(lr), exact_replicated());
        });
      } else {
        run([&](Communicator<Threads>& comm, std::uint64_t s, double lr) {
          return std::make_unique<ShardedTrainer<Mlp<float>, gradsync::Adam<float>, Communicator<Threads>>>(
              comm, model(s), adam(lr), o);
        });
      }
      CHECK(loaded == saved);
      CHECK(resumed.trainer_steps == 20);
      CHECK(resumed.opt_steps == straight.opt_steps);
      REQUIRE(resumed.tensors.size() == straight.tensors.size());
      for (std::size_t k = 0; k < resumed.tensors.size(); ++k) {
        CAPTURE(k);
        CHECK(test_schedule::worst_relative(resumed.tensors[k], straight.tensors[k]) <= 1e-6);
      }
    }
  }
}

namespace {

/// 10 steps, save, a fresh trainer (other values, learning rate, sampler)
/// loads, 10 more: every rank ends bitwise where 20 straight steps do.
void check_resume(int world, ShardingStrategy strategy, CheckpointFormat format, std::uint64_t seed,
                  bool offload = false) {
  CAPTURE(world);
  CAPTURE(offload);
  CAPTURE(gradsync::name(strategy));
  CAPTURE(format_name(format));
  TempDir dir;
  std::vector<RankState> straight(static_cast<std::size_t>(world)), resumed(straight.size());
  auto make = [&](Communicator<Threads>& comm, std::uint64_t s, double lr) {
    ShardedTrainerOptions o = exact(strategy);
    // Offloaded, the master shard lives in the offload space: shard() and the checkpoint reach it there.
    if (offload) o.offload = std::make_shared<gradsync::HostOffloadSpace>();
    return ShardedTrainer(comm, model(s), adam(lr), o);
  };
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    auto t = make(comm, seed + std::uint64_t(comm.rank()), 0.01);
    DistributedSampler sampler(dataset, comm.size(), comm.rank(), {.seed = seed % 1000});
    train(t, sampler, 20);
    straight[std::size_t(comm.rank())] = rank_state(t, sampler);
  });
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    auto t = make(comm, seed + std::uint64_t(comm.rank()), 0.01);
    DistributedSampler sampler(dataset, comm.size(), comm.rank(), {.seed = seed % 1000});
    train(t, sampler, 10);
    gradsync::save_checkpoint(t, sampler, dir.path, {}, {.format = format});
  });
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    auto t = make(comm, seed + 500 + std::uint64_t(comm.rank()), 0.3);
    DistributedSampler sampler(dataset, comm.size(), comm.rank(), {.seed = seed % 1000 + 7});
    gradsync::load_checkpoint(t, sampler, dir.path);
    CHECK(t.step_count() == 10);
    train(t, sampler, 10);
    resumed[std::size_t(comm.rank())] = rank_state(t, sampler);
  });
  for (std::size_t r = 0; r < straight.size(); ++r) {
    CAPTURE(r);
    CHECK(test_schedule::bitwise_equal(resumed[r].shard, straight[r].shard));
    CHECK(resumed[r].opt == straight[r].opt);
    CHECK(resumed[r] == straight[r]);
  }
}

}  // namespace

TEST_CASE("resume: 10 steps, save, fresh trainer loads, 10 more = 20 straight, bitwise, every rank and strategy") {
  const std::uint64_t seed = test_seed();
  CAPTURE(seed);
  for (const CheckpointFormat format : {CheckpointFormat::full, CheckpointFormat::sharded}) {
    for (int world = 1; world <= 4; ++world) {
      check_resume(world, ShardingStrategy::FullShard, format, seed);
      check_resume(world, ShardingStrategy::ShardGradOp, format, seed);
    }
    check_resume(4, ShardingStrategy::HybridShard, format, seed);
    // Every rank holds everything: rank 0 alone gathers nothing and writes.
    check_resume(3, ShardingStrategy::NoShard, format, seed);
    check_resume(3, ShardingStrategy::FullShard, format, seed, true);
  }
}

namespace {

/// Loads `path` into a fresh FullShard trainer on each of 3 ranks (after a
/// step, so that there is state to keep); a rank that throws must be left as it was.
std::vector<LoadOutcome> try_load(const Mlp<float>& m, const fs::path& path) {
  std::vector<LoadOutcome> got(3);
  gradsync::run_threads(3, [&](Communicator<Threads>& comm) {
    ShardedTrainer t(comm, m, adam(), exact(ShardingStrategy::FullShard));
    DistributedSampler sampler(dataset, comm.size(), comm.rank(), {.seed = 3});
    train(t, sampler, 1);
    const RankState before = rank_state(t, sampler);
    const LoadOutcome& o = got[std::size_t(comm.rank())] =
        outcome_of([&] { gradsync::load_checkpoint(t, sampler, path); });
    if (!o.what.empty()) CHECK(rank_state(t, sampler) == before);
    if (o.what.empty()) CHECK(t.step_count() == 3);
  });
  return got;
}

}  // namespace

// A model computing in bfloat16 (compute_type) checkpoints what a float one
// does: the fp32 master shard and the optimizer's state; its bfloat16 views
// live only inside a step. Resumed from either layout, bitwise the run that
// did not stop, the bfloat16 reduction included.
TEST_CASE("resume: a bfloat16 model's fp32 master and Adam state, saved and loaded, bitwise, full and sharded") {
  using test_squares::LowSquares;
  using test_squares::Scale;
  using test_squares::Squares;
  constexpr int world = 3;
  const std::vector<std::size_t> sizes{5, 14, 16, 2};
  for (const CheckpointFormat format : {CheckpointFormat::full, CheckpointFormat::sharded}) {
    CAPTURE(format_name(format));
    TempDir dir;
    std::vector<RankState> straight(world), resumed(world);
    auto make = [&](Communicator<Threads>& comm, std::uint64_t s) {
      ShardedTrainerOptions o = exact(ShardingStrategy::FullShard);
      o.reduce_dtype = gradsync::DataType::bfloat16;
      return ShardedTrainer(comm, LowSquares{Squares{sizes, s}}, adam(0.01), o);
    };
    auto steps = [](auto& t, int from, int to) {
      const auto r = static_cast<float>(t.communicator().rank());
      for (int k = from; k < to; ++k) t.step(Scale{1.0f + r + 0.25f * static_cast<float>(k)});
    };
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      auto t = make(comm, 11);
      DistributedSampler sampler(dataset, comm.size(), comm.rank());
      steps(t, 0, 6);
      straight[std::size_t(comm.rank())] = rank_state(t, sampler);
    });
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      auto t = make(comm, 11);
      DistributedSampler sampler(dataset, comm.size(), comm.rank());
      steps(t, 0, 3);
      gradsync::save_checkpoint(t, sampler, dir.path, {}, {.format = format});
    });
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      auto t = make(comm, 99);
      DistributedSampler sampler(dataset, comm.size(), comm.rank());
      gradsync::load_checkpoint(t, sampler, dir.path);
      CHECK(t.step_count() == 3);
      steps(t, 3, 6);
      resumed[std::size_t(comm.rank())] = rank_state(t, sampler);
    });
    for (std::size_t r = 0; r < straight.size(); ++r) {
      CAPTURE(r);
      CHECK(test_schedule::bitwise_equal(resumed[r].shard, straight[r].shard));
      CHECK(resumed[r] == straight[r]);
    }
  }
}

TEST_CASE("bad sharded checkpoints: every rank throws, naming the file and the tensor; nothing loaded, no hang") {
  const std::uint64_t seed = test_seed();
  CAPTURE(seed);
  TempDir dir;
  const fs::path good = dir.path / "good";
  gradsync::run_threads(2, [&](Communicator<Threads>& comm) {
    ShardedTrainer t(comm, model(seed), adam(), exact(ShardingStrategy::FullShard));
    DistributedSampler sampler(dataset, comm.size(), comm.rank(), {.seed = 3});
    train(t, sampler, 3);
    gradsync::save_checkpoint(t, sampler, good, {}, {.format = CheckpointFormat::sharded});
  });
  const fs::path index = gradsync::checkpoint_file(good);
  const std::string id = gradsync::checkpoint::ShardIndex::read(index).checkpoint_id();
  const std::string rank1 = gradsync::checkpoint::shard_file_name("checkpoint", id, 1, 2);
  auto copy = [&](const std::string& name) {
    const fs::path to = dir.path / name;
    fs::copy(good, to);
    return to;
  };

  SUBCASE("the checkpoint itself loads at N = 3") {
    for (const LoadOutcome& o : try_load(model(seed + 1), good)) CHECK(o.what.empty());
  }
  SUBCASE("another model's shapes") {
    all_say(try_load(model(seed + 1, {in, 1, 8, out}), good), "",
            {index.string(), "'layer1.w' is F32 [7, 1], this training state's is F32 [8, 1]"});
  }
  SUBCASE("a flipped byte in a piece") {
    const fs::path bad = copy("flipped");
    std::string piece;
    std::uint64_t at = 0;
    {
      gradsync::checkpoint::SafetensorsReader r(bad / rank1);
      for (const auto& e : r.tensors()) {
        if (e.spec.name.starts_with("optimizer.layer2.w.exp_avg[")) {
          piece = e.spec.name;
          at = e.offset + 2;
        }
      }
    }
    REQUIRE(!piece.empty());
    flip_byte(bad / rank1, at);
    all_say(try_load(model(seed + 1), bad), "", {(bad / rank1).string(), "optimizer.layer2.w.exp_avg", "corrupted"});
  }
  SUBCASE("a truncated shard file") {
    const fs::path bad = copy("truncated");
    fs::resize_file(bad / rank1, fs::file_size(bad / rank1) - 3);
    all_say(try_load(model(seed + 1), bad), "", {(bad / rank1).string(), "truncated", "loading tensor '"});
  }
  SUBCASE("a piece missing from the index") {
    const fs::path bad = copy("missing");
    std::ifstream is(bad / index.filename());
    std::string text((std::istreambuf_iterator<char>(is)), std::istreambuf_iterator<char>());
    is.close();
    // layer1.w (7 elements) lies in rank 0's chunk of layer1 (14 elements, 7 a rank): one piece.
    const auto tensor = text.find("\"layer1.w\":");
    const auto first = text.find("\"pieces\":[", tensor) + 10;
    const auto last = text.find('}', first);
    REQUIRE(text[last + 1] == ']');
    text.erase(first, last + 1 - first);
    std::ofstream(bad / index.filename(), std::ios::trunc) << text;
    all_say(try_load(model(seed + 1), bad), "",
            {(bad / index.filename()).string(), "'layer1.w' pieces cover 0 of its 7 elements"});
  }
  SUBCASE("a sharded save to a file name, or between forward_backward and optimizer_step, is refused on every rank") {
    std::vector<std::string> file(2), mid(2);
    gradsync::run_threads(2, [&](Communicator<Threads>& comm) {
      ShardedTrainer t(comm, model(seed), adam(), exact(ShardingStrategy::FullShard));
      DistributedSampler sampler(dataset, comm.size(), comm.rank(), {.seed = 3});
      try {
        gradsync::save_checkpoint(t, sampler, dir.path / "x.safetensors", {}, {.format = CheckpointFormat::sharded});
      } catch (const gradsync::InvalidArgument& e) {
        file[std::size_t(comm.rank())] = e.what();
      }
      t.forward_backward(test_checkpoint::batch_of(std::vector<std::size_t>{1, 2}, in, out));
      try {
        gradsync::save_checkpoint(t, sampler, dir.path / "mid");
      } catch (const gradsync::InvalidArgument& e) {
        mid[std::size_t(comm.rank())] = e.what();
      }
      CHECK_THROWS_AS(gradsync::load_checkpoint(t, sampler, good), gradsync::InvalidArgument);
      t.optimizer_step();
      gradsync::load_checkpoint(t, sampler, good);
    });
    for (std::size_t r = 0; r < 2; ++r) {
      CHECK(file[r].find("names a file") != std::string::npos);
      CHECK(mid[r].find("between forward_backward() and optimizer_step()") != std::string::npos);
    }
    CHECK(!fs::exists(dir.path / "mid"));
  }
}

TEST_CASE("a ReplicatedTrainer's sharded checkpoint loads into a ShardedTrainer at another N, and back") {
  const std::uint64_t seed = test_seed();
  CAPTURE(seed);
  TempDir dir;
  FullState saved, loaded, back;
  gradsync::run_threads(2, [&](Communicator<Threads>& comm) {
    ReplicatedTrainer t(comm, model(seed + std::uint64_t(comm.rank())), adam(), exact_replicated());
    DistributedSampler sampler(dataset, comm.size(), comm.rank(), {.seed = seed % 1000});
    train(t, sampler, 4);
    gradsync::save_checkpoint(t, sampler, dir.path / "r", {}, {.format = CheckpointFormat::sharded});
    if (comm.rank() == 0) saved = full_state(t);
  });
  CHECK(gradsync::checkpoint_file(dir.path / "r") == dir.path / "r" / "checkpoint-00000001.index.json");
  gradsync::run_threads(3, [&](Communicator<Threads>& comm) {
    ShardedTrainer t(comm, model(seed + 9), adam(0.2), exact(ShardingStrategy::ShardGradOp));
    DistributedSampler sampler(dataset, comm.size(), comm.rank(), {.seed = 1});
    gradsync::load_checkpoint(t, sampler, gradsync::checkpoint_file(dir.path / "r"));
    const FullState l = full_state(t);
    gradsync::save_checkpoint(t, sampler, dir.path / "s", {}, {.format = CheckpointFormat::sharded});
    if (comm.rank() == 0) loaded = l;
  });
  gradsync::run_threads(1, [&](Communicator<Threads>& comm) {
    ReplicatedTrainer t(comm, model(seed + 5), adam(0.3), exact_replicated());
    DistributedSampler sampler(dataset, comm.size(), comm.rank(), {.seed = 2});
    gradsync::load_checkpoint(t, sampler, dir.path / "s");
    back = full_state(t);
  });
  CHECK(loaded == saved);
  CHECK(back == saved);
}

}  // namespace test_train_sharded_checkpoint
