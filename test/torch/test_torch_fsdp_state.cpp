// save_sharded_state_dict / load_sharded_state_dict for fully_shard modules
// and their optimizers: a save on N ranks loaded on M (4 → 3 with Adam,
// HybridShard 4 → 3 with momentum SGD, NoShard 2 → 3 with AdamW, 3 → 1 with
// momentum SGD) gives the saved full parameters and buffers and, with the
// optimizer, the same next step as going on from the save (a fresh
// optimizer's differs); a missing or corrupt shard file, a checkpoint
// without the optimizer state asked for, or a directory without a
// checkpoint, or ranks handed different checkpoints, fails every rank
// alike, with no wait and the module and optimizer unchanged.
//
// Every rank's result is collected and checked on the main thread after
// run_threads, so a failing rank never leaves the others waiting.

#include "torch_fsdp_support.hpp"

#include <gradsync/checkpoint/safetensors_reader.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

// Its own namespace: test/torch/meson.build compiles it in one translation
// unit with the other LibTorch test files (a unity build).
namespace test_torch_fsdp_state {

namespace {

using Comm = gradsync::Communicator<gradsync::Threads>;
using gradsync::ShardingStrategy;
using namespace test_torch;
using namespace test_torch_fsdp_support;

/// Rows of the global batch of 12 that rank `rank` of `n` trains on (12: every n in 1..4 divides it).
Data rows_of(const Data& d, int rank, int n) {
  const std::int64_t b = d.x.size(0) / n;
  return {d.x.narrow(0, rank * b, b), d.y.narrow(0, rank * b, b)};
}

/// A fresh directory under the temporary one, named by the seed and `what`.
std::filesystem::path fresh_dir(const std::string& what) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("gradsync_fsdp_sharded_" + what + "_" + std::to_string(test::test_seed()));
  std::filesystem::remove_all(dir);
  return dir;
}

/// Net from `init` (rank 0's, broadcast by wrapping) under `strategy`.
void make(gradsync::ShardedModule<Net>& m, Comm& comm, const std::vector<torch::Tensor>& init,
          ShardingStrategy strategy, int shard_size) {
  if (comm.rank() == 0) load_state(*m, init);
  gradsync::FullyShardOptions o;
  o.strategy = strategy;
  o.shard_size = shard_size;
  wrap(m, comm, o);
}

/// The step after the save or load: one step of `opt` on this rank's rows
/// of `d`, then the loss on all of `eval`.
torch::Tensor next_step_loss(gradsync::ShardedModule<Net>& m, Comm& comm, torch::optim::Optimizer& opt,
                             const Data& d, const Data& eval) {
  fit([&](const torch::Tensor& x) { return m(x); }, opt, rows_of(d, comm.rank(), comm.size()), 1);
  torch::NoGradGuard no_grad;
  return torch::nn::functional::cross_entropy(m(eval.x), eval.y).detach().reshape({1});
}

/// A whole test case's data: the training batch and the batch the next step's loss is taken on.
struct Batches {
  Data train, eval;
};

Batches batches() {
  Batches b{make_data(12, "fsdp sharded train"), make_data(10, "fsdp sharded eval")};
  b.train.x = b.train.x.to(torch::kDouble);
  b.eval.x = b.eval.x.to(torch::kDouble);
  return b;
}

/// `from` ranks under `strategy` train two steps of `kind` from `init` and
/// save the module and (`with_optimizer`) the optimizer to `dir`: each
/// rank's full state at the save, then its loss after one more step.
PerRank save_run(int from, ShardingStrategy strategy, int shard_size, const std::vector<torch::Tensor>& init,
                 const Batches& b, const std::filesystem::path& dir, bool with_optimizer = true, Opt kind = Opt::adam) {
  return run_ranks(from, [&](Comm& comm) {
    gradsync::ShardedModule<Net> m;
    make(m, comm, init, strategy, shard_size);
    auto opt = make_optimizer(kind, *m);
    fit([&](const torch::Tensor& x) { return m(x); }, *opt, rows_of(b.train, comm.rank(), comm.size()), 2);
    if (with_optimizer) {
      gradsync::save_sharded_state_dict(m, *opt, comm, dir);
    } else {
      gradsync::save_sharded_state_dict(m, comm, dir);
    }
    std::vector<torch::Tensor> out = values(gradsync::full_state_dict(m));
    out.push_back(next_step_loss(m, comm, *opt, b.train, b.eval));
    return out;
  });
}

/// Runs `load(m, opt, comm)` on `n` ranks, each with a FullShard Net from
/// `init` and a fresh Adam. Every rank must throw, within the deadline, an
/// error of class `kind` (as run_failing names it) whose message holds each
/// of `needles`, leaving its parameters (and, `with_buffers`, its buffers)
/// as they were and the optimizer without state.
template <class Load>
void check_refused_load_everywhere(int n, const std::vector<torch::Tensor>& init, bool with_buffers, Load load,
                                   const std::string& kind, const std::vector<std::string>& needles) {
  std::vector<int> unchanged(static_cast<std::size_t>(n), 0);
  const Outcomes got = run_failing(n, [&](Comm& comm) {
    gradsync::ShardedModule<Net> m;
    make(m, comm, init, ShardingStrategy::FullShard, 0);
    auto held = [&] {
      std::vector<torch::Tensor> out;
      for (const auto& t : m->parameters()) out.push_back(t.detach().clone());
      if (with_buffers) {
        for (const auto& t : m->buffers()) out.push_back(t.detach().clone());
      }
      return out;
    };
    const std::vector<torch::Tensor> mine = held();
    auto opt = make_optimizer(Opt::adam, *m);
    try {
      load(m, *opt, comm);
    } catch (...) {
      unchanged[static_cast<std::size_t>(comm.rank())] = bitwise_equal(held(), mine) && opt->state().empty() ? 1 : 0;
      throw;
    }
  });
  for (std::size_t r = 0; r < got.kind.size(); ++r) {
    CAPTURE(r);
    INFO(got.kind[r] << ": " << got.what[r]);
    CHECK(got.kind[r] == kind);
    for (const std::string& needle : needles) {
      INFO("needle: " << needle);
      CHECK(got.what[r].find(needle) != std::string::npos);
    }
    CHECK(unchanged[r] == 1);
  }
  CHECK(got.seconds < 5.0);
}

constexpr std::size_t tensors_in_net = 12;  // 10 parameters, the frozen scale among them, and the buffer

}  // namespace

TEST_CASE("load_sharded_state_dict at M ranks reads what save_sharded_state_dict wrote at N: the same full state "
          "and, with the optimizer's state, the same next step") {
  CAPTURE(test::test_seed());
  struct Case {
    int from;
    ShardingStrategy saved_with;
    int shard_size;
    int to;
    Opt opt;
  };
  const Batches b = batches();
  const auto init = initial_state("fsdp sharded init");
  const auto other = initial_state("fsdp sharded other init");
  for (const Case c : {Case{4, ShardingStrategy::FullShard, 0, 3, Opt::adam},
                       Case{4, ShardingStrategy::HybridShard, 2, 3, Opt::sgd_momentum},
                       Case{2, ShardingStrategy::NoShard, 0, 3, Opt::adamw},
                       Case{3, ShardingStrategy::FullShard, 0, 1, Opt::sgd_momentum}}) {
    CAPTURE(c.from);
    CAPTURE(gradsync::name(c.saved_with));
    CAPTURE(c.to);
    CAPTURE(opt_name(c.opt));
    const auto dir = fresh_dir("parity");
    const PerRank saved = save_run(c.from, c.saved_with, c.shard_size, init, b, dir, true, c.opt);
    for (const auto& e : saved.errors) REQUIRE(e == "");
    REQUIRE(saved.params[0].size() == tensors_in_net + 1);
    const std::vector<torch::Tensor> state_saved(saved.params[0].begin(), saved.params[0].begin() + tensors_in_net);
    const torch::Tensor loss_going_on = saved.params[0].back();

    // A model of other values on M ranks: what it holds before a load of
    // the module alone, after, and its loss after a step of a fresh optimizer.
    PerRank loaded = run_ranks(c.to, [&](Comm& comm) {
      gradsync::ShardedModule<Net> m;
      make(m, comm, other, ShardingStrategy::FullShard, 0);
      std::vector<torch::Tensor> out = values(gradsync::full_state_dict(m));
      gradsync::load_sharded_state_dict(m, comm, dir);
      const std::vector<torch::Tensor> after = values(gradsync::full_state_dict(m));
      out.insert(out.end(), after.begin(), after.end());
      auto fresh = make_optimizer(c.opt, *m);
      out.push_back(next_step_loss(m, comm, *fresh, b.train, b.eval));
      return out;
    });
    // And the module with its optimizer (no state yet): the step after is the one the save's ranks took.
    PerRank resumed = run_ranks(c.to, [&](Comm& comm) {
      gradsync::ShardedModule<Net> m;
      make(m, comm, other, ShardingStrategy::FullShard, 0);
      auto opt = make_optimizer(c.opt, *m);
      gradsync::load_sharded_state_dict(m, *opt, comm, dir);
      std::vector<torch::Tensor> out = values(gradsync::full_state_dict(m));
      out.push_back(next_step_loss(m, comm, *opt, b.train, b.eval));
      return out;
    });
    for (std::size_t r = 0; r < loaded.errors.size(); ++r) {
      CAPTURE(r);
      REQUIRE(loaded.errors[r] == "");
      REQUIRE(resumed.errors[r] == "");
      REQUIRE(loaded.params[r].size() == 2 * tensors_in_net + 1);
      REQUIRE(resumed.params[r].size() == tensors_in_net + 1);
      const std::vector<torch::Tensor> before(loaded.params[r].begin(), loaded.params[r].begin() + tensors_in_net);
      const std::vector<torch::Tensor> after(loaded.params[r].begin() + tensors_in_net,
                                             loaded.params[r].begin() + 2 * tensors_in_net);
      CHECK(max_relative(before, state_saved) > 0.01);  // the load had something to change
      CHECK(bitwise_equal(after, state_saved));
      const std::vector<torch::Tensor> with_optimizer(resumed.params[r].begin(),
                                                      resumed.params[r].begin() + tensors_in_net);
      CHECK(bitwise_equal(with_optimizer, state_saved));
      const double resumed_error = max_relative({resumed.params[r].back()}, {loss_going_on});
      const double fresh_error = max_relative({loaded.params[r].back()}, {loss_going_on});
      CAPTURE(resumed_error);
      CAPTURE(fresh_error);
      CHECK(resumed_error <= 1e-9);
      CHECK(fresh_error > 1e-6);  // the optimizer's state matters to that step: loading it is what matched it
    }
    std::filesystem::remove_all(dir);
  }
}

TEST_CASE("load_sharded_state_dict: a missing or corrupt shard file, a missing optimizer state or no checkpoint "
          "fails every rank alike and changes nothing") {
  CAPTURE(test::test_seed());
  const Batches b = batches();
  const auto init = initial_state("fsdp sharded bad init");
  const auto other = initial_state("fsdp sharded bad other init");
  const int to = 3;

  // Loads `dir` on `to` ranks; every rank must throw an error of class
  // `kind` holding `needle`, within the deadline, its own pieces untouched.
  auto check_refused_load = [&](const std::filesystem::path& dir, const std::string& kind, const std::string& needle,
                                bool with_optimizer = false) {
    check_refused_load_everywhere(
        to, other, /*with_buffers=*/true,
        [&](gradsync::ShardedModule<Net>& m, torch::optim::Optimizer& opt, Comm& comm) {
          if (with_optimizer) {
            gradsync::load_sharded_state_dict(m, opt, comm, dir);
          } else {
            gradsync::load_sharded_state_dict(m, comm, dir);
          }
        },
        kind == "InvalidArgument" ? "InvalidArgument" : "other",
        {"load_sharded_state_dict from '" + dir.string() + "' failed on rank ", needle});
  };

  SUBCASE("a shard file removed") {
    const auto dir = fresh_dir("missing");
    const PerRank saved = save_run(4, ShardingStrategy::FullShard, 0, init, b, dir);
    for (const auto& e : saved.errors) REQUIRE(e == "");
    const std::string file = "checkpoint-00000001-rank00001-of-00004.safetensors";
    REQUIRE(std::filesystem::remove(dir / file));
    check_refused_load(dir, "Error", file);
    std::filesystem::remove_all(dir);
  }
  SUBCASE("a byte of a shard file's data changed") {
    const auto dir = fresh_dir("corrupt");
    const PerRank saved = save_run(4, ShardingStrategy::FullShard, 0, init, b, dir);
    for (const auto& e : saved.errors) REQUIRE(e == "");
    const auto path = dir / "checkpoint-00000001-rank00002-of-00004.safetensors";
    // A byte of the file's first piece of a parameter (the load below reads
    // no optimizer state, so a byte of that would go unread).
    std::uint64_t at = 0;
    {
      const gradsync::checkpoint::SafetensorsReader reader(path);
      for (const auto& e : reader.tensors()) {
        if (at == 0 && e.spec.name.starts_with("b1.") && e.spec.bytes() > 0) at = e.offset + e.spec.bytes() / 2;
      }
    }
    REQUIRE(at > 0);
    {
      std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(static_cast<std::streamoff>(at));
      char c = 0;
      f.read(&c, 1);
      c = static_cast<char>(c ^ 0x5a);
      f.seekp(static_cast<std::streamoff>(at));
      f.write(&c, 1);
    }
    check_refused_load(dir, "Error", "rank00002-of-00004");
    std::filesystem::remove_all(dir);
  }
  SUBCASE("a checkpoint without the optimizer's state, loaded with an optimizer") {
    const auto dir = fresh_dir("no_optimizer");
    const PerRank saved = save_run(2, ShardingStrategy::FullShard, 0, init, b, dir, /*with_optimizer=*/false);
    for (const auto& e : saved.errors) REQUIRE(e == "");
    check_refused_load(dir, "InvalidArgument", "has no tensor 'optimizer.b1.a.weight.exp_avg'", true);
    std::filesystem::remove_all(dir);
  }
  SUBCASE("a directory without a checkpoint") {
    const auto dir = fresh_dir("empty");
    std::filesystem::create_directories(dir);
    check_refused_load(dir, "Error", "holds no checkpoint");
    std::filesystem::remove_all(dir);
  }
}

TEST_CASE("load_sharded_state_dict: ranks handed two runs' checkpoints fail every rank and load nothing") {
  // Alike in names, shapes and layout: only the values tell the two saves apart.
  CAPTURE(test::test_seed());
  auto rng = test::rng_for("fsdp sharded two runs");
  const Batches b = batches();
  const auto one = fresh_dir("run_one"), two = fresh_dir("run_two");
  for (const auto& [dir, seed] : {std::pair{one, "fsdp sharded run one"}, std::pair{two, "fsdp sharded run two"}}) {
    const PerRank saved = save_run(3, ShardingStrategy::FullShard, 0, initial_state(seed), b, dir);
    for (const auto& e : saved.errors) REQUIRE(e == "");
  }
  const int n = 3, odd = static_cast<int>(rng() % n);
  CAPTURE(odd);
  const auto init = initial_state("fsdp sharded two runs init");
  check_refused_load_everywhere(
      n, init, /*with_buffers=*/false,
      [&](gradsync::ShardedModule<Net>& m, torch::optim::Optimizer& opt, Comm& comm) {
        gradsync::load_sharded_state_dict(m, opt, comm, comm.rank() == odd ? two : one);
      },
      "InvalidArgument", {"the ranks read different checkpoints: rank(s) "});
  std::filesystem::remove_all(one);
  std::filesystem::remove_all(two);
}

TEST_CASE("save_sharded_state_dict between a forward and its backward is refused on every rank, naming the unit") {
  CAPTURE(test::test_seed());
  const Batches b = batches();
  const auto init = initial_state("fsdp sharded gathered init");
  const int n = 2;
  const auto dir = fresh_dir("gathered");
  // ShardGradOp keeps a unit gathered from its forward to its backward.
  const Outcomes got = run_failing(n, [&](Comm& comm) {
    gradsync::ShardedModule<Net> m;
    make(m, comm, init, ShardingStrategy::ShardGradOp, 0);
    const torch::Tensor out = m(rows_of(b.train, comm.rank(), n).x);
    gradsync::save_sharded_state_dict(m, comm, dir);
  });
  for (std::size_t r = 0; r < got.kind.size(); ++r) {
    CAPTURE(r);
    INFO(got.kind[r] << ": " << got.what[r]);
    CHECK(got.kind[r] == "InvalidArgument");
    CHECK(got.what[r].find("holds its gathered parameters (between a forward and its backward); save or load "
                           "between steps") != std::string::npos);
  }
  CHECK(got.seconds < 5.0);
  CHECK(!std::filesystem::exists(dir));  // refused before rank 0 made the directory
}

}  // namespace test_torch_fsdp_state
