// Trainers that save checkpoints, for the trainers' kill test: a helper of
// test_train (`test_train --helper trainer_writer ARGS...`, support/helper_main.hpp).
//
//   trainer_writer write LAYOUT N DIR GEN [RANK K]   train GEN steps on N ranks (threads) and save
//       into DIR: LAYOUT full is a ReplicatedTrainer's full checkpoint, sharded a ShardedTrainer's
//       sharded one. With RANK K, SIGKILL the process just before rank RANK's K-th file operation
//       of the save. Prints "ops C0 C1 ..." (each rank's file operations) when the save completes.
//   trainer_writer write-async LAYOUT N DIR GEN [K]  the same with an AsyncCheckpointer: save, one more
//       step while the files are written, then wait(). With K, SIGKILL the process just before its
//       K-th file operation, on whichever thread (the background writers carry no rank, and their
//       order varies from run to run). Prints "ops C" (the process's file operations).
//   trainer_writer verify DIR...                     load each DIR into a ShardedTrainer at N = 3 and
//       check its parameters and Adam state bitwise against a run as long, on the trainer and N
//       that saved it (its metadata says which); print "DIR step S", or "DIR error MESSAGE" for a
//       DIR that does not load or differs
#include <atomic>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "gradsync/checkpoint/file_ops.hpp"
#include "gradsync/gradsync.hpp"
#include "gradsync/train/checkpoint/async_checkpointer.hpp"
#include "gradsync/train/checkpoint/sharded_checkpoint.hpp"

#include "../support/helper_main.hpp"

namespace trainer_writer {

namespace {

namespace fs = std::filesystem;
using Comm = gradsync::Communicator<gradsync::Threads>;

/// Two units of 5 and 7 elements (empty chunks at N = 3 and 4) and a loss that makes Adam move.
struct Model {
  using value_type = float;
  std::vector<gradsync::UnitSpec> units() const {
    return {{"a", {{"w", {5}}}, {}}, {"b", {{"w", {7}}}, {}}};
  }
  void bind(std::span<const gradsync::UnitView<float>> views) {
    float x = 0.25f;
    for (const auto& u : views)
      for (float& p : u.flat_params) p = (x += 0.5f);
  }
  double forward_backward(int step, const gradsync::StepContext<float>& ctx) {
    for (std::size_t u = 0; u < 2; ++u) (void)ctx.params(u);
    for (std::size_t u = 2; u-- > 0;) {
      const auto p = ctx.params(u);
      for (std::size_t i = 0; i < p->flat_params.size(); ++i) {
        p->flat_grads[i] += p->flat_params[i] - static_cast<float>((step + int(i)) % 3);
      }
      ctx.ready(u);
    }
    return 0;
  }
};

constexpr std::size_t unit_sizes[] = {5, 7};

using Sharded = gradsync::ShardedTrainer<Model, gradsync::Adam<float>, Comm>;
using Replicated = gradsync::ReplicatedTrainer<Model, gradsync::Adam<float>, Comm>;

gradsync::Adam<float> adam() { return gradsync::Adam<float>({.lr = 0.05}); }

Sharded sharded(Comm& comm) {
  gradsync::ShardedTrainerOptions o;
  o.collective.deterministic = true;
  return Sharded(comm, Model{}, adam(), o);
}

Replicated replicated(Comm& comm) {
  gradsync::ReplicatedTrainerOptions o;
  o.sync.collective.deterministic = true;
  return Replicated(comm, Model{}, adam(), o);
}

/// Runs `f(trainer, format)` on LAYOUT's trainer: full, a ReplicatedTrainer that saves full
/// files; sharded, a ShardedTrainer that saves sharded ones.
template <class F>
void with_trainer(const std::string& layout, Comm& comm, F f) {
  if (layout == "full") {
    Replicated t = replicated(comm);
    f(t, gradsync::CheckpointFormat::full);
  } else {
    Sharded t = sharded(comm);
    f(t, gradsync::CheckpointFormat::sharded);
  }
}

/// Per unit: parameters, then each Adam moment, gathered and unpadded.
std::vector<float> state(Sharded& t) {
  std::vector<float> all;
  const auto opt = t.optimizer().state();
  const auto shard = std::as_const(t).shard();
  for (std::size_t u = 0; u < t.unit_count(); ++u) {
    const std::size_t c = t.chunk_size(u), at = t.chunk_offset(u);
    std::vector<float> full(c * static_cast<std::size_t>(t.shard_count()));
    t.gather_chunk(u, shard.subspan(at, c), full);
    all.insert(all.end(), full.begin(), full.begin() + std::ptrdiff_t(t.unit_size(u)));
    for (const auto& b : opt.buffers) {
      t.gather_chunk(u, b.second.subspan(at, c), full);
      all.insert(all.end(), full.begin(), full.begin() + std::ptrdiff_t(t.unit_size(u)));
    }
  }
  return all;
}

/// The same order for a replica.
std::vector<float> state(Replicated& t) {
  std::vector<float> all;
  const auto opt = t.optimizer().state();
  const auto params = t.parameters();
  std::size_t at = 0;
  for (const std::size_t n : unit_sizes) {
    all.insert(all.end(), params.begin() + std::ptrdiff_t(at), params.begin() + std::ptrdiff_t(at + n));
    for (const auto& b : opt.buffers) {
      all.insert(all.end(), b.second.begin() + std::ptrdiff_t(at), b.second.begin() + std::ptrdiff_t(at + n));
    }
    at += n;
  }
  return all;
}

int kill_rank = -1;
long kill_at = -1;
thread_local int my_rank = -1;
thread_local long my_ops = 0;

int count_or_kill(gradsync::checkpoint::detail::FileOp op, const fs::path& path) {
  if (my_rank >= 0 && ++my_ops == kill_at && my_rank == kill_rank) {
    std::fprintf(stderr, "killed before rank %d's file operation %ld (%s '%s')\n", my_rank, my_ops,
                 gradsync::checkpoint::detail::op_name(op), path.c_str());
    std::fflush(stderr);
    std::raise(SIGKILL);
  }
  return 0;
}

std::atomic<long> process_ops{0};

int count_all_or_kill(gradsync::checkpoint::detail::FileOp op, const fs::path& path) {
  const long k = ++process_ops;
  if (k == kill_at) {
    std::fprintf(stderr, "killed before the process's file operation %ld (%s '%s')\n", k,
                 gradsync::checkpoint::detail::op_name(op), path.c_str());
    std::fflush(stderr);
    std::raise(SIGKILL);
  }
  return 0;
}

/// Saves as write() does, through an AsyncCheckpointer, with a step between the save and its wait().
int write_async(const std::string& layout, int n, const fs::path& dir, long gen) {
  gradsync::checkpoint::detail::file_op_hook = count_all_or_kill;
  gradsync::run_threads(n, [&](Comm& comm) {
    auto save = [&](auto& t, gradsync::CheckpointFormat format) {
      for (long s = 0; s < gen; ++s) t.step(int(s));
      gradsync::AsyncCheckpointer ckpt(t);
      ckpt.save(dir, {{"writer.layout", layout}, {"writer.n", std::to_string(n)}}, {.format = format});
      t.step(int(gen));
      ckpt.wait();
    };
    with_trainer(layout, comm, save);
  });
  std::printf("ops %ld\n", process_ops.load());
  return 0;
}

int write(const std::string& layout, int n, const fs::path& dir, long gen) {
  std::vector<long> ops(static_cast<std::size_t>(n));
  // Set before the ranks start: only the save does file operations, and only they are counted.
  gradsync::checkpoint::detail::file_op_hook = count_or_kill;
  gradsync::run_threads(n, [&](Comm& comm) {
    auto save = [&](auto& t, gradsync::CheckpointFormat format) {
      for (long s = 0; s < gen; ++s) t.step(int(s));
      my_rank = comm.rank();
      gradsync::save_checkpoint(t, dir, {{"writer.layout", layout}, {"writer.n", std::to_string(n)}},
                                {.format = format});
      ops[std::size_t(comm.rank())] = my_ops;
    };
    with_trainer(layout, comm, save);
  });
  std::printf("ops");
  for (long c : ops) std::printf(" %ld", c);
  std::printf("\n");
  return 0;
}

/// What LAYOUT's trainer holds after `steps` steps on n ranks.
std::vector<float> straight(const std::string& layout, int n, std::size_t steps) {
  std::vector<float> out;
  gradsync::run_threads(n, [&](Comm& comm) {
    with_trainer(layout, comm, [&](auto& t, gradsync::CheckpointFormat) {
      for (std::size_t s = 0; s < steps; ++s) t.step(int(s));
      const auto s = state(t);
      if (comm.rank() == 0) out = s;
    });
  });
  return out;
}

int verify(const std::vector<std::string>& dirs) {
  std::map<std::string, std::vector<float>> expected;
  for (const std::string& dir : dirs) {
    try {
      std::size_t at = 0;
      std::uint64_t opt_steps = 0;
      std::vector<float> loaded;
      gradsync::checkpoint::Metadata meta;
      gradsync::run_threads(3, [&](Comm& comm) {
        Sharded t = sharded(comm);
        const auto m = gradsync::load_checkpoint(t, dir);
        const auto s = state(t);
        if (comm.rank() == 0) loaded = s, at = t.step_count(), opt_steps = t.optimizer().state().steps, meta = m;
      });
      const std::string layout = meta.at("writer.layout"), n = meta.at("writer.n");
      const std::string key = layout + " " + n + " " + std::to_string(at);
      if (!expected.contains(key)) expected[key] = straight(layout, std::stoi(n), at);
      if (loaded != expected[key] || opt_steps != at) {
        throw gradsync::Error("the checkpoint at step " + std::to_string(at) + " holds other values than " + layout +
                              "'s trainer on " + n + " ranks");
      }
      std::printf("%s step %zu\n", dir.c_str(), at);
    } catch (const std::exception& e) {
      std::printf("%s error %s\n", dir.c_str(), e.what());
    }
  }
  return 0;
}

}  // namespace

int helper_main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if ((args.size() == 5 || args.size() == 7) && args[0] == "write") {
    if (args.size() == 7) kill_rank = std::stoi(args[5]), kill_at = std::stol(args[6]);
    return write(args[1], std::stoi(args[2]), args[3], std::stol(args[4]));
  }
  if ((args.size() == 5 || args.size() == 6) && args[0] == "write-async") {
    if (args.size() == 6) kill_at = std::stol(args[5]);
    return write_async(args[1], std::stoi(args[2]), args[3], std::stol(args[4]));
  }
  if (args.size() >= 2 && args[0] == "verify") return verify(std::vector<std::string>(args.begin() + 1, args.end()));
  std::fprintf(stderr, "usage: trainer_writer write full|sharded N DIR GEN [RANK K] | write-async full|sharded N DIR GEN [K] | "
                       "verify DIR...\n");
  return 2;
}

GRADSYNC_TEST_HELPER_REPORTING_EXCEPTIONS("trainer_writer", helper_main);

}  // namespace trainer_writer
