// AsyncCheckpointer: a save whose caller waits only for the copy. What it
// commits is what save_checkpoint commits; training steps run while the
// files are written; a failure of the background write is thrown on every
// rank at wait() or at the next save; the next save waits for the previous;
// the snapshot counts against memory_budget.
#include <doctest/doctest.h>

#include <gradsync/checkpoint/file_ops.hpp>
#include <gradsync/gradsync.hpp>
#include <gradsync/train/checkpoint/async_checkpointer.hpp>
#include <gradsync/train/checkpoint/sharded_checkpoint.hpp>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "support/common.hpp"
#include "support/refusals.hpp"
#include "test_train_checkpoint.hpp"
#include "test_train_model.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_train_checkpoint_async {

namespace ck = gradsync::checkpoint;
using namespace test_checkpoint::names;
using gradsync::AsyncCheckpointer;
using FileOp = ck::detail::FileOp;

namespace {

constexpr std::size_t in = 4, out = 2, samples = 96, batch = 4;
const std::vector<std::size_t> layers{in, 6, 5, out};

/// A trainer of either kind on `comm`, the model's initial values drawn from `seed`.
template <bool Sharded>
auto make_trainer(Communicator<Threads>& comm, std::uint64_t seed) {
  if constexpr (Sharded) {
    return ShardedTrainer(comm, Mlp<float>{layers, seed}, test_checkpoint::adam(), exact_sharded());
  } else {
    return ReplicatedTrainer(comm, Mlp<float>{layers, seed}, test_checkpoint::adam(), exact_replicated());
  }
}

/// Runs `body(t, sampler, ckpt)` on `comm` with a trainer of either kind and
/// a sampler, both from `seed`, and an AsyncCheckpointer of the two.
template <bool Sharded, class Body>
void with_async_checkpointer(Communicator<Threads>& comm, std::uint64_t seed, Body body) {
  auto t = make_trainer<Sharded>(comm, seed);
  DistributedSampler sampler(samples, comm.size(), comm.rank(), {.seed = seed});
  AsyncCheckpointer ckpt(t, sampler);
  body(t, sampler, ckpt);
}

/// What a rank holds of a trainer and its sampler: its parameters (a
/// ShardedTrainer's shard), its optimizer buffers, the step counts, and
/// the sampler's position.
struct Held {
  std::vector<float> params;
  std::vector<std::vector<float>> opt;
  std::size_t steps = 0;
  std::uint64_t opt_steps = 0, epoch = 0, position = 0;
  bool operator==(const Held&) const = default;
};

template <class Trainer>
std::span<const float> params_of(Trainer& t) {
  if constexpr (requires { t.parameters(); }) {
    return t.parameters();
  } else {
    return std::as_const(t).shard();
  }
}

template <class Trainer>
Held held(Trainer& t, const DistributedSampler& s) {
  Held h;
  const auto p = params_of(t);
  h.params.assign(p.begin(), p.end());
  const auto st = t.optimizer().state();
  for (const auto& b : st.buffers) h.opt.emplace_back(b.second.begin(), b.second.end());
  h.steps = t.step_count();
  h.opt_steps = st.steps;
  h.epoch = s.epoch();
  h.position = s.position();
  return h;
}

/// What each of 3 ranks holds after a fresh trainer (other initial values) and a sampler of
/// seed `seed` load `target`.
template <bool Sharded>
std::vector<Held> load_held(const fs::path& target, std::uint64_t seed) {
  std::vector<Held> loaded(3);
  gradsync::run_threads(3, [&](Communicator<Threads>& comm) {
    auto t = make_trainer<Sharded>(comm, seed + 1);
    DistributedSampler sampler(samples, comm.size(), comm.rank(), {.seed = seed});
    const auto meta = gradsync::load_checkpoint(t, sampler, target);
    CHECK(meta.at("run") == "x");
    loaded[std::size_t(comm.rank())] = held(t, sampler);
  });
  return loaded;
}

std::vector<char> bytes_of(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// The hook's state, shared by every rank's thread and every background
// writer, so all of it is atomic or under `log_mutex`.
std::atomic<bool> hold_writes{false};
std::atomic<bool> released{false};
std::atomic<int> held_writers{0};
std::atomic<bool> held_too_long{false};
std::atomic<int> fail_errno{0};
std::mutex log_mutex;
std::string fail_path_part;
FileOp fail_op = FileOp::write;
std::vector<std::pair<FileOp, std::string>> op_log;

/// Holds every background writer at the creation of its temporary file
/// until `released` (at most 60 s, a failure past that); fails the first
/// `fail_op` on a path containing `fail_path_part` with `fail_errno`; logs
/// every operation.
int hook(FileOp op, const fs::path& path) {
  {
    const std::lock_guard<std::mutex> lock(log_mutex);
    op_log.emplace_back(op, path.string());
  }
  if (hold_writes.load() && op == FileOp::create &&
      path.filename().string().find(".safetensors.tmp-") != std::string::npos && !released.load()) {
    ++held_writers;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!released.load()) {
      if (std::chrono::steady_clock::now() > deadline) {
        held_too_long = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  if (fail_errno.load() != 0) {
    const std::lock_guard<std::mutex> lock(log_mutex);
    if (op == fail_op && !fail_path_part.empty() && path.string().find(fail_path_part) != std::string::npos) {
      fail_path_part.clear();
      return fail_errno.exchange(0);
    }
  }
  return 0;
}

/// Sets the hook for a test case and clears it and its state after.
struct HookGuard {
  HookGuard() {
    reset();
    ck::detail::file_op_hook = hook;
  }
  HookGuard(const HookGuard&) = delete;
  HookGuard& operator=(const HookGuard&) = delete;
  ~HookGuard() {
    ck::detail::file_op_hook = nullptr;
    reset();
  }
  static void reset() {
    hold_writes = false;
    released = false;
    held_writers = 0;
    held_too_long = false;
    fail_errno = 0;
    const std::lock_guard<std::mutex> lock(log_mutex);
    fail_path_part.clear();
    op_log.clear();
  }
};

const char* format_name(CheckpointFormat f) { return f == CheckpointFormat::full ? "full" : "sharded"; }

/// Trains `steps` batches in the sampler's order.
template <class Trainer>
void train(Trainer& t, DistributedSampler& s, int steps) {
  test_checkpoint::train_steps(t, s, steps, batch, in, out);
}

/// On 3 ranks: a synchronous save and an asynchronous one of the same
/// state, a step taken while the latter writes, then wait(). Both commit
/// the same bytes; a fresh trainer loads from the asynchronous one what
/// the trainer held when save() was called. With `reserve`, the snapshot is
/// reserved before training and the save then needs no more than that.
template <bool Sharded>
void same_as_sync(std::uint64_t seed, CheckpointFormat format, bool file_path, bool reserve) {
  TempDir dir;
  const fs::path sync_target = file_path ? dir.path / "sync" / "m.safetensors" : dir.path / "sync";
  const fs::path async_target = file_path ? dir.path / "async" / "m.safetensors" : dir.path / "async";
  const int warmup = 1 + int(seed % 5);
  std::vector<Held> at_save(3);
  std::vector<std::size_t> snapshot(3), reserved(3);
  gradsync::run_threads(3, [&](Communicator<Threads>& comm) {
    const auto me = std::size_t(comm.rank());
    with_async_checkpointer<Sharded>(comm, seed, [&](auto& t, DistributedSampler& sampler, auto& ckpt) {
      if (reserve) {
        ckpt.reserve({.format = format});
        CHECK(!ckpt.pending());
        reserved[me] = ckpt.snapshot_bytes();
      }
      train(t, sampler, warmup);
      gradsync::save_checkpoint(t, sampler, sync_target, {{"run", "x"}}, {.format = format});
      at_save[me] = held(t, sampler);
      ckpt.save(async_target, {{"run", "x"}}, {.format = format});
      CHECK(ckpt.pending());
      snapshot[me] = ckpt.snapshot_bytes();
      train(t, sampler, 1);
      ckpt.wait();
      CHECK(!ckpt.pending());
      CHECK(ckpt.written());
    });
  });
  // Rank 0 alone copies a full file's state; in the sharded layout each rank its own ranges (a
  // ReplicatedTrainer's one shard: rank 0).
  CHECK(snapshot[0] > 0);
  const bool each_rank = Sharded && format == CheckpointFormat::sharded;
  for (std::size_t r = 1; r < 3; ++r) CHECK(each_rank == (snapshot[r] > 0));
  if (reserve) CHECK(reserved == snapshot);
  const fs::path sync_file = gradsync::checkpoint_file(sync_target), async_file = gradsync::checkpoint_file(async_target);
  CHECK(sync_file.filename() == async_file.filename());
  CHECK(bytes_of(sync_file) == bytes_of(async_file));
  if (format == CheckpointFormat::sharded) {
    for (int r = 0; r < 3; ++r) {
      if (!Sharded && r > 0) break;
      const std::string shard = ck::shard_file_name("checkpoint", "00000001", r, Sharded ? 3 : 1);
      CHECK(bytes_of(sync_target / shard) == bytes_of(async_target / shard));
    }
  }
  CHECK(load_held<Sharded>(async_target, seed) == at_save);
}

}  // namespace

TEST_CASE("async save: commits what save_checkpoint commits, and loads as the state at save(), either trainer and layout") {
  auto rng = test::rng_for("async same as sync");
  MESSAGE("seed " << test::test_seed() << " (GRADSYNC_TEST_SEED replays)");
  CAPTURE(test::test_seed());
  for (const bool sharded_trainer : {false, true}) {
    for (const CheckpointFormat format : {CheckpointFormat::full, CheckpointFormat::sharded}) {
      for (const bool file_path : {false, true}) {
        if (file_path && format == CheckpointFormat::sharded) continue;
        const std::uint64_t seed = rng() % 1000 + 1;
        // Whether reserve() came first: drawn, so each layout sees both over runs.
        const bool reserve = rng() % 2 == 0;
        CAPTURE(sharded_trainer);
        CAPTURE(std::string(format_name(format)));
        CAPTURE(file_path);
        CAPTURE(seed);
        CAPTURE(reserve);
        if (sharded_trainer) {
          same_as_sync<true>(seed, format, file_path, reserve);
        } else {
          same_as_sync<false>(seed, format, file_path, reserve);
        }
      }
    }
  }
}

TEST_CASE("async save: training steps run while the files are written; the checkpoint is the state at save()") {
  for (const CheckpointFormat format : {CheckpointFormat::full, CheckpointFormat::sharded}) {
    CAPTURE(std::string(format_name(format)));
    TempDir dir;
    const fs::path target = dir.path / "ckpt";
    HookGuard guard;
    std::vector<Held> at_save(3);
    std::vector<int> stepped_while_held(3, 0);
    const int writers = format == CheckpointFormat::sharded ? 3 : 1;
    gradsync::run_threads(3, [&](Communicator<Threads>& comm) {
      const auto me = std::size_t(comm.rank());
      with_async_checkpointer<true>(comm, 5, [&](auto& t, DistributedSampler& sampler, auto& ckpt) {
        train(t, sampler, 2);
        at_save[me] = held(t, sampler);
        if (me == 0) hold_writes = true;
        comm.barrier();
        ckpt.save(target, {{"run", "x"}}, {.format = format});
        // Every writer is held at its file until the steps below are done.
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (held_writers.load() < writers && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        train(t, sampler, 3);
        const bool writes = format == CheckpointFormat::sharded || me == 0;
        if (writes) {
          stepped_while_held[me] = !ckpt.written();
        } else {
          stepped_while_held[me] = 1;
        }
        comm.barrier();
        if (me == 0) released = true;
        ckpt.wait();
        CHECK(ckpt.written());
      });
    });
    CHECK(!held_too_long.load());
    CHECK(held_writers.load() == writers);
    for (int s : stepped_while_held) CHECK(s == 1);
    CHECK(load_held<true>(target, 5) == at_save);
  }
}

TEST_CASE("async save: a synchronous save to its path before wait() is refused on every rank; after it, it lands") {
  // Both would number the same generation of files, and one's commit or
  // clean-up removed or replaced the other's: a path that loaded nothing,
  // or the older state after the newer save returned.
  for (const bool sharded_trainer : {false, true}) {
    for (const CheckpointFormat format : {CheckpointFormat::full, CheckpointFormat::sharded}) {
      CAPTURE(sharded_trainer);
      CAPTURE(std::string(format_name(format)));
      TempDir dir;
      const fs::path target = dir.path / "ckpt";
      std::vector<std::string> refused(3);
      std::vector<Held> at_sync(3);
      auto body = [&](Communicator<Threads>& comm, auto& t, DistributedSampler& sampler, auto& ckpt) {
        const auto me = std::size_t(comm.rank());
        train(t, sampler, 1);
        ckpt.save(target, {{"run", "x"}}, {.format = format});
        train(t, sampler, 1);
        try {
          // The same directory, written otherwise: still refused.
          gradsync::save_checkpoint(t, sampler, dir.path / "." / "ckpt" / "", {{"run", "x"}}, {.format = format});
        } catch (const gradsync::InvalidArgument& e) {
          refused[me] = e.what();
        }
        ckpt.wait();
        gradsync::save_checkpoint(t, sampler, target, {{"run", "x"}}, {.format = format});
        at_sync[me] = held(t, sampler);
      };
      gradsync::run_threads(3, [&](Communicator<Threads>& comm) {
        if (sharded_trainer) {
          with_async_checkpointer<true>(comm, 7, [&](auto& t, DistributedSampler& s, auto& c) { body(comm, t, s, c); });
        } else {
          with_async_checkpointer<false>(comm, 7, [&](auto& t, DistributedSampler& s, auto& c) { body(comm, t, s, c); });
        }
      });
      for (const std::string& m : refused) CHECK(m.find("call its wait() first") != std::string::npos);
      const auto loaded = sharded_trainer ? load_held<true>(target, 7) : load_held<false>(target, 7);
      CHECK(loaded == at_sync);
    }
  }
  // A full checkpoint is a directory or a .safetensors file, not an index's name.
  TempDir dir;
  const auto messages = test::refusals_on_threads(2, [&](Communicator<Threads>& comm) {
    with_async_checkpointer<false>(comm, 1, [&](auto& t, DistributedSampler& sampler, auto& ckpt) {
      CHECK_THROWS_AS(ckpt.save(dir.path / "checkpoint.index.json"), gradsync::InvalidArgument);
      gradsync::save_checkpoint(t, sampler, dir.path / "checkpoint.index.json");
    });
  });
  for (const std::string& m : messages) CHECK(m.find("names a sharded checkpoint's index") != std::string::npos);
}

TEST_CASE("async save: the next save waits for the previous one, which it commits first") {
  TempDir dir;
  const fs::path target = dir.path / "ckpt";
  HookGuard guard;
  std::atomic<bool> calling_second{false};
  std::vector<std::string> committed_at_second(3);
  std::vector<int> released_before_return(3, 0);
  std::thread releaser;
  gradsync::run_threads(3, [&](Communicator<Threads>& comm) {
    const auto me = std::size_t(comm.rank());
    with_async_checkpointer<false>(comm, 3, [&](auto& t, DistributedSampler& sampler, auto& ckpt) {
      train(t, sampler, 1);
      if (me == 0) {
        hold_writes = true;
        // Lets the held write go only once rank 0 is calling the second save.
        releaser = std::thread([&] {
          while (!calling_second.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          released = true;
        });
      }
      comm.barrier();
      ckpt.save(target, {{"which", "first"}});
      train(t, sampler, 1);
      if (me == 0) calling_second = true;
      ckpt.save(target, {{"which", "second"}});
      released_before_return[me] = released.load();
      // The first save is committed before the second starts writing.
      committed_at_second[me] = gradsync::checkpoint_file(target).filename().string();
      ckpt.wait();
    });
  });
  releaser.join();
  for (int r : released_before_return) CHECK(r == 1);
  for (const std::string& f : committed_at_second) CHECK(f == "checkpoint-00000001.safetensors");
  CHECK(gradsync::checkpoint_file(target).filename() == "checkpoint-00000002.safetensors");
  // No operation of the second save comes before the first's commit.
  std::size_t first_commit = 0, second_start = 0;
  for (std::size_t i = 0; i < op_log.size(); ++i) {
    const auto& [op, path] = op_log[i];
    if (op == FileOp::rename && path.ends_with("checkpoint.commit") && first_commit == 0) first_commit = i + 1;
    if (path.find("checkpoint-00000002") != std::string::npos && second_start == 0) second_start = i + 1;
  }
  CHECK(first_commit > 0);
  CHECK(second_start > first_commit);
  std::string which;
  gradsync::run_threads(3, [&](Communicator<Threads>& comm) {
    auto t = make_trainer<false>(comm, 4);
    const auto meta = gradsync::load_checkpoint(t, target);
    if (comm.rank() == 0) which = meta.at("which");
  });
  CHECK(which == "second");
}

namespace {

using Outcome = test_checkpoint::SaveOutcome;
using test_checkpoint::save_outcome_of;

/// A background write that fails on rank `failing` (its `op` on its own
/// file) is a FileError on every rank, at wait() or at the next save; the
/// checkpoint saved before still loads, and a later save goes through.
template <bool Sharded>
void failing_write(int world, int failing, CheckpointFormat format, FileOp op, int err, bool at_next_save) {
  TempDir dir;
  const fs::path target = dir.path / "ckpt";
  HookGuard guard;
  std::vector<Outcome> got(static_cast<std::size_t>(world));
  std::vector<int> later_ok(static_cast<std::size_t>(world), 0);
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    const auto me = std::size_t(comm.rank());
    with_async_checkpointer<Sharded>(comm, 8, [&](auto& t, DistributedSampler& sampler, auto& ckpt) {
      train(t, sampler, 1);
      ckpt.save(target, {{"which", "A"}}, {.format = format});
      ckpt.wait();
      train(t, sampler, 1);
      if (me == 0) {
        const std::lock_guard<std::mutex> lock(log_mutex);
        fail_op = op;
        fail_path_part = format == CheckpointFormat::sharded
                             ? ck::shard_file_name("checkpoint", "00000002", failing, Sharded ? world : 1)
                             : "checkpoint-00000002.safetensors";
        fail_errno = err;
      }
      comm.barrier();
      ckpt.save(target, {{"which", "B"}}, {.format = format});
      train(t, sampler, 1);
      got[me] = save_outcome_of([&] {
        if (at_next_save) {
          ckpt.save(target, {{"which", "C"}}, {.format = format});
        } else {
          ckpt.wait();
        }
      });
      CHECK(!ckpt.pending());
      // Nothing of the failed save is committed: the directory loads A.
      auto fresh = make_trainer<Sharded>(comm, 9);
      CHECK(gradsync::load_checkpoint(fresh, target).at("which") == "A");
      // The failure was thrown once: the checkpointer takes the next save.
      ckpt.save(target, {{"which", "D"}}, {.format = format});
      ckpt.wait();
      later_ok[me] = 1;
    });
  });
  for (std::size_t r = 0; r < got.size(); ++r) {
    CAPTURE(r);
    CAPTURE(got[r].what);
    CHECK(got[r].type == "FileError");
    CHECK(got[r].os_error == err);
    CHECK(got[r].what.find("asynchronous save_checkpoint of '" + target.string() + "' failed on rank " +
                           std::to_string(failing)) != std::string::npos);
    CHECK(got[r].what.find(std::strerror(err)) != std::string::npos);
    CHECK(got[r].what.find(std::string(ck::detail::remedy(err))) != std::string::npos);
    CHECK(later_ok[r] == 1);
  }
  std::string which;
  gradsync::run_threads(1, [&](Communicator<Threads>& comm) {
    auto t = make_trainer<false>(comm, 4);
    which = gradsync::load_checkpoint(t, target).at("which");
  });
  CHECK(which == "D");
}

}  // namespace

TEST_CASE("async save: a failed background write is a FileError on every rank at wait() or the next save") {
  auto rng = test::rng_for("async failing write");
  MESSAGE("seed " << test::test_seed() << " (GRADSYNC_TEST_SEED replays)");
  CAPTURE(test::test_seed());
  const FileOp ops[] = {FileOp::create, FileOp::write, FileOp::sync, FileOp::rename};
  const int errors[] = {ENOSPC, EIO, EACCES, EROFS};
  for (int trial = 0; trial < 8; ++trial) {
    const int world = 3 + int(rng() % 3);
    const CheckpointFormat format = trial % 2 ? CheckpointFormat::sharded : CheckpointFormat::full;
    const bool sharded_trainer = trial % 4 >= 2;
    // A ShardedTrainer's ranks each write a shard file; a ReplicatedTrainer's rank 0 writes the one file.
    const int failing = sharded_trainer && format == CheckpointFormat::sharded ? int(rng() % std::uint64_t(world)) : 0;
    const FileOp op = ops[rng() % std::size(ops)];
    const int err = errors[rng() % std::size(errors)];
    const bool at_next_save = rng() % 2 == 0;
    CAPTURE(trial);
    CAPTURE(world);
    CAPTURE(failing);
    CAPTURE(std::string(format_name(format)));
    CAPTURE(std::string(ck::detail::op_name(op)));
    CAPTURE(err);
    CAPTURE(at_next_save);
    if (!sharded_trainer) {
      failing_write<false>(world, failing, format, op, err, at_next_save);
    } else {
      failing_write<true>(world, failing, format, op, err, at_next_save);
    }
  }
}

TEST_CASE("async save: with a memory_budget, a snapshot it leaves no room for is refused on every rank") {
  TempDir dir;
  // save() on each rank, then reserve().
  std::vector<Outcome> got(6);
  std::vector<std::size_t> snapshot(3);
  std::size_t need = 0;
  gradsync::run_threads(3, [&](Communicator<Threads>& comm) {
    ReplicatedTrainer probe(comm, Mlp<float>{layers, 2}, test_checkpoint::adam(), exact_replicated());
    if (comm.rank() == 0) need = probe.memory_need().total();
  });
  gradsync::run_threads(3, [&](Communicator<Threads>& comm) {
    const auto me = std::size_t(comm.rank());
    // Room for the trainer alone: rank 0's snapshot of the full file does not fit.
    gradsync::ReplicatedTrainerOptions o = exact_replicated();
    o.memory_budget = need;
    ReplicatedTrainer t(comm, Mlp<float>{layers, 2}, test_checkpoint::adam(), o);
    AsyncCheckpointer ckpt(t);
    t.step(test_train::make_batch<float>(me * 4, 4, in, out));
    got[me] = save_outcome_of([&] { ckpt.save(dir.path / "full"); });
    CHECK(!ckpt.pending());
    got[3 + me] = save_outcome_of([&] { ckpt.reserve(); });
    snapshot[me] = ckpt.snapshot_bytes();
  });
  for (const Outcome& o : got) {
    CAPTURE(o.what);
    CHECK(o.type == "InvalidArgument");
    CHECK(o.what.find("memory_budget") != std::string::npos);
    CHECK(o.what.find("failed on rank 0") != std::string::npos);
  }
  for (std::size_t s : snapshot) CHECK(s == 0);
  CHECK(!fs::exists(dir.path / "full"));
}

TEST_CASE("async save: a checkpointer destroyed before wait() commits nothing; the previous checkpoint loads") {
  TempDir dir;
  const fs::path target = dir.path / "ckpt";
  gradsync::run_threads(3, [&](Communicator<Threads>& comm) {
    auto t = make_trainer<true>(comm, 6);
    t.step(test_train::make_batch<float>(std::size_t(comm.rank()) * 4, 4, in, out));
    gradsync::save_checkpoint(t, target, {{"which", "A"}}, {.format = CheckpointFormat::sharded});
    {
      AsyncCheckpointer ckpt(t);
      ckpt.save(target, {{"which", "B"}}, {.format = CheckpointFormat::sharded});
    }
    comm.barrier();
    std::string which;
    auto fresh = make_trainer<true>(comm, 7);
    which = gradsync::load_checkpoint(fresh, target).at("which");
    CHECK(which == "A");
    // The next save commits and removes the uncommitted generation's files.
    gradsync::save_checkpoint(t, target, {{"which", "C"}}, {.format = CheckpointFormat::sharded});
    CHECK(gradsync::load_checkpoint(fresh, target).at("which") == "C");
  });
  for (const auto& e : fs::directory_iterator(target)) {
    const std::string n = e.path().filename().string();
    CAPTURE(n);
    CHECK((n == "checkpoint.commit" || n.starts_with("checkpoint-00000003")));
  }
}

}  // namespace test_train_checkpoint_async
