// A ShardedTrainer that saves sharded checkpoints, for the trainer's kill test.
//
//   sharded_trainer_writer write DIR GEN [KILL_AT]   train GEN steps at N = 2, save a sharded checkpoint
//       into DIR; with KILL_AT, SIGKILL the process at that I/O step of the save (either rank's)
//   sharded_trainer_writer verify DIR                load DIR at N = 3, check its parameters and Adam
//       state bitwise against a run of as many steps; print "step S"
#include <atomic>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>
#include <vector>

#include "gradsync/checkpoint/atomic_file.hpp"
#include "gradsync/gradsync.hpp"
#include "gradsync/train/sharded_checkpoint.hpp"

namespace {

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

using Trainer = gradsync::ShardedTrainer<Model, gradsync::Adam<float>, gradsync::Communicator<gradsync::Threads>>;

gradsync::ShardedTrainerOptions exact() {
  gradsync::ShardedTrainerOptions o;
  o.collective.deterministic = true;
  return o;
}

long kill_at = -1;
std::atomic<long> steps{0};

void step(const char* what) {
  if (++steps == kill_at) {
    std::fprintf(stderr, "killed at step %ld (%s)\n", kill_at, what);
    std::fflush(stderr);
    std::raise(SIGKILL);
  }
}

/// Parameters and both Adam moments, gathered and unpadded.
std::vector<float> state(Trainer& t) {
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

}  // namespace

int main(int argc, char** argv) try {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() >= 3 && args[0] == "write") {
    if (args.size() >= 4) kill_at = std::stol(args[3]);
    const long gen = std::stol(args[2]);
    // Set before the ranks start: only the save does I/O.
    gradsync::checkpoint::detail::io_step_hook = step;
    gradsync::run_threads(2, [&](gradsync::Communicator<gradsync::Threads>& comm) {
      Trainer t(comm, Model{}, gradsync::Adam<float>({.lr = 0.05}), exact());
      for (long s = 0; s < gen; ++s) t.step(int(s));
      gradsync::save_checkpoint(t, args[1], {}, {.format = gradsync::CheckpointFormat::sharded});
    });
    std::printf("steps %ld\n", steps.load());
    return 0;
  }
  if (args.size() == 2 && args[0] == "verify") {
    std::size_t at = 0;
    std::vector<float> loaded, straight;
    gradsync::run_threads(3, [&](gradsync::Communicator<gradsync::Threads>& comm) {
      Trainer t(comm, Model{}, gradsync::Adam<float>({.lr = 0.05}), exact());
      gradsync::load_checkpoint(t, args[1]);
      const auto s = state(t);
      if (comm.rank() == 0) loaded = s, at = t.step_count();
    });
    gradsync::run_threads(2, [&](gradsync::Communicator<gradsync::Threads>& comm) {
      Trainer t(comm, Model{}, gradsync::Adam<float>({.lr = 0.05}), exact());
      for (std::size_t s = 0; s < at; ++s) t.step(int(s));
      const auto s = state(t);
      if (comm.rank() == 0) straight = s;
    });
    if (loaded != straight) throw gradsync::Error("the checkpoint at step " + std::to_string(at) + " holds other values");
    std::printf("step %zu\n", at);
    return 0;
  }
  std::fprintf(stderr, "usage: sharded_trainer_writer write DIR GEN [KILL_AT] | verify DIR\n");
  return 2;
} catch (const std::exception& e) {
  std::fprintf(stderr, "sharded_trainer_writer: %s\n", e.what());
  return 1;
}
