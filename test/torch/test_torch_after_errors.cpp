// After an error the caller caught, and after forwards that run the units in
// another order, fully_shard and DistributedDataParallel train on as a run
// without the error (or in one process) does: nothing the failed backward
// or an unused prefetch left behind reaches a later step.
#include <doctest/doctest.h>

#include <gradsync/gradsync.hpp>
#include <gradsync/integration/torch.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "../support/common.hpp"

// Its own namespace: test/torch/meson.build compiles it in one translation
// unit with the other LibTorch test files.
namespace test_torch_after_errors {

namespace {

using Comm = gradsync::Communicator<gradsync::Threads>;
using gradsync::ShardingStrategy;

/// Whether ThrowInBackward throws: each rank thread its own (LibTorch runs
/// a CPU backward on the thread that calls it).
thread_local bool armed = false;

/// The identity, whose backward throws while `armed`.
struct ThrowInBackward : torch::autograd::Function<ThrowInBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 const torch::autograd::variable_list& g) {
    if (armed) throw std::runtime_error("the backward failed");
    return {g[0]};
  }
};

/// One layer; `fails`: its backward goes through ThrowInBackward first.
struct LayerImpl : torch::nn::Module {
  explicit LayerImpl(bool fails) : fails(fails), a(register_module("a", torch::nn::Linear(6, 7))), back(7, 6) {
    register_module("back", back);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor h = torch::tanh(back(torch::relu(a(x))));
    return fails ? ThrowInBackward::apply(h) : h;
  }
  bool fails;
  torch::nn::Linear a, back;
};
TORCH_MODULE(Layer);

/// Two layers and a head; `swapped` runs l2 before l1. Holder: Layer, or
/// ShardedModule<Layer> for the fully_shard runs.
template <class Holder>
struct TwoLayersImpl : torch::nn::Module {
  TwoLayersImpl()
      : l1(register_module("l1", Layer(true))), l2(register_module("l2", Layer(false))),
        head(register_module("head", torch::nn::Linear(6, 3))) {
    to(torch::kDouble);
  }
  torch::Tensor forward(const torch::Tensor& x, bool swapped = false) { return head(swapped ? l1(l2(x)) : l2(l1(x))); }
  Holder l1, l2;
  torch::nn::Linear head;
};
using PlainImpl = TwoLayersImpl<Layer>;
TORCH_MODULE(Plain);
using ShardedImpl = TwoLayersImpl<gradsync::ShardedModule<Layer>>;
TORCH_MODULE(Sharded);

constexpr std::int64_t rows_per_rank = 3;

/// The case's data and initial values, from its seed.
struct Case {
  std::vector<torch::Tensor> x, y, init;
  explicit Case(const std::string& salt) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(test::rng_for(salt)());
    const auto f64 = torch::TensorOptions().dtype(torch::kDouble);
    for (int i = 0; i < 6; ++i) {
      x.push_back(torch::randn({4 * rows_per_rank, 6}, gen, f64));
      y.push_back(torch::randn({4 * rows_per_rank, 3}, gen, f64));
    }
    Plain p;
    for (const auto& t : p->parameters()) init.push_back(torch::randn(t.sizes(), gen, f64) * 0.5);
  }
  template <class M>
  void load(M& m) const {
    torch::NoGradGuard no_grad;
    const auto params = m->parameters();
    for (std::size_t i = 0; i < params.size(); ++i) params[i].copy_(init[i]);
  }
};

/// Rank r's rows of `t`; r < 0: the rows of all n ranks (the reference's batch).
torch::Tensor mine(const torch::Tensor& t, int r, int n) {
  return r < 0 ? t.narrow(0, 0, n * rows_per_rank) : t.narrow(0, r * rows_per_rank, rows_per_rank);
}

torch::optim::SGD sgd(torch::nn::Module& m) { return torch::optim::SGD(m.parameters(), torch::optim::SGDOptions(0.1)); }

/// A fully_shard model of `c`'s ranks: l1, l2 and the root each a unit.
gradsync::ShardedModule<Sharded> wrapped(const Case& k, Comm& c, ShardingStrategy s) {
  gradsync::ShardedModule<Sharded> net;
  k.load(net);
  gradsync::FullyShardOptions o;
  o.strategy = s;
  o.max_gathered_units = 2;
  gradsync::fully_shard(net->l1, c, o);
  gradsync::fully_shard(net->l2, c, o);
  gradsync::fully_shard(net, c, o);
  return net;
}

std::vector<torch::Tensor> final_values(gradsync::ShardedModule<Sharded>& net) {
  std::vector<torch::Tensor> out;
  for (const auto& kv : gradsync::full_state_dict(net)) out.push_back(kv.value().clone());
  return out;
}

double max_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  return worst;
}

}  // namespace

TEST_CASE("fully_shard: a unit gathered ahead before an optimizer step is gathered again when a forward of "
          "another order reaches it") {
  CAPTURE(test::test_seed());
  const Case k("stale prefetch");
  // A step; l1 alone, without grad (which gathers l2 ahead, in the last
  // forward's order); the optimizer's step; then a forward that runs l2 first.
  auto script = [&](torch::optim::SGD& opt, int r, int n, auto forward, auto first_layer) {
    opt.zero_grad();
    torch::mse_loss(forward(mine(k.x[0], r, n), false), mine(k.y[0], r, n)).backward();
    {
      torch::NoGradGuard no_grad;
      (void)first_layer(mine(k.x[1], r, n));
    }
    opt.step();
    torch::NoGradGuard no_grad;
    return forward(mine(k.x[2], r, n), true);
  };
  for (int n = 2; n <= 3; ++n) {
    Plain ref;
    k.load(ref);
    auto ref_opt = sgd(*ref);
    const torch::Tensor want = script(ref_opt, -1, n, [&](const torch::Tensor& x, bool s) { return ref->forward(x, s); },
                                      [&](const torch::Tensor& x) { return ref->l1(x); });
    for (const ShardingStrategy s : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp}) {
      CAPTURE(n);
      INFO("strategy = " << std::string(gradsync::name(s)));
      std::vector<torch::Tensor> got(static_cast<std::size_t>(n));
      gradsync::run_threads(n, [&](Comm& c) {
        torch::set_num_threads(1);
        auto net = wrapped(k, c, s);
        auto opt = sgd(*net);
        got[static_cast<std::size_t>(c.rank())] =
            script(opt, c.rank(), n, [&](const torch::Tensor& x, bool sw) { return net(x, sw); },
                   [&](const torch::Tensor& x) { return net->l1(x); });
      });
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        const torch::Tensor expected = want.narrow(0, r * rows_per_rank, rows_per_rank);
        CHECK((got[static_cast<std::size_t>(r)] - expected).abs().max().item<double>() <= 1e-12);
      }
    }
  }
}

TEST_CASE("fully_shard: a backward that throws under no_sync drops the window's sum; zero_grad and a fresh step "
          "train as in one process") {
  CAPTURE(test::test_seed());
  const Case k("no_sync failed backward");
  // Under no_sync: a backward, then one that throws in l1's (after the
  // root's and l2's have summed their part). Caught; zero_grad; a step.
  auto script = [&](auto& net, torch::optim::SGD& opt, int r, int n, auto no_sync) {
    opt.zero_grad();
    try {
      [[maybe_unused]] const auto guard = no_sync();
      torch::mse_loss(net(mine(k.x[0], r, n)), mine(k.y[0], r, n)).backward();
      armed = true;
      torch::mse_loss(net(mine(k.x[1], r, n)), mine(k.y[1], r, n)).backward();
      FAIL("the backward did not throw");
    } catch (const std::runtime_error& e) {
      CHECK(std::string(e.what()).find("the backward failed") != std::string::npos);
    }
    armed = false;
    opt.zero_grad();
    torch::mse_loss(net(mine(k.x[2], r, n)), mine(k.y[2], r, n)).backward();
    opt.step();
  };
  for (int n = 2; n <= 3; ++n) {
    Plain ref;
    k.load(ref);
    auto ref_opt = sgd(*ref);
    script(ref, ref_opt, -1, n, [] { return 0; });
    std::vector<torch::Tensor> want;
    for (const auto& t : ref->parameters()) want.push_back(t.detach().clone());
    for (const ShardingStrategy s : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp,
                                     ShardingStrategy::NoShard}) {
      CAPTURE(n);
      INFO("strategy = " << std::string(gradsync::name(s)));
      std::vector<torch::Tensor> got;
      gradsync::run_threads(n, [&](Comm& c) {
        torch::set_num_threads(1);
        auto net = wrapped(k, c, s);
        auto opt = sgd(*net);
        script(net, opt, c.rank(), n, [&] { return gradsync::no_sync(net); });
        auto values = final_values(net);
        if (c.rank() == 0) got = std::move(values);
      });
      CHECK(max_difference(got, want) <= 1e-12);
    }
  }
}

TEST_CASE("DistributedDataParallel: after a backward that threw part-way, with buckets launched, the next steps "
          "train as if it never was") {
  CAPTURE(test::test_seed());
  const Case k("ddp failed backward");
  constexpr int steps = 4, failing = 1;
  for (int n = 2; n <= 4; ++n) {
    CAPTURE(n);
    Plain ref;
    k.load(ref);
    auto ref_opt = sgd(*ref);
    for (int s = 0; s < steps; ++s) {
      if (s == failing) continue;
      const auto at = static_cast<std::size_t>(s);
      ref_opt.zero_grad();
      torch::mse_loss(ref(mine(k.x[at], -1, n)), mine(k.y[at], -1, n)).backward();
      ref_opt.step();
    }
    std::vector<torch::Tensor> want;
    for (const auto& t : ref->parameters()) want.push_back(t.detach().clone());
    std::vector<std::vector<torch::Tensor>> got(static_cast<std::size_t>(n));
    std::vector<std::string> errors(static_cast<std::size_t>(n) * steps);
    gradsync::run_threads(n, [&](Comm& c) {
      torch::set_num_threads(1);
      Plain net;
      k.load(net);
      // One parameter per bucket: the head's go before the failure in l1.
      gradsync::DistributedDataParallelOptions o;
      o.bucket_cap_bytes = o.first_bucket_cap_bytes = 8;
      gradsync::DistributedDataParallel ddp(c, net, o);
      auto opt = sgd(*net);
      for (int s = 0; s < steps; ++s) {
        const auto at = static_cast<std::size_t>(s);
        opt.zero_grad();
        armed = s == failing;
        try {
          torch::mse_loss(ddp(mine(k.x[at], c.rank(), n)), mine(k.y[at], c.rank(), n)).backward();
          opt.step();
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(c.rank()) * steps + at] = e.what();
        }
        armed = false;
      }
      for (const auto& t : net->parameters()) got[static_cast<std::size_t>(c.rank())].push_back(t.detach().clone());
    });
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      for (int s = 0; s < steps; ++s) {
        CAPTURE(s);
        const std::string& e = errors[static_cast<std::size_t>(r * steps + s)];
        CHECK((s == failing ? e.find("the backward failed") != std::string::npos : e.empty()));
      }
      CHECK(max_difference(got[static_cast<std::size_t>(r)], want) <= 1e-12);
    }
  }
}

}  // namespace test_torch_after_errors
