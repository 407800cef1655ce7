// fully_shard for LibTorch modules: parity with one process on the
// concatenated batch and with DistributedDataParallel for each strategy and
// optimizer, unit sizes N does not divide, a frozen parameter and a buffer,
// the shards the optimizer sees, and wrong use refused on every rank.
//
// Every rank's result is collected and checked on the main thread after
// run_threads, so a failing rank never leaves the others waiting.

#include "torch_ddp_support.hpp"

#include <algorithm>
#include <cstdint>
#include <memory>
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

/// Two layers, 12·13 + 13 + 13·11 + 11 = 323 parameters for (12, 13, 11):
/// a unit no N in 2..4 divides.
struct BlockImpl : torch::nn::Module {
  BlockImpl(int in, int hidden, int out)
      : a(register_module("a", torch::nn::Linear(in, hidden))), b(register_module("b", torch::nn::Linear(hidden, out))) {}
  torch::Tensor forward(torch::Tensor x) { return torch::tanh(b(torch::relu(a(x)))); }
  torch::nn::Linear a, b;
};
TORCH_MODULE(Block);

/// b1 (323 parameters), b2 (11·9 + 9 + 9·10 + 10 = 208: 2 and 4 divide it,
/// 3 does not), then the root's own unit: head (55) and a frozen scale
/// (10), with a buffer added before the head. In double: the parity below
/// is then rounding apart, not float's cancellation magnified by Adam.
struct NetImpl : torch::nn::Module {
  NetImpl()
      : b1(register_module("b1", Block(12, 13, 11))),
        b2(register_module("b2", Block(11, 9, 10))),
        head(register_module("head", torch::nn::Linear(10, 5))) {
    scale = register_parameter("scale", torch::full({10}, 1.5), /*requires_grad=*/false);
    shift = register_buffer("shift", torch::linspace(-0.5, 0.5, 10));
    to(torch::kDouble);
  }
  torch::Tensor forward(torch::Tensor x) { return head(b2(b1(x)) * scale + shift); }
  gradsync::ShardedModule<Block> b1, b2;
  torch::nn::Linear head;
  torch::Tensor scale, shift;
};
TORCH_MODULE(Net);

/// A Net's parameters and buffers from the case's seed, scale and shift too.
std::vector<torch::Tensor> initial_state(std::string_view salt) {
  auto rng = test::rng_for(salt);
  torch::manual_seed(rng());
  Net m;
  torch::NoGradGuard no_grad;
  m->scale.uniform_(0.5, 2.0);
  m->shift.normal_(0.0, 0.5);
  return state(*m);
}

enum class Opt { sgd_momentum, adam, adamw };

const char* opt_name(Opt o) {
  switch (o) {
    case Opt::sgd_momentum: return "SGD with momentum";
    case Opt::adam: return "Adam";
    case Opt::adamw: return "AdamW";
  }
  return "?";
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt o, torch::nn::Module& m) {
  switch (o) {
    case Opt::adam: return std::make_unique<torch::optim::Adam>(m.parameters(), torch::optim::AdamOptions(1e-2));
    case Opt::adamw:
      return std::make_unique<torch::optim::AdamW>(m.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    case Opt::sgd_momentum: break;
  }
  return std::make_unique<torch::optim::SGD>(m.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}

/// `steps` optimizer steps of `forward` on x against y.
template <class Forward>
void fit(Forward forward, torch::optim::Optimizer& opt, const Data& d, int steps) {
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    torch::nn::functional::cross_entropy(forward(d.x), d.y).backward();
    opt.step();
  }
}

/// The values of a state dict, in its order (parameters, then buffers).
std::vector<torch::Tensor> values(const torch::OrderedDict<std::string, torch::Tensor>& dict) {
  std::vector<torch::Tensor> out;
  for (const auto& item : dict) out.push_back(item.value());
  return out;
}

/// ‖a − b‖ / ‖b‖, the largest over the tensors.
double max_relative(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double diff = (a[i].to(torch::kDouble) - b[i].to(torch::kDouble)).norm().item<double>();
    const double ref = b[i].to(torch::kDouble).norm().item<double>();
    worst = std::max(worst, ref > 0 ? diff / ref : diff);
  }
  return worst;
}

/// Results of a run_threads call, one slot per rank.
struct PerRank {
  explicit PerRank(int n) : state(static_cast<std::size_t>(n)), errors(static_cast<std::size_t>(n)) {}
  std::vector<std::vector<torch::Tensor>> state;
  std::vector<std::string> errors;
};

template <class F>
PerRank run_ranks(int n, F body) {
  PerRank out(n);
  gradsync::run_threads(n, [&](Comm& comm) {
    torch::set_num_threads(1);
    const auto r = static_cast<std::size_t>(comm.rank());
    try {
      out.state[r] = body(comm);
    } catch (const gradsync::InvalidArgument& e) {
      out.errors[r] = e.what();
    }
  });
  return out;
}

Data rank_rows(const Data& d, int rank, std::int64_t b) { return {d.x.narrow(0, rank * b, b), d.y.narrow(0, rank * b, b)}; }

/// b1, b2, then the root, as FSDP2 wants them: innermost first.
void wrap(gradsync::ShardedModule<Net>& m, Comm& comm, const gradsync::FullyShardOptions& o) {
  gradsync::fully_shard(m->b1, comm, o);
  gradsync::fully_shard(m->b2, comm, o);
  gradsync::fully_shard(m, comm, o);
}

std::int64_t numel(const std::vector<torch::Tensor>& ts) {
  std::int64_t n = 0;
  for (const auto& t : ts) n += t.numel();
  return n;
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
      Net alone;
      load_state(*alone, init);
      auto alone_opt = make_optimizer(opt, *alone);
      fit([&](const torch::Tensor& x) { return alone->forward(x); }, *alone_opt, d, steps);
      const std::vector<torch::Tensor> expected = state(*alone);

      PerRank ddp = run_ranks(n, [&](Comm& comm) {
        Net m;
        if (comm.rank() == 0) load_state(*m, init);
        gradsync::DistributedDataParallel dp(comm, m);
        auto o = make_optimizer(opt, *m);
        fit([&](const torch::Tensor& x) { return dp(x); }, *o, rank_rows(d, comm.rank(), b), steps);
        return state(*m);
      });
      REQUIRE(ddp.errors[0] == "");

      for (const ShardingStrategy strategy :
           {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp, ShardingStrategy::NoShard}) {
        const std::string strategy_name = gradsync::name(strategy);
        CAPTURE(strategy_name);
        std::vector<std::int64_t> local(static_cast<std::size_t>(n));
        PerRank got = run_ranks(n, [&](Comm& comm) {
          gradsync::ShardedModule<Net> m;
          // Only rank 0 starts from the reference: wrapping must broadcast it.
          if (comm.rank() == 0) load_state(*m, init);
          gradsync::FullyShardOptions o;
          o.strategy = strategy;
          wrap(m, comm, o);
          local[static_cast<std::size_t>(comm.rank())] = numel(m->parameters());
          auto optimizer_ = make_optimizer(opt, *m);
          fit([&](const torch::Tensor& x) { return m(x); }, *optimizer_, rank_rows(d, comm.rank(), b), steps);
          return values(gradsync::full_state_dict(m));
        });
        for (int r = 0; r < n; ++r) {
          CAPTURE(r);
          const auto ru = static_cast<std::size_t>(r);
          REQUIRE(got.errors[ru] == "");
          CHECK(bitwise_equal(got.state[ru], got.state[0]));
          // Between steps each rank's parameters are its pieces of the
          // padded shards: together the whole model, each at most ⌈P/N⌉ a unit.
          std::int64_t most = 0;
          for (std::int64_t p : units) most += strategy == ShardingStrategy::NoShard ? p : (p + n - 1) / n;
          CHECK(local[ru] <= most);
        }
        std::int64_t total = 0;
        for (std::int64_t l : local) total += l;
        CHECK(total == (strategy == ShardingStrategy::NoShard ? n : 1) * (323 + 208 + 65));
        const double error = max_relative(got.state[0], expected);
        const double from_ddp = max_relative(got.state[0], ddp.state[0]);
        CAPTURE(error);
        CAPTURE(from_ddp);
        CHECK(error <= 1e-5);
        CHECK(from_ddp <= 1e-5);
      }
    }
  }
}

TEST_CASE("fully_shard: a frozen parameter keeps its value and a buffer is rank 0's, on every rank") {
  CAPTURE(test::test_seed());
  const auto init = initial_state("fsdp frozen init");
  const int n = 3;
  PerRank got = run_ranks(n, [&](Comm& comm) {
    gradsync::ShardedModule<Net> m;
    if (comm.rank() == 0) load_state(*m, init);
    wrap(m, comm, {});
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
    CHECK(torch::equal(got.state[static_cast<std::size_t>(r)][0], reference->scale));
    CHECK(torch::equal(got.state[static_cast<std::size_t>(r)][1], reference->shift));
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
    for (const auto& e : got.errors) {
      CAPTURE(e);
      CHECK(e.find("already wrapped") != std::string::npos);
    }
  }
  SUBCASE("a child wrapped after its parent") {
    PerRank got = run_ranks(n, [&](Comm& comm) {
      gradsync::ShardedModule<Net> m;
      gradsync::fully_shard(m, comm);
      gradsync::fully_shard(m->b2, comm);
      return std::vector<torch::Tensor>{};
    });
    for (const auto& e : got.errors) {
      CAPTURE(e);
      CHECK(e.find("'a.weight' already belongs to the unit of module") != std::string::npos);
      CHECK(e.find("wrap the inner modules first") != std::string::npos);
    }
  }
  SUBCASE("ranks that wrap different modules") {
    PerRank got = run_ranks(n, [&](Comm& comm) {
      gradsync::ShardedModule<Net> m;
      gradsync::fully_shard(comm.rank() == 1 ? m->b2 : m->b1, comm);
      return std::vector<torch::Tensor>{};
    });
    for (const auto& e : got.errors) {
      CAPTURE(e);
      CHECK(e.find("ranks declared different units") != std::string::npos);
      CHECK(e.find("a.weight [13 x 12]") != std::string::npos);
    }
  }
  SUBCASE("one rank wraps a module twice while the others go on: no rank waits") {
    PerRank got = run_ranks(n, [&](Comm& comm) {
      gradsync::ShardedModule<Net> m;
      gradsync::fully_shard(m->b1, comm);
      gradsync::fully_shard(comm.rank() == 2 ? m->b1 : m->b2, comm);
      return std::vector<torch::Tensor>{};
    });
    for (const auto& e : got.errors) {
      CAPTURE(e);
      CHECK(e.find("gradsync: fully_shard") != std::string::npos);
    }
  }
  SUBCASE("ranks with different strategies") {
    PerRank got = run_ranks(n, [&](Comm& comm) {
      gradsync::ShardedModule<Net> m;
      gradsync::FullyShardOptions o;
      if (comm.rank() == 0) o.strategy = ShardingStrategy::NoShard;
      gradsync::fully_shard(m->b1, comm, o);
      return std::vector<torch::Tensor>{};
    });
    for (const auto& e : got.errors) {
      CAPTURE(e);
      CHECK(e.find("FullyShardOptions::strategy: NoShard on world rank 0, FullShard on world ranks 1-2") != std::string::npos);
    }
  }
}

}  // namespace test_torch_fsdp
