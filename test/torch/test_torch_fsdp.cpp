// fully_shard for LibTorch modules: parity with one process on the
// concatenated batch and with DistributedDataParallel for each strategy and
// optimizer, unit sizes N does not divide, a frozen parameter and a buffer,
// the shards the optimizer sees, and wrong use refused on every rank.
//
// Every rank's result is collected and checked on the main thread after
// run_threads, so a failing rank never leaves the others waiting.

#include "torch_fsdp_support.hpp"
#include "../support/temp_dir.hpp"

#include <gradsync/checkpoint/safetensors_reader.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

// Its own namespace: test/torch/meson.build compiles it in one translation
// unit with the other LibTorch test files (a unity build).
namespace test_torch_fsdp {

namespace {

using Comm = gradsync::Communicator<gradsync::Threads>;
using gradsync::ShardingStrategy;
using namespace test_torch;
using namespace test_torch_fsdp_support;

Data rank_rows(const Data& d, int rank, std::int64_t b) {
  return {d.x.narrow(0, rank * b, b), d.y.narrow(0, rank * b, b)};
}

/// Every rank of a run meant to fail threw InvalidArgument holding `needle`, within 5 s.
void check_failed_everywhere(const Outcomes& got, const std::string& needle) {
  for (std::size_t r = 0; r < got.kind.size(); ++r) {
    INFO("rank " << r << ": " << got.kind[r] << ": " << got.what[r]);
    CHECK(got.kind[r] == "InvalidArgument");
    CHECK(got.what[r].find(needle) != std::string::npos);
  }
  CHECK(got.seconds < 5.0);
}

/// Every rank's error holds every one of `needles`.
void check_refused(const PerRank& got, const std::vector<std::string>& needles) {
  for (const auto& e : got.errors) {
    CAPTURE(e);
    for (const auto& needle : needles) CHECK(e.find(needle) != std::string::npos);
  }
}

/// Two wrapped blocks that keep the width, so a forward may skip the second.
struct SkipNetImpl : torch::nn::Module {
  SkipNetImpl()
      : b1(register_module("b1", Block(12, 7, 12))),
        b2(register_module("b2", Block(12, 5, 12))),
        head(register_module("head", torch::nn::Linear(12, 5))) {}
  torch::Tensor forward(torch::Tensor x, bool skip) { return head(skip ? b1(x) : b2(b1(x))); }
  gradsync::ShardedModule<Block> b1, b2;
  torch::nn::Linear head;
};
TORCH_MODULE(SkipNet);

/// Every rank returned alike, within 1e-5 (relative) of one process and of DistributedDataParallel.
void check_parity(const PerRank& got, const std::vector<torch::Tensor>& expected,
                  const std::vector<torch::Tensor>& ddp) {
  for (std::size_t r = 0; r < got.errors.size(); ++r) {
    CAPTURE(r);
    REQUIRE(got.errors[r] == "");
    CHECK(bitwise_equal(got.params[r], got.params[0]));
  }
  const double error = max_relative(got.params[0], expected);
  const double from_ddp = max_relative(got.params[0], ddp);
  CAPTURE(error);
  CAPTURE(from_ddp);
  CHECK(error <= 1e-5);
  CHECK(from_ddp <= 1e-5);
}

/// One process on all of `d`, `steps` steps of `opt` from `init`: the state it ends in.
std::vector<torch::Tensor> alone_state(const std::vector<torch::Tensor>& init, Opt opt, const Data& d, int steps) {
  Net alone;
  load_state(*alone, init);
  auto alone_opt = make_optimizer(opt, *alone);
  fit([&](const torch::Tensor& x) { return alone->forward(x); }, *alone_opt, d, steps);
  return state(*alone);
}

/// One process on all of `d`, its gradient clipped to max_norm every step:
/// the norms before clipping, and (into `expected`) the state it ends in.
std::vector<double> clipped_alone(const std::vector<torch::Tensor>& init, Opt opt, const Data& d, int steps,
                                  double max_norm, std::vector<torch::Tensor>& expected) {
  Net alone;
  load_state(*alone, init);
  auto alone_opt = make_optimizer(opt, *alone);
  std::vector<double> norms;
  for (int s = 0; s < steps; ++s) {
    alone_opt->zero_grad();
    torch::nn::functional::cross_entropy(alone->forward(d.x), d.y).backward();
    norms.push_back(torch::nn::utils::clip_grad_norm_(alone->parameters(), max_norm));
    alone_opt->step();
  }
  expected = state(*alone);
  return norms;
}

/// The wrapped `m` trained on this rank's rows `mine`, clipped by
/// gradsync::clip_grad_norm_ every step (its norms into `seen`): the full state it ends in.
std::vector<torch::Tensor> fit_clipped(gradsync::ShardedModule<Net>& m, Comm& comm, Opt opt, const Data& mine,
                                       int steps, double max_norm, std::vector<double>& seen) {
  auto o = make_optimizer(opt, *m);
  for (int s = 0; s < steps; ++s) {
    o->zero_grad();
    torch::nn::functional::cross_entropy(m(mine.x), mine.y).backward();
    seen.push_back(gradsync::clip_grad_norm_(m, comm, max_norm));
    o->step();
  }
  return values(gradsync::full_state_dict(m));
}

/// DistributedDataParallel on `n` ranks from rank 0's `init`, trained by
/// `train(dp, module, optimizer, comm)`: every rank's state at the end.
template <class Train>
PerRank ddp_ranks(int n, const std::vector<torch::Tensor>& init, Opt opt, Train train) {
  PerRank got = run_ranks(n, [&](Comm& comm) {
    Net m;
    if (comm.rank() == 0) load_state(*m, init);
    gradsync::DistributedDataParallel dp(comm, m);
    auto o = make_optimizer(opt, *m);
    train(dp, *m, *o, comm);
    return state(*m);
  });
  REQUIRE(got.errors[0] == "");
  return got;
}

/// Every rank wraps a Net's b1 with the options `set(options, rank)` makes.
template <class Set>
PerRank wrap_b1_with(int n, Set set) {
  return run_ranks(n, [&](Comm& comm) {
    gradsync::ShardedModule<Net> m;
    gradsync::FullyShardOptions o;
    set(o, comm.rank());
    gradsync::fully_shard(m->b1, comm, o);
    return std::vector<torch::Tensor>{};
  });
}

std::int64_t numel(const std::vector<torch::Tensor>& ts) {
  std::int64_t n = 0;
  for (const auto& t : ts) n += t.numel();
  return n;
}

/// The cases where one rank of 3 misbehaves: which rank, and in which step
/// (counted from 1: the first or the second).
struct OneRankFault {
  static constexpr int world = 3;
  static constexpr std::int64_t rows = 4;  ///< each rank's rows of the data
  int rank = 0, step = 0;
};

/// A OneRankFault drawn from the test seed's stream `seed_name`.
OneRankFault draw_fault(const char* seed_name) {
  auto rng = test::rng_for(seed_name);
  const int odd = static_cast<int>(rng() % OneRankFault::world);
  const int bad = 1 + static_cast<int>(rng() % 2);
  return {.rank = odd, .step = bad};
}

/// Runs `body(strategy)` for FullShard, ShardGradOp and NoShard; a failure
/// names the strategy.
template <class Body>
void each_strategy(Body body) {
  for (const ShardingStrategy strategy :
       {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp, ShardingStrategy::NoShard}) {
    const std::string strategy_name = gradsync::name(strategy);
    CAPTURE(strategy_name);
    body(strategy);
  }
}

/// Under FullShard, ShardGradOp and NoShard: each rank wraps a `Module` by
/// `shard(m, comm, options)` and trains it on its rows of `d` with momentum
/// SGD, through the step after `fault.step`, `step(m, mine, misbehave)`
/// running each forward and backward. Every rank must fail naming `needle`.
template <class Module, class Shard, class Step>
void fails_everywhere(const OneRankFault& fault, const Data& d, const std::string& needle, Shard shard, Step step) {
  each_strategy([&](ShardingStrategy strategy) {
    const Outcomes got = run_failing(OneRankFault::world, [&](Comm& comm) {
      gradsync::ShardedModule<Module> m;
      gradsync::FullyShardOptions o;
      o.strategy = strategy;
      shard(m, comm, o);
      auto opt = make_optimizer(Opt::sgd_momentum, *m);
      const Data mine = rank_rows(d, comm.rank(), OneRankFault::rows);
      for (int s = 1; s <= fault.step + 1; ++s) {
        opt->zero_grad();
        step(m, mine, comm.rank() == fault.rank && s == fault.step);
        opt->step();
      }
    });
    check_failed_everywhere(got, needle);
  });
}

}  // namespace

TEST_CASE("fully_shard: every strategy and optimizer matches one process on the N·b batch and "
          "DistributedDataParallel, with shards of 1/N") {
  CAPTURE(test::test_seed());
  const std::int64_t b = 5;  // per rank; odd on purpose
  const int steps = 20;
  const auto init = initial_state("fsdp parity init");
  // Unit sizes: b1 323, b2 208, the root 55 + 10 (frozen scale).
  const std::vector<std::int64_t> units{323, 208, 65};
  for (const Opt opt : {Opt::sgd_momentum, Opt::adam, Opt::adamw}) {
    const std::string optimizer = opt_name(opt);
    CAPTURE(optimizer);
    for (int n : {1, 2, 3, 4}) {
      CAPTURE(n);
      Data d = make_data(n * b, "fsdp parity data");
      d.x = d.x.to(torch::kDouble);
      const std::vector<torch::Tensor> expected = alone_state(init, opt, d, steps);

      PerRank ddp = ddp_ranks(n, init, opt, [&](auto& dp, NetImpl& /*m*/, torch::optim::Optimizer& o, Comm& comm) {
        fit([&](const torch::Tensor& x) { return dp(x); }, o, rank_rows(d, comm.rank(), b), steps);
      });

      each_strategy([&](ShardingStrategy strategy) {
        std::vector<std::int64_t> local(static_cast<std::size_t>(n));
        std::vector<std::size_t> bytes(static_cast<std::size_t>(n));
        PerRank got = run_ranks(n, [&](Comm& comm) {
          gradsync::ShardedModule<Net> m;
          // Only rank 0 starts from the reference: wrapping must broadcast it.
          load_and_wrap(m, comm, init, strategy);
          local[static_cast<std::size_t>(comm.rank())] = numel(m->parameters());
          bytes[static_cast<std::size_t>(comm.rank())] = gradsync::fully_shard_persistent_bytes(m);
          auto optimizer_ = make_optimizer(opt, *m);
          fit([&](const torch::Tensor& x) { return m(x); }, *optimizer_, rank_rows(d, comm.rank(), b), steps);
          return values(gradsync::full_state_dict(m));
        });
        for (int r = 0; r < n; ++r) {
          CAPTURE(r);
          const auto ru = static_cast<std::size_t>(r);
          REQUIRE(got.errors[ru] == "");
          CHECK(bitwise_equal(got.params[ru], got.params[0]));
          // Between steps each rank's parameters are its pieces of the
          // padded shards: together the whole model, each at most ⌈P/N⌉ a unit.
          std::int64_t most = 0;
          for (std::int64_t p : units) most += strategy == ShardingStrategy::NoShard ? p : (p + n - 1) / n;
          CHECK(local[ru] <= most);
          // Parameters and gradients: twice each unit's padded shard, in double.
          CHECK(bytes[ru] == 2 * static_cast<std::size_t>(most) * sizeof(double));
        }
        std::int64_t total = 0;
        for (std::int64_t l : local) total += l;
        CHECK(total == (strategy == ShardingStrategy::NoShard ? n : 1) * (323 + 208 + 65));
        const double error = max_relative(got.params[0], expected);
        const double from_ddp = max_relative(got.params[0], ddp.params[0]);
        CAPTURE(error);
        CAPTURE(from_ddp);
        CHECK(error <= 1e-5);
        CHECK(from_ddp <= 1e-5);
      });
    }
  }
}

TEST_CASE("fully_shard: K micro-batches under no_sync match one step on the K·N·b batch and "
          "DistributedDataParallel's no_sync, every strategy") {
  CAPTURE(test::test_seed());
  const std::int64_t b = 2;  // per rank and micro-batch
  const int k = 3, steps = 2;
  const auto init = initial_state("fsdp no_sync init");
  for (const Opt opt : {Opt::sgd_momentum, Opt::adam}) {
    const std::string optimizer = opt_name(opt);
    CAPTURE(optimizer);
    for (int n : {1, 2, 3, 4}) {
      CAPTURE(n);
      Data d = make_data(static_cast<std::int64_t>(n) * k * b, "fsdp no_sync data");
      d.x = d.x.to(torch::kDouble);
      const std::vector<torch::Tensor> expected = alone_state(init, opt, d, steps);

      // Each step: K − 1 backwards under `guard()`, then a synced one; rank
      // r's micro-batch i is rows (i·N + r)·b, so together they are the
      // batch, and 1/K makes the micro-losses' sum its mean.
      auto train = [&](auto& forward, auto guard, torch::optim::Optimizer& o, int rank) {
        auto micro = [&](int i) {
          const std::int64_t first = (static_cast<std::int64_t>(i) * n + rank) * b;
          (torch::nn::functional::cross_entropy(forward(d.x.narrow(0, first, b)), d.y.narrow(0, first, b)) / k)
              .backward();
        };
        for (int s = 0; s < steps; ++s) {
          o.zero_grad();
          {
            auto g = guard();
            for (int i = 0; i + 1 < k; ++i) micro(i);
          }
          micro(k - 1);
          o.step();
        }
      };
      PerRank ddp = ddp_ranks(n, init, opt, [&](auto& dp, NetImpl& /*m*/, torch::optim::Optimizer& o, Comm& comm) {
        auto forward = [&](const torch::Tensor& x) { return dp(x); };
        train(forward, [&] { return dp.no_sync(); }, o, comm.rank());
      });

      each_strategy([&](ShardingStrategy strategy) {
        PerRank got = run_ranks(n, [&](Comm& comm) {
          gradsync::ShardedModule<Net> m;
          load_and_wrap(m, comm, init, strategy);
          auto o = make_optimizer(opt, *m);
          auto forward = [&](const torch::Tensor& x) { return m(x); };
          train(forward, [&] { return gradsync::no_sync(m); }, *o, comm.rank());
          return values(gradsync::full_state_dict(m));
        });
        check_parity(got, expected, ddp.params[0]);
      });
    }
  }
}

TEST_CASE("fully_shard: one rank's backward under no_sync while the others sync fails every rank, naming both") {
  CAPTURE(test::test_seed());
  const OneRankFault fault = draw_fault("fsdp no_sync on one rank");
  INFO("rank " << fault.rank << " runs backward " << fault.step << " under no_sync");
  Data d = make_data(OneRankFault::world * OneRankFault::rows, "fsdp no_sync on one rank data");
  d.x = d.x.to(torch::kDouble);
  // b2 (unit 1) reduces first in backward: the root's unit, whose input
  // needs no gradient, is finished last, by the engine's callback.
  const std::string first = "backward " + std::to_string(fault.step) + ", gradient reduction of fully_shard unit 1";
  fails_everywhere<Net>(
      fault, d, first, [](auto& m, Comm& comm, const gradsync::FullyShardOptions& o) { wrap(m, comm, o); },
      [](auto& m, const Data& mine, bool misbehave) {
        auto backward = [&] { torch::nn::functional::cross_entropy(m(mine.x), mine.y).backward(); };
        if (misbehave) {
          auto guard = gradsync::no_sync(m);
          backward();
        } else {
          backward();
        }
      });
}

TEST_CASE("fully_shard: HybridShard over groups of shard_size ranks matches DistributedDataParallel and one "
          "process, clip_grad_norm_ included") {
  CAPTURE(test::test_seed());
  const std::int64_t b = 3;
  const int steps = 6;
  const double max_norm = 0.05;  // small enough that every step clips
  const auto init = initial_state("fsdp hybrid init");
  // {N, shard_size}: two groups of two, and groups of one (every rank a replica).
  for (const auto& [n, s] : {std::pair{4, 2}, std::pair{2, 1}}) {
    CAPTURE(n);
    CAPTURE(s);
    Data d = make_data(n * b, "fsdp hybrid data");
    d.x = d.x.to(torch::kDouble);
    std::vector<torch::Tensor> expected;
    const std::vector<double> norms = clipped_alone(init, Opt::adam, d, steps, max_norm, expected);
    PerRank ddp = ddp_ranks(n, init, Opt::adam, [&](auto& dp, NetImpl& m, torch::optim::Optimizer& o, Comm& comm) {
      const Data mine = rank_rows(d, comm.rank(), b);
      for (int step = 0; step < steps; ++step) {
        o.zero_grad();
        torch::nn::functional::cross_entropy(dp(mine.x), mine.y).backward();
        torch::nn::utils::clip_grad_norm_(m.parameters(), max_norm);
        o.step();
      }
    });
    std::vector<std::vector<double>> seen(static_cast<std::size_t>(n));
    std::vector<std::int64_t> local(static_cast<std::size_t>(n));
    PerRank got = run_ranks(n, [&](Comm& comm) {
      gradsync::ShardedModule<Net> m;
      if (comm.rank() == 0) load_state(*m, init);
      gradsync::FullyShardOptions o;
      o.strategy = ShardingStrategy::HybridShard;
      o.shard_size = s;
      wrap(m, comm, o);
      local[static_cast<std::size_t>(comm.rank())] = numel(m->parameters());
      return fit_clipped(m, comm, Opt::adam, rank_rows(d, comm.rank(), b), steps, max_norm,
                         seen[static_cast<std::size_t>(comm.rank())]);
    });
    std::int64_t most = 0;
    for (std::int64_t p : {323, 208, 65}) most += (p + s - 1) / s;
    check_parity(got, expected, ddp.params[0]);
    for (std::size_t r = 0; r < seen.size(); ++r) {
      CAPTURE(r);
      CHECK(local[r] <= most);  // a shard of 1/shard_size
      for (std::size_t step = 0; step < norms.size() && step < seen[r].size(); ++step) {
        CAPTURE(step);
        CHECK(std::abs(seen[r][step] - norms[step]) <= 1e-9 * norms[step]);
      }
    }
  }
}

TEST_CASE("fully_shard: a forward that skips a unit on one rank fails every rank naming the unit, with no wait") {
  CAPTURE(test::test_seed());
  const OneRankFault fault = draw_fault("fsdp skipped unit");
  INFO("rank " << fault.rank << " skips b2 in step " << fault.step);
  const Data d = make_data(OneRankFault::world * OneRankFault::rows, "fsdp skipped unit data");
  // b2 is the second unit wrapped: index 1.
  const std::string b2 =
      "fully_shard unit 1 ('test_torch_fsdp_support::BlockImpl' (a.weight [5 x 12], a.bias [5], …))";
  fails_everywhere<SkipNet>(
      fault, d, b2,
      [](auto& m, Comm& comm, const gradsync::FullyShardOptions& o) {
        gradsync::fully_shard(m->b1, comm, o);
        gradsync::fully_shard(m->b2, comm, o);
        gradsync::fully_shard(m, comm, o);
      },
      [](auto& m, const Data& mine, bool misbehave) {
        torch::nn::functional::cross_entropy(m(mine.x, misbehave), mine.y).backward();
      });
}

TEST_CASE("fully_shard: param_dtype bfloat16 trains close to float, the shards and their gradients staying float") {
  CAPTURE(test::test_seed());
  const int n = 2, steps = 8;
  const std::int64_t b = 6;
  auto rng = test::rng_for("fsdp mixed precision init");
  torch::manual_seed(rng());
  std::vector<torch::Tensor> init = state(*SkipNet());
  const Data d = make_data(n * b, "fsdp mixed precision data");
  for (const ShardingStrategy strategy : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp}) {
    const std::string strategy_name = gradsync::name(strategy);
    CAPTURE(strategy_name);
    for (const bool reduce_bf16 : {false, true}) {
      CAPTURE(reduce_bf16);
      std::vector<int> float_checks(n, 0);
      auto run = [&](bool mixed) {
        return run_ranks(n, [&](Comm& comm) {
          gradsync::ShardedModule<SkipNet> m;
          load_state(*m, init);
          gradsync::FullyShardOptions o;
          o.strategy = strategy;
          if (mixed) o.param_dtype = torch::kBFloat16;
          if (mixed && reduce_bf16) o.reduce_dtype = torch::kBFloat16;
          gradsync::fully_shard(m->b1, comm, o);
          gradsync::fully_shard(m->b2, comm, o);
          gradsync::fully_shard(m, comm, o);
          auto opt = make_optimizer(Opt::sgd_momentum, *m);
          const Data mine = rank_rows(d, comm.rank(), b);
          const auto dtype = mixed ? torch::kBFloat16 : torch::kFloat;
          auto& checks = float_checks[static_cast<std::size_t>(comm.rank())];
          for (int s = 0; s < steps; ++s) {
            opt->zero_grad();
            const torch::Tensor out = m(mine.x.to(dtype), false);
            if (out.scalar_type() != dtype) {
              throw gradsync::InvalidArgument(std::string("the forward ran in ") + c10::toString(out.scalar_type()));
            }
            torch::nn::functional::cross_entropy(out.to(torch::kFloat), mine.y).backward();
            // What the optimizer steps: float pieces of the shard, float gradients.
            for (const torch::Tensor& p : m->parameters()) {
              if (p.scalar_type() != torch::kFloat || !p.grad().defined() || p.grad().scalar_type() != torch::kFloat ||
                  p.dim() != 1) {
                throw gradsync::InvalidArgument("a parameter between steps is not a float piece with a float gradient");
              }
              ++checks;
            }
            opt->step();
          }
          return values(gradsync::full_state_dict(m));
        });
      };
      const PerRank full = run(false);
      const PerRank mixed = run(true);
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        REQUIRE(full.errors[static_cast<std::size_t>(r)] == "");
        REQUIRE(mixed.errors[static_cast<std::size_t>(r)] == "");
        CHECK(float_checks[static_cast<std::size_t>(r)] > 0);
        CHECK(bitwise_equal(mixed.params[static_cast<std::size_t>(r)], mixed.params[0]));
        for (const torch::Tensor& t : mixed.params[static_cast<std::size_t>(r)]) {
          CHECK((t.scalar_type() == torch::kFloat));
        }
      }
      // bfloat16 keeps 8 bits of mantissa (relative rounding 2^-9 ≈ 2e-3 per
      // value); over 8 SGD steps the weights stay within 1% of float's.
      const double error = relative(mixed.params[0], full.params[0]);
      CAPTURE(error);
      CHECK(error > 0);
      CHECK(error <= 1e-2);
    }
  }
}

TEST_CASE("fully_shard: FullShard frees a unit after its forward, ShardGradOp after its backward, NoShard never") {
  CAPTURE(test::test_seed());
  const int n = 3;
  // b1.a.weight is 13 x 12, the first 156 of b1's 323 elements; a rank's
  // shard is ⌈323/3⌉ = 108 of them: rank 0 holds 108 of the weight, rank 1
  // 48, rank 2 none.
  struct Seen {
    std::vector<std::int64_t> before, after_forward, after_backward, grad;
    /// What b1's gathered parameters hold, in bytes, at each point.
    std::vector<std::size_t> gathered;
  };
  each_strategy([&](ShardingStrategy strategy) {
    std::vector<Seen> seen(static_cast<std::size_t>(n));
    PerRank got = run_ranks(n, [&](Comm& comm) {
      gradsync::ShardedModule<Net> m;
      gradsync::FullyShardOptions o;
      o.strategy = strategy;
      wrap(m, comm, o);
      Seen& s = seen[static_cast<std::size_t>(comm.rank())];
      const torch::Tensor& w = m->b1->a->weight;
      const auto unit = gradsync::detail::find_torch_unit(m->b1.ptr().get());
      s.gathered.push_back(unit->gathered_bytes());
      s.before = w.sizes().vec();
      Data d = make_data(4, "fsdp lifecycle data");
      d.x = d.x.to(torch::kDouble);
      torch::Tensor loss = torch::nn::functional::cross_entropy(m(d.x), d.y);
      s.after_forward = w.sizes().vec();
      s.gathered.push_back(unit->gathered_bytes());
      loss.backward();
      s.after_backward = w.sizes().vec();
      s.gathered.push_back(unit->gathered_bytes());
      s.grad = w.grad().defined() ? w.grad().sizes().vec() : std::vector<std::int64_t>{-1};
      return std::vector<torch::Tensor>{};
    });
    const std::vector<std::vector<std::int64_t>> pieces{{108}, {48}, {0}};
    const std::vector<std::int64_t> full{13, 12};
    for (std::size_t r = 0; r < seen.size(); ++r) {
      CAPTURE(r);
      REQUIRE(got.errors[r] == "");
      const bool sharded = strategy != ShardingStrategy::NoShard;
      CHECK(seen[r].before == (sharded ? pieces[r] : full));
      // ShardGradOp keeps the gathered bytes for the backward (below), but
      // its parameters are their pieces in between: an optimizer step there
      // steps the shard, never the copy.
      CHECK(seen[r].after_forward == (sharded ? pieces[r] : full));
      CHECK(seen[r].after_backward == (sharded ? pieces[r] : full));
      // The gradient matches the piece the optimizer steps on.
      CHECK(seen[r].grad == seen[r].after_backward);
      // The freeing is real: b1's full buffer (3 · 108 doubles) has no bytes while sharded.
      const std::size_t whole = (sharded ? 3 * 108 : 323) * sizeof(double);
      const std::vector<std::size_t> gathered =
          strategy == ShardingStrategy::FullShard     ? std::vector<std::size_t>{0, 0, 0}
          : strategy == ShardingStrategy::ShardGradOp ? std::vector<std::size_t>{0, whole, 0}
                                                      : std::vector<std::size_t>{whole, whole, whole};
      CHECK(seen[r].gathered == gathered);
    }
  });
}

TEST_CASE("fully_shard: a frozen parameter keeps its value and a buffer is rank 0's, on every rank") {
  CAPTURE(test::test_seed());
  const auto init = initial_state("fsdp frozen init");
  const int n = 3;
  PerRank got = run_ranks(n, [&](Comm& comm) {
    gradsync::ShardedModule<Net> m;
    load_and_wrap(m, comm, init, ShardingStrategy::FullShard);
    auto o = make_optimizer(Opt::adamw, *m);
    Data d = make_data(4, "fsdp frozen data " + std::to_string(comm.rank()));
    d.x = d.x.to(torch::kDouble);
    fit([&](const torch::Tensor& x) { return m(x); }, *o, d, 3);
    auto dict = gradsync::full_state_dict(m);
    return std::vector<torch::Tensor>{dict["scale"], dict["shift"]};
  });
  Net reference;
  load_state(*reference, init);
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    REQUIRE(got.errors[static_cast<std::size_t>(r)] == "");
    CHECK(torch::equal(got.params[static_cast<std::size_t>(r)][0], reference->scale));
    CHECK(torch::equal(got.params[static_cast<std::size_t>(r)][1], reference->shift));
  }
}

TEST_CASE("fully_shard: clip_grad_norm_ over the shards matches torch::nn::utils::clip_grad_norm_ on one process") {
  CAPTURE(test::test_seed());
  const std::int64_t b = 4;
  const int n = 3, steps = 5;
  // Small enough that every step clips.
  const double max_norm = 0.05;
  const auto init = initial_state("fsdp clip init");
  Data d = make_data(n * b, "fsdp clip data");
  d.x = d.x.to(torch::kDouble);
  std::vector<torch::Tensor> expected;
  const std::vector<double> norms = clipped_alone(init, Opt::sgd_momentum, d, steps, max_norm, expected);
  each_strategy([&](ShardingStrategy strategy) {
    std::vector<std::vector<double>> seen(static_cast<std::size_t>(n));
    PerRank got = run_ranks(n, [&](Comm& comm) {
      gradsync::ShardedModule<Net> m;
      // Only rank 0 starts from the reference: wrapping must broadcast it.
      load_and_wrap(m, comm, init, strategy);
      return fit_clipped(m, comm, Opt::sgd_momentum, rank_rows(d, comm.rank(), b), steps, max_norm,
                         seen[static_cast<std::size_t>(comm.rank())]);
    });
    for (std::size_t r = 0; r < seen.size(); ++r) {
      CAPTURE(r);
      REQUIRE(got.errors[r] == "");
      for (int s = 0; s < steps; ++s) {
        CAPTURE(s);
        CHECK(norms[static_cast<std::size_t>(s)] > max_norm);
        CHECK(std::abs(seen[r][static_cast<std::size_t>(s)] - norms[static_cast<std::size_t>(s)]) <=
              1e-9 * norms[static_cast<std::size_t>(s)]);
      }
    }
    const double error = max_relative(got.params[0], expected);
    CAPTURE(error);
    CHECK(error <= 1e-5);
  });
}

TEST_CASE("fully_shard: save_full_state_dict writes the unwrapped module's names and full values from rank 0") {
  CAPTURE(test::test_seed());
  const auto init = initial_state("fsdp save init");
  const int n = 2;
  const auto path = std::filesystem::temp_directory_path() /
                    ("gradsync_fsdp_state_" + std::to_string(test::test_seed()) + ".safetensors");
  PerRank got = run_ranks(n, [&](Comm& comm) {
    gradsync::ShardedModule<Net> m;
    load_and_wrap(m, comm, init, ShardingStrategy::FullShard);
    gradsync::save_full_state_dict(m, comm, path);
    return std::vector<torch::Tensor>{};
  });
  for (const auto& e : got.errors) REQUIRE(e == "");
  Net reference;
  load_state(*reference, init);
  gradsync::checkpoint::SafetensorsReader reader(path);
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (const auto& np : reference->named_parameters()) named.emplace_back(np.key(), np.value());
  for (const auto& nb : reference->named_buffers()) named.emplace_back(nb.key(), nb.value());
  CHECK(reader.tensors().size() == named.size());
  for (const auto& [name, value] : named) {
    CAPTURE(name);
    REQUIRE(reader.find(name) != nullptr);
    torch::Tensor read = torch::empty(value.sizes(), value.options());
    reader.read(name, std::span<std::byte>(static_cast<std::byte*>(read.data_ptr()), read.nbytes()));
    CHECK(torch::equal(read, value));
  }
  std::filesystem::remove(path);
}

TEST_CASE("fully_shard: after a backward that threw, training goes on as if that step never was") {
  CAPTURE(test::test_seed());
  const std::int64_t b = 4;
  const int n = 3, steps = 4, failing = 2;
  const auto init = initial_state("fsdp throw init");
  Data d = make_data(n * b, "fsdp throw data");
  d.x = d.x.to(torch::kDouble);
  Net alone;
  load_state(*alone, init);
  auto alone_opt = make_optimizer(Opt::adam, *alone);
  fit([&](const torch::Tensor& x) { return alone->forward(x); }, *alone_opt, d, steps - 1);
  const std::vector<torch::Tensor> expected = state(*alone);
  each_strategy([&](ShardingStrategy strategy) {
    std::vector<int> threw(static_cast<std::size_t>(n));
    PerRank got = run_ranks(n, [&](Comm& comm) {
      gradsync::ShardedModule<Net> m;
      load_and_wrap(m, comm, init, strategy);
      auto opt = make_optimizer(Opt::adam, *m);
      const Data mine = rank_rows(d, comm.rank(), b);
      for (int s = 0; s < steps; ++s) {
        opt->zero_grad();
        torch::Tensor out = m(mine.x);
        // Runs after the root's own hook, which has begun its backward.
        if (s == failing) {
          out.register_hook([](const torch::Tensor& /*grad*/) -> torch::Tensor { throw std::runtime_error("boom"); });
        }
        try {
          torch::nn::functional::cross_entropy(out, mine.y).backward();
        } catch (const std::exception&) {
          ++threw[static_cast<std::size_t>(comm.rank())];
          continue;
        }
        opt->step();
      }
      return values(gradsync::full_state_dict(m));
    });
    for (std::size_t r = 0; r < threw.size(); ++r) {
      CAPTURE(r);
      REQUIRE(got.errors[r] == "");
      CHECK(threw[r] == 1);
    }
    const double error = max_relative(got.params[0], expected);
    CAPTURE(error);
    CHECK(error <= 1e-5);
  });
}

namespace {

/// A decoder that uses the encoder's weight (a language model's embedding
/// and output head): one tensor that named_parameters() lists twice.
struct TiedDecoderImpl : torch::nn::Module {
  explicit TiedDecoderImpl(torch::Tensor w) { weight = register_parameter("weight", w); }
  torch::Tensor forward(torch::Tensor x) { return torch::linear(x, weight); }
  torch::Tensor weight;
};
TORCH_MODULE(TiedDecoder);
struct TiedImpl : torch::nn::Module {
  TiedImpl() : enc(register_module("enc", torch::nn::Linear(5, 5))) {
    dec = register_module("dec", TiedDecoder(enc->weight));
    to(torch::kDouble);
  }
  torch::Tensor forward(torch::Tensor x) { return dec(torch::tanh(enc(x))); }
  torch::nn::Linear enc;
  TiedDecoder dec{nullptr};
};
TORCH_MODULE(Tied);

/// A body and an auxiliary head of one 1-D parameter (its piece of a shard
/// has the parameter's shape or broadcasts against it), whose output some
/// steps leave out of the loss.
struct AuxHeadImpl : torch::nn::Module {
  AuxHeadImpl() { s = register_parameter("s", torch::tensor({0.9, 0.1}, torch::kDouble)); }
  torch::Tensor forward(torch::Tensor x) { return x * s[0] + s[1]; }
  torch::Tensor s;
};
TORCH_MODULE(AuxHead);
struct AuxNetImpl : torch::nn::Module {
  AuxNetImpl() : body(register_module("body", Block(6, 5, 4))), aux(register_module("aux", AuxHead())) {
    to(torch::kDouble);
  }
  torch::Tensor forward(torch::Tensor x, bool use_aux) {
    const torch::Tensor h = body(x);
    const torch::Tensor side = aux(h);
    return use_aux ? side : h;
  }
  gradsync::ShardedModule<Block> body;
  gradsync::ShardedModule<AuxHead> aux;
};
TORCH_MODULE(AuxNet);

/// Values by named_parameters() then named_buffers(), as full_state_dict orders them.
std::vector<torch::Tensor> named_values(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& np : m.named_parameters()) out.push_back(np.value().detach().clone());
  for (const auto& nb : m.named_buffers()) out.push_back(nb.value().detach().clone());
  return out;
}

/// Trains `ref` (`train(ref, opt)`) with SGD at `sgd`; then, at N = 1..3
/// under each strategy, every rank loads ref's initial values into a fresh
/// Module, wraps it (`wrap(m, comm, options)`), trains it the same way, and
/// ends within 1e-9 (relative) of `ref`.
template <class Module, class Wrap, class Train>
void check_every_world(Module& ref, const torch::optim::SGDOptions& sgd, Wrap wrap, Train train) {
  const auto init = state(*ref);
  torch::optim::SGD ref_opt(ref->parameters(), sgd);
  train(ref, ref_opt);
  const auto expected = named_values(*ref);
  for (int n = 1; n <= 3; ++n) {
    CAPTURE(n);
    each_strategy([&](ShardingStrategy strategy) {
      const PerRank got = run_ranks(n, [&](Comm& comm) {
        gradsync::ShardedModule<Module> m;
        load_state(*m, init);
        gradsync::FullyShardOptions o;
        o.strategy = strategy;
        wrap(m, comm, o);
        torch::optim::SGD opt(m->parameters(), sgd);
        train(m, opt);
        return values(gradsync::full_state_dict(m));
      });
      for (std::size_t r = 0; r < got.errors.size(); ++r) {
        CAPTURE(r);
        REQUIRE(got.errors[r] == "");
        CHECK(max_relative(got.params[r], expected) <= 1e-9);
      }
    });
  }
}

}  // namespace

TEST_CASE("fully_shard: a weight tied under two names in one unit gets its whole gradient, backward after backward") {
  torch::manual_seed(test::test_seed());
  const auto x = torch::randn({6, 5}, torch::kDouble), y = torch::randn({6, 5}, torch::kDouble);
  Tied ref;
  // Two backwards (accumulated) per step: a second slot of the tied tensor
  // once kept only the last one.
  auto train = [&](auto& net, torch::optim::Optimizer& opt) {
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      for (int half = 0; half < 2; ++half) {
        torch::mse_loss(net(x.narrow(0, 3 * half, 3)), y.narrow(0, 3 * half, 3)).backward();
      }
      opt.step();
    }
  };
  check_every_world(ref, torch::optim::SGDOptions(0.1),
                    [](auto& m, Comm& comm, const auto& o) { gradsync::fully_shard(m, comm, o); }, train);
}

TEST_CASE("fully_shard: a unit no backward reaches, or a forward no backward follows, leaves the optimizer its shard") {
  // ShardGradOp keeps a unit's gather from its forward to its backward: the
  // aux head out of the loss (step 1), or a forward with grad whose output
  // is held past the step (step 0), once left the parameters on the
  // gathered copy, which the optimizer then stepped instead of the shard.
  torch::manual_seed(test::test_seed() + 1);
  const auto x = torch::randn({6, 6}, torch::kDouble), y = torch::randn({6, 4}, torch::kDouble);
  AuxNet ref;
  auto train = [&](auto& net, torch::optim::Optimizer& opt) {
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      torch::mse_loss(net(x, step != 1), y).backward();
      const torch::Tensor held = step == 0 ? net(x, true) : torch::Tensor();
      opt.step();
    }
  };
  check_every_world(ref, torch::optim::SGDOptions(0.1).momentum(0.9), [](auto& m, Comm& comm, const auto& o) {
    gradsync::fully_shard(m->body, comm, o);
    gradsync::fully_shard(m->aux, comm, o);
    gradsync::fully_shard(m, comm, o);
  }, train);
}

TEST_CASE("fully_shard: clip_grad_norm_ counts only the gradients set since they were reset, as torch's does") {
  // Gradients reset to undefined before each step (zero_grad's set_to_none),
  // and b2 left out of step 1's forward: its shard still held step 0's
  // gradient, which clip_grad_norm_ once counted.
  const std::int64_t b = 3;
  const int n = 2, steps = 3;
  const Data d = make_data(n * b, "fsdp clip reset data");
  torch::manual_seed(test::test_seed() + 2);
  SkipNet ref;
  const auto init = state(*ref);
  std::vector<double> expected;
  {
    torch::optim::SGD opt(ref->parameters(), torch::optim::SGDOptions(0.1));
    for (int step = 0; step < steps; ++step) {
      for (auto& p : ref->parameters()) p.mutable_grad().reset();
      torch::nn::functional::cross_entropy(ref->forward(d.x, step == 1), d.y).backward();
      expected.push_back(torch::nn::utils::clip_grad_norm_(ref->parameters(), 1e9));
      opt.step();
    }
  }
  std::vector<std::vector<double>> seen(static_cast<std::size_t>(n));
  PerRank got = run_ranks(n, [&](Comm& comm) {
    gradsync::ShardedModule<SkipNet> m;
    load_state(*m, init);
    gradsync::fully_shard(m->b1, comm);
    gradsync::fully_shard(m->b2, comm);
    gradsync::fully_shard(m, comm);
    const Data mine = rank_rows(d, comm.rank(), b);
    std::vector<double>& norms = seen[static_cast<std::size_t>(comm.rank())];
    torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
    for (int step = 0; step < steps; ++step) {
      for (auto& p : m->parameters()) p.mutable_grad().reset();
      torch::nn::functional::cross_entropy(m(mine.x, step == 1), mine.y).backward();
      norms.push_back(gradsync::clip_grad_norm_(m, comm, 1e9));
      opt.step();
    }
    return values(gradsync::full_state_dict(m));
  });
  for (std::size_t r = 0; r < seen.size(); ++r) {
    CAPTURE(r);
    REQUIRE(got.errors[r] == "");
    REQUIRE(seen[r].size() == expected.size());
    for (std::size_t s = 0; s < expected.size(); ++s) {
      CAPTURE(s);
      CHECK(std::abs(seen[r][s] - expected[s]) <= 1e-5 * expected[s]);
    }
  }
}

TEST_CASE("fully_shard: wrong use is refused on every rank, naming the fix") {
  const int n = 3;
  SUBCASE("a module wrapped twice") {
    PerRank got = run_ranks(n, [&](Comm& comm) {
      gradsync::ShardedModule<Net> m;
      gradsync::fully_shard(m->b1, comm);
      gradsync::fully_shard(m->b1, comm);
      return std::vector<torch::Tensor>{};
    });
    check_refused(got, {"already wrapped"});
  }
  SUBCASE("a child wrapped after its parent") {
    PerRank got = run_ranks(n, [&](Comm& comm) {
      gradsync::ShardedModule<Net> m;
      gradsync::fully_shard(m, comm);
      gradsync::fully_shard(m->b2, comm);
      return std::vector<torch::Tensor>{};
    });
    check_refused(got, {"'a.weight' already belongs to the unit of module", "wrap the inner modules first"});
  }
  SUBCASE("ranks that wrap different modules") {
    PerRank got = run_ranks(n, [&](Comm& comm) {
      gradsync::ShardedModule<Net> m;
      gradsync::fully_shard(comm.rank() == 1 ? m->b2 : m->b1, comm);
      return std::vector<torch::Tensor>{};
    });
    check_refused(got, {"ranks declared different units", "a.weight [13 x 12]"});
  }
  SUBCASE("one rank wraps a module twice while the others go on: no rank waits") {
    PerRank got = run_ranks(n, [&](Comm& comm) {
      gradsync::ShardedModule<Net> m;
      gradsync::fully_shard(m->b1, comm);
      gradsync::fully_shard(comm.rank() == 2 ? m->b1 : m->b2, comm);
      return std::vector<torch::Tensor>{};
    });
    check_refused(got, {"gradsync: fully_shard"});
  }
  SUBCASE("HybridShard with a shard_size that does not divide the world") {
    PerRank got = wrap_b1_with(n, [](gradsync::FullyShardOptions& o, int /*rank*/) {
      o.strategy = ShardingStrategy::HybridShard;
      o.shard_size = 2;
    });
    check_refused(got, {"HybridShard needs a shard_size that divides the world size 3, got 2"});
  }
  SUBCASE("param_dtype with NoShard, which has no master copy") {
    PerRank got = wrap_b1_with(n, [](gradsync::FullyShardOptions& o, int /*rank*/) {
      o.strategy = ShardingStrategy::NoShard;
      o.param_dtype = torch::kBFloat16;
    });
    check_refused(got, {"FullyShardOptions::param_dtype needs a sharded strategy"});
  }
  SUBCASE("a float input to a bfloat16 unit") {
    PerRank got = run_ranks(n, [&](Comm& comm) {
      gradsync::ShardedModule<SkipNet> m;
      gradsync::FullyShardOptions o;
      o.param_dtype = torch::kBFloat16;
      gradsync::fully_shard(m, comm, o);
      m(torch::zeros({2, 12}), false);
      return std::vector<torch::Tensor>{};
    });
    check_refused(got, {"an input is Float where FullyShardOptions::param_dtype is BFloat16", "torch::kBFloat16"});
  }
  SUBCASE("ranks with different strategies") {
    PerRank got = wrap_b1_with(n, [](gradsync::FullyShardOptions& o, int rank) {
      if (rank == 0) o.strategy = ShardingStrategy::NoShard;
    });
    check_refused(got, {"FullyShardOptions::strategy: NoShard on world rank 0, FullShard on world ranks 1-2"});
  }
  SUBCASE("the children wrapped, the root with parameters of its own not") {
    // Nothing would average head's gradient: each rank would train its own.
    PerRank got = run_ranks(n, [&](Comm& comm) {
      gradsync::ShardedModule<Net> m;
      gradsync::fully_shard(m->b1, comm);
      gradsync::fully_shard(m->b2, comm);
      m(torch::zeros({2, 12}, torch::kDouble));
      return std::vector<torch::Tensor>{};
    });
    check_refused(got, {"'head.weight', 'head.bias' are in none", "Wrap the root too"});
  }
  SUBCASE("torch::load into a wrapped module, whose unit would gather its own shards over the loaded values") {
    const test::TempDir dir;
    for (const ShardingStrategy s : {ShardingStrategy::FullShard, ShardingStrategy::NoShard}) {
      CAPTURE(std::string(name(s)));
      PerRank got = run_ranks(n, [&](Comm& comm) {
        const auto file = dir.path / ("net" + std::to_string(comm.rank()) + ".pt");
        torch::save(Net(), file.string());
        gradsync::ShardedModule<Net> m;
        gradsync::FullyShardOptions o;
        o.strategy = s;
        wrap(m, comm, o);
        torch::load(m, file.string());
        m(torch::zeros({2, 12}, torch::kDouble));
        return std::vector<torch::Tensor>{};
      });
      check_refused(got, {"after fully_shard wrapped its module; its values would be ignored", "load_sharded_state_dict"});
    }
  }
}

}  // namespace test_torch_fsdp
