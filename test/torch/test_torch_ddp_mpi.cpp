// DistributedDataParallel and fully_shard over Mpi, one process per rank (mpirun -np 2, 4),
// with float, bfloat16 and half parameters, and with a frozen first layer
// and BatchNorm statistics: N ranks of batch b against one LibTorch process
// on the N·b batch (each rank computes that reference itself), bitwise alike
// across ranks. The 16-bit tolerance is the one test_torch_ddp_half states:
// steps · one unit of least precision at 1.0.

#include <gradsync/backend/mpi.hpp>

#include "torch_fsdp_support.hpp"

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace {

using namespace test_torch;
using Mlp = test_torch::TypedMlp;

/// FNV-1a over the parameters' bytes: equal on every rank iff bitwise equal (but for collisions).
std::int64_t fingerprint(const std::vector<torch::Tensor>& ps) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (const auto& p : ps) {
    const auto* bytes = static_cast<const unsigned char*>(p.data_ptr());
    for (std::int64_t i = 0; i < p.numel() * static_cast<std::int64_t>(p.element_size()); ++i) {
      h = (h ^ bytes[i]) * 0x100000001b3ull;
    }
  }
  return static_cast<std::int64_t>(h);
}

/// Every rank's fingerprint of `ps` is rank 0's.
bool alike_everywhere(gradsync::Communicator<gradsync::Mpi>& comm, const std::vector<torch::Tensor>& ps) {
  const std::int64_t mine = fingerprint(ps);
  std::vector<std::int64_t> all(static_cast<std::size_t>(comm.size()));
  gradsync::AllGather<gradsync::Auto>{}(comm, std::span<const std::int64_t>(&mine, 1), std::span<std::int64_t>(all));
  for (std::int64_t f : all) {
    if (f != all[0]) return false;
  }
  return true;
}

/// Each case's world: every process of the job, each with one LibTorch thread
/// (the ranks share the machine's cores).
struct World {
  World() { torch::set_num_threads(1); }
  gradsync::Communicator<gradsync::Mpi> comm{MPI_COMM_WORLD};
  const int n = comm.size();
};

}  // namespace

TEST_CASE_FIXTURE(World,
                  "DistributedDataParallel on Mpi: float, bfloat16 and half parameters match one process on the N·b batch") {
  CAPTURE(test::test_seed());
  const std::int64_t b = 7;
  const int steps = 5;
  struct Case {
    const char* name;
    torch::Dtype dtype, compute;
    double tolerance;
  };
  for (const Case c : {Case{"float", torch::kFloat, torch::kFloat, 1e-6},
                       Case{"bfloat16", torch::kBFloat16, torch::kBFloat16, steps * 0x1p-8},
                       Case{"half", torch::kHalf, torch::kFloat, steps * 0x1p-11}}) {
    const std::string type_name = c.name;
    CAPTURE(type_name);
    // The seed is the job's (support/main.cpp broadcasts it): the same init and data everywhere.
    auto rng = test::rng_for("ddp mpi " + type_name);
    torch::manual_seed(rng());
    const auto init = snapshot(*Mlp(c.dtype, c.compute));
    const auto x = torch::randn({n * b, 12});
    const auto y = torch::randint(0, 5, {n * b}, torch::kInt64);

    Mlp ref(c.dtype, c.compute);
    load(*ref, init);
    const auto expected = train_alone(ref, x, y, steps);

    // Other ranks start from their own weights: construction must broadcast rank 0's.
    torch::manual_seed(rng() + static_cast<std::uint64_t>(comm.rank()));
    Mlp m(c.dtype, c.compute);
    if (comm.rank() == 0) load(*m, init);
    const auto got = train_ddp(comm, m, x.narrow(0, comm.rank() * b, b), y.narrow(0, comm.rank() * b, b), steps);
    CHECK(std::string(c10::toString(m->fc1->weight.grad().scalar_type())) == c10::toString(c.dtype));

    CHECK(alike_everywhere(comm, got));

    const double error = relative(got, expected), moved = relative(expected, init);
    CAPTURE(error);
    CAPTURE(moved);
    CHECK(moved >= 4 * c.tolerance);
    CHECK(error <= c.tolerance);
  }
}

TEST_CASE_FIXTURE(World, "DistributedDataParallel on Mpi: a frozen first layer and BatchNorm statistics start as rank 0's") {
  CAPTURE(test::test_seed());
  const std::int64_t b = 4;
  const int steps = 4;
  // The job's seed: every rank draws the same n states and data, and starts from its own state.
  auto rng = test::rng_for("ddp mpi frozen");
  std::vector<std::vector<torch::Tensor>> init;
  for (int r = 0; r < n; ++r) init.push_back(backbone_state(rng()));
  torch::manual_seed(rng());
  const auto x = torch::randn({n * b, 12}, torch::kDouble);
  const auto y = torch::randint(0, 5, {n * b}, torch::kInt64);

  BackboneNet ref = fine_tuned_backbone(init[0]);
  const auto expected = train_alone(ref, x, y, steps);

  BackboneNet m = fine_tuned_backbone(init[static_cast<std::size_t>(comm.rank())]);
  const auto got = train_ddp(comm, m, x.narrow(0, comm.rank() * b, b), y.narrow(0, comm.rank() * b, b), steps);

  CHECK(alike_everywhere(comm, got));
  const double error = relative(got, expected);
  CAPTURE(error);
  CHECK(error <= 1e-12);
}

TEST_CASE_FIXTURE(World, "fully_shard on Mpi: every strategy, HybridShard too, matches one process on the N·b batch, "
                          "alike on every rank") {
  CAPTURE(test::test_seed());
  using namespace test_torch_fsdp_support;
  const std::int64_t b = 5;
  const int steps = 10;
  const auto init = initial_state("fsdp mpi init");
  Data d = make_data(n * b, "fsdp mpi data");
  d.x = d.x.to(torch::kDouble);
  const Data mine{d.x.narrow(0, comm.rank() * b, b), d.y.narrow(0, comm.rank() * b, b)};
  for (const Opt opt : {Opt::sgd_momentum, Opt::adamw}) {
    const std::string optimizer = opt_name(opt);
    CAPTURE(optimizer);
    Net alone;
    load_state(*alone, init);
    auto alone_opt = make_optimizer(opt, *alone);
    fit([&](const torch::Tensor& x) { return alone->forward(x); }, *alone_opt, d, steps);
    const std::vector<torch::Tensor> expected = state(*alone);
    for (const gradsync::ShardingStrategy strategy :
         {gradsync::ShardingStrategy::FullShard, gradsync::ShardingStrategy::ShardGradOp,
          gradsync::ShardingStrategy::NoShard, gradsync::ShardingStrategy::HybridShard}) {
      const std::string strategy_name = gradsync::name(strategy);
      CAPTURE(strategy_name);
      gradsync::ShardedModule<Net> m;
      // Only rank 0 starts from the reference: wrapping must broadcast it.
      if (comm.rank() == 0) load_state(*m, init);
      gradsync::FullyShardOptions o;
      o.strategy = strategy;
      // HybridShard: groups of 2, split from MPI_COMM_WORLD (one at -np 2, two at -np 4).
      if (strategy == gradsync::ShardingStrategy::HybridShard) o.shard_size = 2;
      wrap(m, comm, o);
      auto sharded_opt = make_optimizer(opt, *m);
      fit([&](const torch::Tensor& x) { return m(x); }, *sharded_opt, mine, steps);
      const std::vector<torch::Tensor> got = values(gradsync::full_state_dict(m));
      CHECK(alike_everywhere(comm, got));
      const double error = relative(got, expected);
      CAPTURE(error);
      CHECK(error <= 1e-5);
    }
  }
}
