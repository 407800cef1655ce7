// DistributedDataParallel for LibTorch modules: parity with one process on
// the concatenated batch, no_sync accumulation and a rank that syncs late,
// unused parameters, overlap, frozen parameters, buffers, wrong use, and the
// data-loader sampler.
//
// Every rank's result is collected and checked on the main thread after
// run_threads, so a failing rank never leaves the others waiting.

#include "torch_ddp_support.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_torch_ddp {

namespace {

using Comm = gradsync::Communicator<gradsync::Threads>;
using namespace test_torch;

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int hidden = 20, bool with_unused = false, torch::Dtype dtype = torch::kFloat)
      : fc1(register_module("fc1", torch::nn::Linear(12, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, 16))),
        fc3(register_module("fc3", torch::nn::Linear(16, 5))) {
    if (with_unused) unused = register_module("unused", torch::nn::Linear(3, 7));
    to(dtype);
  }
  torch::Tensor forward(torch::Tensor x) { return fc3(torch::tanh(fc2(torch::relu(fc1(x))))); }
  /// `extra`: also trains `unused` (a branch some ranks take and others do not).
  torch::Tensor forward(torch::Tensor x, bool extra) {
    torch::Tensor out = forward(x);
    if (extra) out = out + unused->forward(torch::ones({x.size(0), 3}, x.options())).narrow(1, 0, 5);
    return out;
  }
  torch::nn::Linear fc1, fc2, fc3;
  torch::nn::Linear unused{nullptr};
};
TORCH_MODULE(Mlp);

/// Initial weights from the case's seed (LibTorch's default init).
std::vector<torch::Tensor> initial_weights(std::string_view salt, bool with_unused = false) {
  auto rng = test::rng_for(salt);
  torch::manual_seed(rng());
  Mlp m(20, with_unused);
  return snapshot(*m);
}

enum class Opt { sgd_momentum, adam };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt o, torch::nn::Module& m) {
  if (o == Opt::adam) return std::make_unique<torch::optim::Adam>(m.parameters(), torch::optim::AdamOptions(1e-2));
  return std::make_unique<torch::optim::SGD>(m.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}

/// max |a − b| over all tensors.
double max_abs(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, (a[i].to(torch::kDouble) - b[i].to(torch::kDouble)).abs().max().item<double>());
  }
  return worst;
}

/// `rows` samples whose inputs are of `dtype` (the model's).
Data typed_data(std::int64_t rows, std::string_view salt, torch::Dtype dtype) {
  Data d = make_data(rows, salt);
  d.x = d.x.to(dtype);
  return d;
}

/// One process, the whole batch: what the ranks together must reproduce.
std::vector<torch::Tensor> reference_run(const std::vector<torch::Tensor>& init, Opt o, const Data& d, int steps,
                                         bool with_unused = false) {
  Mlp m(20, with_unused, d.x.scalar_type());
  load(*m, init);
  auto opt = make_optimizer(o, *m);
  train(m, *opt, d.x, d.y, steps);
  return snapshot(*m);
}

torch::Tensor rows(const torch::Tensor& t, std::int64_t first, std::int64_t count) {
  return t.narrow(0, first, count);
}

/// Mlp's parameter i by name, in registration order.
std::string parameter_name(std::size_t i) {
  const char* names[] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"};
  return names[i];
}

}  // namespace

TEST_CASE("DistributedDataParallel: N ranks of batch b match one process on the N·b batch, bitwise alike across ranks") {
  CAPTURE(test::test_seed());
  const std::int64_t b = 5;  // per rank; odd on purpose
  const int steps = 5;
  const auto init = initial_weights("ddp parity init");
  // Adam runs in double. It divides each gradient by its own root mean
  // square, so where a gradient is mostly cancellation (its terms summed in
  // another order on N ranks than in one process) the update's rounding
  // error is the gradient's magnified many times: in float, 4 seeds in 60
  // ended between 2e-6 and 2e-5 from the reference. In double the largest in
  // 40 seeds was 9e-14. SGD is linear in the gradient: float stayed below
  // 1.3e-7, double below 4e-16.
  struct Case {
    Opt optimizer;
    torch::Dtype dtype;
    double tolerance;
  };
  for (const Case c : {Case{Opt::sgd_momentum, torch::kFloat, 1e-6}, Case{Opt::sgd_momentum, torch::kDouble, 1e-12},
                       Case{Opt::adam, torch::kDouble, 1e-10}}) {
    for (int n : {1, 2, 3, 4}) {
      CAPTURE(n);
      CAPTURE(static_cast<int>(c.optimizer));
      const std::string type_name = c10::toString(c.dtype);
      CAPTURE(type_name);
      const Data d = typed_data(n * b, "ddp parity data", c.dtype);
      const auto expected = reference_run(init, c.optimizer, d, steps);
      PerRank got = run_ranks(n, [&](Comm& comm) {
        Mlp m(20, false, c.dtype);
        // Only rank 0 starts from the reference weights: construction must broadcast them.
        if (comm.rank() == 0) load(*m, init);
        gradsync::DistributedDataParallel ddp(comm, m);
        auto opt = make_optimizer(c.optimizer, *m);
        const Data mine{rows(d.x, comm.rank() * b, b), rows(d.y, comm.rank() * b, b)};
        train(ddp, *opt, mine.x, mine.y, steps);
        return snapshot(*m);
      });
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        REQUIRE(got.errors[static_cast<std::size_t>(r)] == "");
        CHECK(bitwise_equal(got.params[static_cast<std::size_t>(r)], got.params[0]));
      }
      const double error = max_relative(got.params[0], expected);
      CAPTURE(error);
      CHECK(std::string(c10::toString(got.params[0][0].scalar_type())) == type_name);
      CHECK(error <= c.tolerance);
    }
  }
}

TEST_CASE("DistributedDataParallel: K micro-batches under no_sync match one step on the K-times batch") {
  CAPTURE(test::test_seed());
  const int n = 3, k = 4;
  const std::int64_t b = 3;
  const auto init = initial_weights("ddp no_sync init");
  const Data d = make_data(n * k * b, "ddp no_sync data");
  const auto expected = reference_run(init, Opt::sgd_momentum, d, 1);
  PerRank got = run_ranks(n, [&](Comm& comm) {
    Mlp m;
    load(*m, init);
    gradsync::DistributedDataParallel ddp(comm, m);
    auto opt = make_optimizer(Opt::sgd_momentum, *m);
    opt->zero_grad();
    // Rank r's micro-batch i is rows (i·n + r)·b: together the K·n pieces are the whole batch.
    auto micro = [&](int i) {
      const std::int64_t first = (static_cast<std::int64_t>(i) * n + comm.rank()) * b;
      // Each micro-loss is a mean over b; 1/K makes their sum the mean over K·b.
      (torch::nn::functional::cross_entropy(ddp(rows(d.x, first, b)), rows(d.y, first, b)) / k).backward();
    };
    {
      auto guard = ddp.no_sync();
      for (int i = 0; i + 1 < k; ++i) micro(i);
      REQUIRE(ddp.stats().buckets_launched == 0);
    }
    micro(k - 1);
    opt->step();
    return snapshot(*m);
  });
  for (int r = 0; r < n; ++r) REQUIRE(got.errors[static_cast<std::size_t>(r)] == "");
  CHECK(bitwise_equal(got.params[1], got.params[0]));
  CHECK(bitwise_equal(got.params[2], got.params[0]));
  CHECK(max_relative(got.params[0], expected) <= 1e-6);
}

TEST_CASE("DistributedDataParallel: one rank's backward under no_sync while the others sync fails every rank, "
          "naming both syncs") {
  auto rng = test::rng_for("ddp no_sync on one rank");
  CAPTURE(test::test_seed());
  const auto [n, odd] = draw_odd_rank(rng, 3, 3);
  // Counted from 1; steps after it give the odd rank's late sync a partner.
  const int bad = 1 + static_cast<int>(rng() % 3);
  const int steps = bad + 2;
  INFO("N = " << n << ", rank " << odd << " runs backward " << bad << " of " << steps << " under no_sync");
  const std::int64_t b = 4;
  const Data d = make_data(n * b, "ddp no_sync on one rank data");
  // The odd rank's sync of backwards `bad` and `bad` + 1 has the count of
  // the others' sync of backward `bad`: only the labels tell them apart.
  const Outcomes got = run_failing(n, [&](Comm& comm) {
    Mlp m;
    gradsync::DistributedDataParallel ddp(comm, m);
    auto opt = make_optimizer(Opt::sgd_momentum, *m);
    for (int s = 1; s <= steps; ++s) {
      opt->zero_grad();
      auto backward = [&] {
        torch::nn::functional::cross_entropy(ddp(rows(d.x, comm.rank() * b, b)), rows(d.y, comm.rank() * b, b))
            .backward();
      };
      if (comm.rank() == odd && s == bad) {
        auto guard = ddp.no_sync();
        backward();
      } else {
        backward();
      }
      opt->step();
    }
  });
  for (std::size_t r = 0; r < got.kind.size(); ++r) {
    INFO("rank " << r << ": " << got.kind[r] << ": " << got.what[r]);
    CHECK(got.kind[r] == "InvalidArgument");
    CHECK(got.what[r].find("sync " + std::to_string(bad) + ", all-reduce of bucket") != std::string::npos);
    CHECK(got.what[r].find("sync " + std::to_string(bad + 1) + ", all-reduce of bucket") != std::string::npos);
  }
  CHECK(got.seconds < 5.0);
}

TEST_CASE("DistributedDataParallel: two of equal shape on one communicator, their backwards in another order on one "
          "rank, fail every rank") {
  // A GAN's generator and discriminator: every bucket of one matches the
  // other's in count and step; only the number each took on the communicator differs.
  auto rng = test::rng_for("ddp two modules order");
  CAPTURE(test::test_seed());
  const auto [n, odd] = draw_odd_rank(rng, 3, 2);
  INFO("N = " << n << ", rank " << odd << " runs the second module's backward first");
  const Outcomes got = run_failing(n, [&](Comm& comm) {
    torch::manual_seed(0);
    torch::nn::Linear g(4, 4), d(4, 4);
    gradsync::DistributedDataParallel gen(comm, g), disc(comm, d);
    const torch::Tensor x = torch::ones({2, 4});
    torch::Tensor lg = gen(x).sum(), ld = (disc(x) * 100).sum();
    if (comm.rank() == odd) {
      ld.backward();
      lg.backward();
    } else {
      lg.backward();
      ld.backward();
    }
  });
  for (std::size_t r = 0; r < got.kind.size(); ++r) {
    INFO("rank " << r << ": " << got.kind[r] << ": " << got.what[r]);
    CHECK(got.kind[r] == "InvalidArgument");
    CHECK(got.what[r].find("ranks disagree") != std::string::npos);
    CHECK(got.what[r].find("trainer 2 of its communicator, sync 1, all-reduce of bucket") != std::string::npos);
  }
  CHECK(got.seconds < 5.0);
}

TEST_CASE("DistributedDataParallel: reset_stats() on one rank only changes nothing the ranks compare") {
  auto rng = test::rng_for("ddp reset_stats on one rank");
  CAPTURE(test::test_seed());
  const auto [n, odd] = draw_odd_rank(rng, 2, 3);
  INFO("N = " << n << ", rank " << odd << " resets its statistics after every step");
  const std::int64_t b = 4;
  const Data d = make_data(n * b, "ddp reset_stats data");
  PerRank got = run_ranks(n, [&](Comm& comm) {
    Mlp m;
    gradsync::DistributedDataParallel ddp(comm, m);
    auto opt = make_optimizer(Opt::sgd_momentum, *m);
    for (int s = 0; s < 3; ++s) {
      train(ddp, *opt, rows(d.x, comm.rank() * b, b), rows(d.y, comm.rank() * b, b), 1);
      // What a program that prints rank 0's figures per epoch does.
      if (comm.rank() == odd) ddp.reset_stats();
    }
    return snapshot(*m);
  });
  for (int r = 0; r < n; ++r) REQUIRE(got.errors[static_cast<std::size_t>(r)] == "");
  for (int r = 1; r < n; ++r) CHECK(bitwise_equal(got.params[static_cast<std::size_t>(r)], got.params[0]));
}

TEST_CASE("DistributedDataParallel: unused parameters contribute zeros with find_unused, and are named without it") {
  CAPTURE(test::test_seed());
  const int n = 3;
  const std::int64_t b = 4;
  const auto init = initial_weights("ddp unused init", /*with_unused=*/true);
  // Double, for Adam (see the parity case above).
  const Data d = typed_data(n * b, "ddp unused data", torch::kDouble);

  SUBCASE("find_unused_parameters on: trains as if the parameter were absent, and overlaps") {
    const auto expected = reference_run(init, Opt::adam, d, 3, /*with_unused=*/true);
    std::vector<std::size_t> early(n);
    PerRank got = run_ranks(n, [&](Comm& comm) {
      Mlp m(20, true, torch::kDouble);
      load(*m, init);
      gradsync::DistributedDataParallelOptions o;
      o.find_unused_parameters = true;
      o.first_bucket_cap_bytes = 256;  // `unused` (last registered, 28 doubles) is bucket 0 alone
      o.bucket_cap_bytes = 1024;
      gradsync::DistributedDataParallel ddp(comm, m, o);
      auto opt = make_optimizer(Opt::adam, *m);
      train(ddp, *opt, rows(d.x, comm.rank() * b, b), rows(d.y, comm.rank() * b, b), 3);
      early[static_cast<std::size_t>(comm.rank())] = ddp.stats().buckets_launched_early;
      return snapshot(*m);
    });
    for (int r = 0; r < n; ++r) {
      REQUIRE(got.errors[static_cast<std::size_t>(r)] == "");
      // The graph walk marks `unused` ready when backward starts, so bucket 0
      // does not hold the others back until finish().
      CHECK(early[static_cast<std::size_t>(r)] > 0);
    }
    CHECK(bitwise_equal(got.params[2], got.params[0]));
    CHECK(max_relative(got.params[0], expected) <= 1e-10);
  }

  SUBCASE("find_unused_parameters off: every rank's backward throws naming the parameter") {
    PerRank got = run_ranks(n, [&](Comm& comm) {
      Mlp m(20, true, torch::kDouble);
      gradsync::DistributedDataParallel ddp(comm, m);
      torch::nn::functional::cross_entropy(ddp(rows(d.x, comm.rank() * b, b)), rows(d.y, comm.rank() * b, b))
          .backward();
      return snapshot(*m);
    });
    for (int r = 0; r < n; ++r) {
      CAPTURE(got.errors[static_cast<std::size_t>(r)]);
      CHECK(got.errors[static_cast<std::size_t>(r)].find("'unused.weight', 'unused.bias'") != std::string::npos);
      CHECK(got.errors[static_cast<std::size_t>(r)].find("find_unused_parameters") != std::string::npos);
    }
  }

  SUBCASE("a parameter used on some ranks only: every rank ends the step, alike") {
    // With the gradients zeroed, or reset to undefined (as zero_grad with
    // set_to_none leaves them): then the ranks that did not use it get the
    // averaged gradient too (PyTorch's DDP gives them the bucket's values),
    // or their optimizer would skip what the others step; and in a step
    // where no rank uses it, its grad stays undefined, and it stays put.
    for (const bool reset : {false, true}) {
      CAPTURE(reset);
      std::vector<int> defined(n), idle(n);
      PerRank got = run_ranks(n, [&](Comm& comm) {
        Mlp m(20, true, torch::kDouble);
        if (comm.rank() == 0) load(*m, init);
        gradsync::DistributedDataParallelOptions o;
        o.find_unused_parameters = true;
        gradsync::DistributedDataParallel ddp(comm, m, o);
        auto opt = make_optimizer(Opt::sgd_momentum, *m);
        for (int s = 0; s < 2; ++s) {
          if (reset) {
            for (auto& p : m->parameters()) p.mutable_grad().reset();
          } else {
            opt->zero_grad();
          }
          // Rank 1 alone takes the branch through `unused`: the others contribute zeros for it.
          torch::nn::functional::cross_entropy(ddp(rows(d.x, comm.rank() * b, b), comm.rank() == 1),
                                               rows(d.y, comm.rank() * b, b))
              .backward();
          defined[static_cast<std::size_t>(comm.rank())] = m->unused->weight.grad().defined() ? 1 : 0;
          opt->step();
        }
        if (reset) {
          for (auto& p : m->parameters()) p.mutable_grad().reset();
          torch::nn::functional::cross_entropy(ddp(rows(d.x, comm.rank() * b, b), false), rows(d.y, comm.rank() * b, b))
              .backward();
          const torch::Tensor before = m->unused->weight.clone();
          opt->step();
          idle[static_cast<std::size_t>(comm.rank())] =
              !m->unused->weight.grad().defined() && torch::equal(before, m->unused->weight) ? 1 : 0;
        }
        return snapshot(*m);
      });
      for (int r = 0; r < n; ++r) {
        REQUIRE(got.errors[static_cast<std::size_t>(r)] == "");
        CHECK(defined[static_cast<std::size_t>(r)] == 1);
        CHECK(idle[static_cast<std::size_t>(r)] == (reset ? 1 : 0));
      }
      CHECK(bitwise_equal(got.params[1], got.params[0]));
      CHECK(bitwise_equal(got.params[2], got.params[0]));
      // `unused` moved: rank 1's gradient reached everyone, divided by N.
      CHECK_FALSE(torch::equal(got.params[0][6], init[6]));
    }
  }

  SUBCASE("a forward under NoGradGuard between a forward and its backward changes nothing") {
    // It has no graph to walk: the parameters its backward reaches are the first forward's.
    auto run = [&](bool evaluate) {
      return run_ranks(n, [&](Comm& comm) {
        Mlp m(20, true, torch::kDouble);
        load(*m, init);
        gradsync::DistributedDataParallelOptions o;
        o.find_unused_parameters = true;
        gradsync::DistributedDataParallel ddp(comm, m, o);
        auto opt = make_optimizer(Opt::adam, *m);
        for (int s = 0; s < 2; ++s) {
          opt->zero_grad();
          const auto x = rows(d.x, comm.rank() * b, b);
          const torch::Tensor loss = torch::nn::functional::cross_entropy(ddp(x), rows(d.y, comm.rank() * b, b));
          if (evaluate) {
            torch::NoGradGuard no_grad;
            ddp(x);
          }
          loss.backward();
          opt->step();
        }
        return snapshot(*m);
      });
    };
    const PerRank plain = run(false), evaluated = run(true);
    for (int r = 0; r < n; ++r) {
      REQUIRE(evaluated.errors[static_cast<std::size_t>(r)] == "");
      CHECK(bitwise_equal(evaluated.params[static_cast<std::size_t>(r)], plain.params[static_cast<std::size_t>(r)]));
    }
  }
}

TEST_CASE("DistributedDataParallel: buckets start while backward runs, in reverse registration order") {
  CAPTURE(test::test_seed());
  const int n = 2;
  const Data d = make_data(n * 4, "ddp overlap data");
  std::vector<std::size_t> early(n), launched(n), buckets(n);
  std::vector<std::vector<gradsync::BucketInfo>> plans(n);
  PerRank got = run_ranks(n, [&](Comm& comm) {
    Mlp m;
    gradsync::DistributedDataParallelOptions o;
    o.first_bucket_cap_bytes = 64;
    o.bucket_cap_bytes = 1024;
    gradsync::DistributedDataParallel ddp(comm, m, o);
    torch::nn::functional::cross_entropy(ddp(rows(d.x, comm.rank() * 4, 4)), rows(d.y, comm.rank() * 4, 4))
        .backward();
    const auto r = static_cast<std::size_t>(comm.rank());
    early[r] = ddp.stats().buckets_launched_early;
    launched[r] = ddp.stats().buckets_launched;
    plans[r] = ddp.buckets();
    return snapshot(*m);
  });
  for (int r = 0; r < n; ++r) {
    const auto i = static_cast<std::size_t>(r);
    REQUIRE(got.errors[i] == "");
    REQUIRE(plans[i].size() >= 3);
    CHECK(launched[i] == plans[i].size());
    // Some bucket was launched from an autograd hook, before backward ended.
    CHECK(early[i] >= 1);
    // Bucket 0 holds the last registered parameter (fc3.bias).
    CHECK(plans[i][0].last_unit == 5);
  }
}

TEST_CASE("DistributedDataParallel: a frozen first layer and BatchNorm statistics start as rank 0's, and N ranks "
          "match one process on the N·b batch") {
  CAPTURE(test::test_seed());
  const std::int64_t b = 4;
  const int steps = 4;
  auto rng = test::rng_for("ddp frozen init");
  for (int n : {3, 4, 5}) {
    CAPTURE(n);
    // Every rank starts from weights and statistics of its own; rank 0's are the reference's.
    std::vector<std::vector<torch::Tensor>> init;
    for (int r = 0; r < n; ++r) init.push_back(backbone_state(rng()));
    const Data d = typed_data(n * b, "ddp frozen data", torch::kDouble);
    // Fine-tuning, in double and with SGD (see the parity case above).
    BackboneNet ref = fine_tuned_backbone(init[0]);
    const auto expected = train_alone(ref, d.x, d.y, steps);

    PerRank got = run_ranks(n, [&](Comm& comm) {
      BackboneNet m = fine_tuned_backbone(init[static_cast<std::size_t>(comm.rank())]);
      return train_ddp(comm, m, rows(d.x, comm.rank() * b, b), rows(d.y, comm.rank() * b, b), steps);
    });
    double spread = 0;
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      REQUIRE(got.errors[static_cast<std::size_t>(r)] == "");
      spread = std::max(spread, max_abs(got.params[static_cast<std::size_t>(r)], got.params[0]));
      CHECK(bitwise_equal(got.params[static_cast<std::size_t>(r)], got.params[0]));
    }
    const double error = max_relative(got.params[0], expected), error_abs = max_abs(got.params[0], expected);
    CAPTURE(spread);
    CAPTURE(error);
    CAPTURE(error_abs);
    CHECK(error <= 1e-12);
    // fc1 (parameters 0 and 1) and the statistics (from 6 on) did not move: the rest did.
    CHECK(torch::equal(got.params[0][0], init[0][0]));
    CHECK(torch::equal(got.params[0][6], init[0][6]));
    CHECK(torch::equal(got.params[0][7], init[0][7]));
    CHECK(max_relative({got.params[0][4]}, {init[0][4]}) >= 1e-3);
  }
}

TEST_CASE("DistributedDataParallel: buffers are broadcast before a forward exactly when PyTorch's DDP does so") {
  // A BatchNorm in training mode first, so each forward moves its running
  // statistics by its own rank's batch.
  struct NetImpl : torch::nn::Module {
    NetImpl() : bn(register_module("bn", torch::nn::BatchNorm1d(12))), fc(register_module("fc", torch::nn::Linear(12, 5))) {
      to(torch::kDouble);
    }
    torch::Tensor forward(torch::Tensor x) { return fc(bn(x)); }
    torch::nn::BatchNorm1d bn;
    torch::nn::Linear fc;
  };
  CAPTURE(test::test_seed());
  const std::int64_t b = 4;
  struct Forward {
    bool grad, synced;
  };
  // No gradients (a NoGradGuard, as when re-estimating statistics), or under
  // no_sync: then the next forward keeps each rank's own statistics.
  const std::vector<Forward> plan = {{true, true},  {true, false}, {true, false}, {true, true},
                                     {false, true}, {false, true}, {true, true},  {true, true}};
  const auto forwards = static_cast<std::int64_t>(plan.size());
  for (const auto& c : {std::pair{3, true}, std::pair{5, true}, std::pair{3, false}}) {
    const int n = c.first;
    const bool broadcast_buffers = c.second;
    CAPTURE(n);
    CAPTURE(broadcast_buffers);
    const Data d = typed_data(n * forwards * b, "ddp buffer schedule data", torch::kDouble);
    auto batch = [&](int r, std::size_t k) { return (static_cast<std::int64_t>(k) * n + r) * b; };
    // Each rank's running mean and variance after each forward.
    std::vector<std::vector<torch::Tensor>> seen(n, std::vector<torch::Tensor>(plan.size()));
    PerRank got = run_ranks(n, [&](Comm& comm) {
      const int r = comm.rank();
      auto net = std::make_shared<NetImpl>();
      {
        torch::NoGradGuard no_grad;
        net->bn->running_mean.fill_(r + 1.0);
        net->bn->running_var.fill_(r + 2.0);
      }
      gradsync::DistributedDataParallelOptions o;
      o.broadcast_buffers = broadcast_buffers;
      gradsync::DistributedDataParallel ddp(comm, net, o);
      for (std::size_t k = 0; k < plan.size(); ++k) {
        const torch::Tensor x = rows(d.x, batch(r, k), b), y = rows(d.y, batch(r, k), b);
        if (!plan[k].grad) {
          torch::NoGradGuard no_grad;
          ddp(x);
        } else if (!plan[k].synced) {
          auto guard = ddp.no_sync();
          torch::nn::functional::cross_entropy(ddp(x), y).backward();
        } else {
          torch::nn::functional::cross_entropy(ddp(x), y).backward();
        }
        seen[static_cast<std::size_t>(r)][k] = torch::cat({net->bn->running_mean, net->bn->running_var}).clone();
      }
      return snapshot(*net);
    });
    for (int r = 0; r < n; ++r) REQUIRE(got.errors[static_cast<std::size_t>(r)] == "");

    // PyTorch's rule, replayed on one BatchNorm per rank: construction gives
    // every rank rank 0's statistics; a forward starts from rank 0's when the
    // one before it ran with gradients and synced (and at the first).
    std::vector<torch::nn::BatchNorm1d> replay;
    for (int r = 0; r < n; ++r) {
      replay.emplace_back(12);
      replay.back()->to(torch::kDouble);
      torch::NoGradGuard no_grad;
      replay.back()->running_mean.fill_(1.0);
      replay.back()->running_var.fill_(2.0);
    }
    bool from_rank0 = true;
    for (std::size_t k = 0; k < plan.size(); ++k) {
      CAPTURE(k);
      torch::NoGradGuard no_grad;
      if (broadcast_buffers && from_rank0) {
        for (int r = 1; r < n; ++r) {
          replay[static_cast<std::size_t>(r)]->running_mean.copy_(replay[0]->running_mean);
          replay[static_cast<std::size_t>(r)]->running_var.copy_(replay[0]->running_var);
        }
      }
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        auto& bn = replay[static_cast<std::size_t>(r)];
        bn(rows(d.x, batch(r, k), b));
        const torch::Tensor want = torch::cat({bn->running_mean, bn->running_var});
        const torch::Tensor& have = seen[static_cast<std::size_t>(r)][k];
        const double diff = (have - want).abs().max().item<double>();
        CAPTURE(diff);
        CHECK(diff <= 1e-12);
      }
      from_rank0 = plan[k].grad && plan[k].synced;
    }
  }
}

TEST_CASE("DistributedDataParallel: a parameter frozen or unfrozen after construction is named at the next forward") {
  CAPTURE(test::test_seed());
  const int n = 3;
  const std::int64_t b = 4;
  const auto init = initial_weights("ddp refreeze init");
  const Data d = make_data(n * b, "ddp refreeze data");
  struct Case {
    const char* name;
    bool frozen_at_construction;
    const char* was;
    const char* now;
  };
  for (const Case c : {Case{"frozen after construction", false, "trainable (requires_grad true)", "frozen (requires_grad false)"},
                       Case{"unfrozen after construction", true, "frozen (requires_grad false)", "trainable (requires_grad true)"}}) {
    const std::string case_name = c.name;
    CAPTURE(case_name);
    std::vector<std::string> message(n);
    std::vector<std::vector<torch::Tensor>> after_first_step(n);
    PerRank got = run_ranks(n, [&](Comm& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      const Data mine{rows(d.x, comm.rank() * b, b), rows(d.y, comm.rank() * b, b)};
      // Only rank 0 starts from `init`: a parameter frozen at construction must be broadcast too.
      Mlp m;
      if (r == 0) load(*m, init);
      m->fc1->weight.requires_grad_(!c.frozen_at_construction);
      {
        gradsync::DistributedDataParallel ddp(comm, m);
        auto opt = make_optimizer(Opt::sgd_momentum, *m);
        train(ddp, *opt, mine.x, mine.y, 1);
        after_first_step[r] = snapshot(*m);
        m->fc1->weight.requires_grad_(c.frozen_at_construction);
        try {
          ddp(mine.x);
        } catch (const gradsync::InvalidArgument& e) {
          message[r] = e.what();
        }
      }
      // What the message asks for: a new DistributedDataParallel over the new set.
      gradsync::DistributedDataParallel ddp(comm, m);
      auto opt = make_optimizer(Opt::sgd_momentum, *m);
      train(ddp, *opt, mine.x, mine.y, 2);
      return snapshot(*m);
    });
    for (int r = 0; r < n; ++r) {
      const auto i = static_cast<std::size_t>(r);
      CAPTURE(r);
      REQUIRE(got.errors[i] == "");
      CAPTURE(message[i]);
      CHECK(message[i].find("parameter 'fc1.weight' was " + std::string(c.was)) != std::string::npos);
      CHECK(message[i].find("is now " + std::string(c.now)) != std::string::npos);
      CHECK(message[i].find("construct a new one") != std::string::npos);
      CHECK(bitwise_equal(after_first_step[i], after_first_step[0]));
      CHECK(bitwise_equal(got.params[i], got.params[0]));
    }
  }
}

TEST_CASE("DistributedDataParallel: buffers are rank 0's after construction and at the first forward") {
  struct NetImpl : torch::nn::Module {
    NetImpl() : fc(register_module("fc", torch::nn::Linear(4, 3))), bn(register_module("bn", torch::nn::BatchNorm1d(3))) {}
    torch::Tensor forward(torch::Tensor x) { return bn(fc(x)); }
    torch::nn::Linear fc;
    torch::nn::BatchNorm1d bn;
  };
  const int n = 3;
  std::vector<torch::Tensor> after_ctor(n), after_forward(n);
  PerRank got = run_ranks(n, [&](Comm& comm) {
    auto net = std::make_shared<NetImpl>();
    // A NoGradGuard over the forward too: the first forward broadcasts all the same.
    torch::NoGradGuard no_grad;
    net->bn->running_mean.fill_(comm.rank() + 1.0);
    gradsync::DistributedDataParallel ddp(comm, net);
    const auto r = static_cast<std::size_t>(comm.rank());
    after_ctor[r] = net->bn->running_mean.clone();
    net->eval();  // eval: forward reads the statistics and leaves them as they are
    net->bn->running_mean.fill_(10.0 * (comm.rank() + 1));
    ddp(torch::ones({2, 4}));
    after_forward[r] = net->bn->running_mean.clone();
    return snapshot(*net);
  });
  for (int r = 0; r < n; ++r) {
    const auto i = static_cast<std::size_t>(r);
    REQUIRE(got.errors[i] == "");
    CHECK(torch::equal(after_ctor[i], torch::full({3}, 1.0f)));
    CHECK(torch::equal(after_forward[i], torch::full({3}, 10.0f)));
    // And the parameters are rank 0's.
    CHECK(bitwise_equal(got.params[i], got.params[0]));
  }
}

TEST_CASE("DistributedDataParallel: wrong use is a clear error naming the parameter, on every rank") {
  const int n = 3;
  SUBCASE("a non-contiguous parameter") {
    struct NetImpl : torch::nn::Module {
      NetImpl() { w = register_parameter("w", torch::randn({4, 3}).t()); }
      torch::Tensor w;
    };
    PerRank got = run_ranks(n, [&](Comm& comm) {
      gradsync::DistributedDataParallel ddp(comm, std::make_shared<NetImpl>());
      return std::vector<torch::Tensor>{};
    });
    for (const auto& e : got.errors) CHECK(e.find("parameter 'w'") != std::string::npos);
    for (const auto& e : got.errors) CHECK(e.find("not contiguous") != std::string::npos);
  }
  SUBCASE("a parameter on another device than the backend's memory") {
    // Debian's LibTorch has no CUDA; the meta device stands in for "not on the CPU".
    struct NetImpl : torch::nn::Module {
      NetImpl() {
        register_parameter("a", torch::zeros({3}));
        register_parameter("b", torch::empty({3}, torch::kMeta));
      }
    };
    PerRank got = run_ranks(n, [&](Comm& comm) {
      gradsync::DistributedDataParallel ddp(comm, std::make_shared<NetImpl>());
      return std::vector<torch::Tensor>{};
    });
    for (const auto& e : got.errors) CHECK(e.find("parameter 'b' cannot be synchronised: it is on meta") != std::string::npos);
  }
  SUBCASE("parameters of two dtypes") {
    PerRank got = run_ranks(n, [&](Comm& comm) {
      Mlp m;
      m->fc2->to(torch::kDouble);
      gradsync::DistributedDataParallel ddp(comm, m);
      return std::vector<torch::Tensor>{};
    });
    for (const auto& e : got.errors) CHECK(e.find("'fc2.weight' is Double") != std::string::npos);
  }
  SUBCASE("a parameter that changed shape after construction") {
    PerRank got = run_ranks(n, [&](Comm& comm) {
      Mlp m;
      gradsync::DistributedDataParallel ddp(comm, m);
      m->fc1->weight.set_data(torch::zeros({21, 12}));
      ddp(torch::ones({1, 12}));
      return std::vector<torch::Tensor>{};
    });
    for (const auto& e : got.errors) CHECK(e.find("'fc1.weight' changed shape") != std::string::npos);
  }
  SUBCASE("a parameter that became a strided view of its own data after construction") {
    PerRank got = run_ranks(n, [&](Comm& comm) {
      Mlp m;
      gradsync::DistributedDataParallel ddp(comm, m);
      const torch::Tensor w = m->fc1->weight.data();
      m->fc1->weight.set_data(w.as_strided(w.sizes(), {1, w.size(0)}));
      ddp(torch::ones({1, 12}));
      return std::vector<torch::Tensor>{};
    });
    for (const auto& e : got.errors) CHECK(e.find("'fc1.weight' changed layout") != std::string::npos);
  }
  SUBCASE("ranks that wrap different modules") {
    PerRank got = run_ranks(n, [&](Comm& comm) {
      Mlp m(comm.rank() == 2 ? 21 : 20);
      gradsync::DistributedDataParallel ddp(comm, m);
      return std::vector<torch::Tensor>{};
    });
    for (const auto& e : got.errors) {
      CAPTURE(e);
      CHECK(e.find("fc1.weight") != std::string::npos);
    }
  }
  SUBCASE("ranks that would treat a NaN differently") {
    PerRank got = run_ranks(n, [&](Comm& comm) {
      gradsync::DistributedDataParallelOptions o;
      if (comm.rank() == 1) o.on_nonfinite = gradsync::OnNonfinite::skip_step;
      gradsync::DistributedDataParallel ddp(comm, Mlp(), o);
      return std::vector<torch::Tensor>{};
    });
    for (const auto& e : got.errors) {
      CAPTURE(e);
      CHECK(e.find("on_nonfinite skip_step") != std::string::npos);
    }
  }
}

/// Where on_nonfinite's case breaks a gradient: rank `rank`'s gradient of
/// parameter `param`, element `element`, set to `value` in step `step`.
struct NonfinitePoison {
  int world = 3, rank = 0, step = 0;
  std::size_t param = 0;
  std::int64_t element = 0;
  float value = 0;
};

/// What one rank of on_nonfinite's case saw.
struct NonfiniteSeen {
  std::vector<std::string> errors;  ///< per step: what backward() threw, or ""
  std::vector<int> stepped;         ///< per step: ddp.step() ran the optimizer
  std::vector<int> finite;          ///< per step: step_is_finite() after backward
  std::vector<torch::Tensor> params;
  std::size_t skipped = 0;
};

TEST_CASE("DistributedDataParallel: on_nonfinite throws on every rank naming the step and parameter, skips the "
          "optimizer step, or ignores") {
  CAPTURE(test::test_seed());
  auto rng = test::rng_for("ddp nonfinite");
  constexpr int steps = 4;
  constexpr std::int64_t b = 3;
  NonfinitePoison p;
  p.world = std::uniform_int_distribution<int>(3, 5)(rng);
  p.rank = std::uniform_int_distribution<int>(0, p.world - 1)(rng);
  p.step = std::uniform_int_distribution<int>(0, steps - 2)(rng);
  const auto init = initial_weights("ddp nonfinite init");
  p.param = std::uniform_int_distribution<std::size_t>(0, init.size() - 1)(rng);
  p.element = std::uniform_int_distribution<std::int64_t>(0, init[p.param].numel() - 1)(rng);
  const float values[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()};
  p.value = values[std::uniform_int_distribution<int>(0, 2)(rng)];
  INFO("world " << p.world << ", rank " << p.rank << ", step " << p.step << ", parameter " << p.param
                << " element " << p.element << " = " << p.value);
  const Data d = make_data(steps * p.world * b, "ddp nonfinite data");

  // `poisoned`: p's gradient is broken; `leave_out`: p's step is not run at all (the reference).
  auto run = [&](gradsync::OnNonfinite policy, bool poisoned, bool leave_out) {
    std::vector<NonfiniteSeen> seen(static_cast<std::size_t>(p.world));
    gradsync::run_threads(p.world, [&](Comm& comm) {
      torch::set_num_threads(1);
      NonfiniteSeen& me = seen[static_cast<std::size_t>(comm.rank())];
      Mlp m;
      load(*m, init);
      gradsync::DistributedDataParallelOptions o;
      o.on_nonfinite = policy;
      gradsync::DistributedDataParallel ddp(comm, m, o);
      torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-2));
      for (int s = 0; s < steps; ++s) {
        if (leave_out && s == p.step) continue;
        opt.zero_grad();
        const std::int64_t first = (s * p.world + comm.rank()) * b;
        torch::Tensor loss = torch::nn::functional::cross_entropy(ddp(rows(d.x, first, b)), rows(d.y, first, b));
        // A hook before the accumulator: the bad value enters this rank's own gradient, before the reduction.
        const bool bad = poisoned && s == p.step && comm.rank() == p.rank;
        torch::Tensor target = m->parameters()[p.param];
        unsigned hook = 0;
        if (bad) {
          hook = target.register_hook([&](torch::Tensor g) {
            g = g.clone(at::MemoryFormat::Contiguous);
            g.view(-1)[p.element] = p.value;
            return g;
          });
        }
        std::string error;
        try {
          loss.backward();
        } catch (const gradsync::Error& e) {
          error = e.what();
        }
        if (bad) target.remove_hook(hook);
        me.errors.push_back(error);
        me.finite.push_back(ddp.step_is_finite());
        // A caller that caught the error goes on with the next batch without stepping.
        me.stepped.push_back(error.empty() && ddp.step(opt));
      }
      me.params = snapshot(*m);
      me.skipped = ddp.skipped_steps();
    });
    return seen;
  };

  const auto reference = run(gradsync::OnNonfinite::throw_error, false, true);
  for (const gradsync::OnNonfinite policy :
       {gradsync::OnNonfinite::throw_error, gradsync::OnNonfinite::skip_step, gradsync::OnNonfinite::ignore}) {
    INFO("on_nonfinite = " << std::string(gradsync::name(policy)));
    const auto seen = run(policy, true, false);
    for (std::size_t r = 0; r < seen.size(); ++r) {
      CAPTURE(r);
      const NonfiniteSeen& s = seen[r];
      REQUIRE(s.errors.size() == std::size_t(steps));
      for (int k = 0; k < steps; ++k) {
        const auto ks = static_cast<std::size_t>(k);
        const bool hit = k == p.step && policy != gradsync::OnNonfinite::ignore;
        if (!(hit && policy == gradsync::OnNonfinite::throw_error)) CHECK(s.errors[ks] == "");
        CHECK(s.finite[ks] == (hit ? 0 : 1));
        CHECK(s.stepped[ks] == (hit ? 0 : 1));
      }
      if (policy == gradsync::OnNonfinite::ignore) {
        // The bad value reached the optimizer: some parameter is NaN or Inf now.
        CHECK(std::any_of(s.params.begin(), s.params.end(),
                          [](const torch::Tensor& t) { return !torch::isfinite(t).all().item<bool>(); }));
        continue;
      }
      // As if the bad step had never run: the optimizer's state is untouched.
      CHECK(bitwise_equal(s.params, reference[r].params));
      if (policy == gradsync::OnNonfinite::throw_error) {
        const std::string& e = s.errors[static_cast<std::size_t>(p.step)];
        CAPTURE(e);
        CHECK(e.find("step " + std::to_string(p.step + 1) + " ") != std::string::npos);
        CHECK(e.find("went non-finite") != std::string::npos);
        CHECK(e.find("parameter '" + parameter_name(p.param) + "' holds a NaN or an Inf") != std::string::npos);
        CHECK(s.skipped == 0);
      } else {
        CHECK(s.skipped == 1);
      }
    }
  }
}

TEST_CASE("TorchDistributedSampler: this rank's share, epoch by epoch, resumed mid-epoch at any world size that can continue it") {
  const int n = 3;
  const std::int64_t length = 23;  // not divisible by n: the last rank's share is padded
  const auto data = torch::arange(length, torch::kFloat).unsqueeze(1);
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    gradsync::SamplerOptions so;
    so.seed = 7;
    auto loader = torch::data::make_data_loader(
        torch::data::datasets::TensorDataset(data).map(torch::data::transforms::Stack<torch::data::TensorExample>()),
        gradsync::TorchDistributedSampler(static_cast<std::size_t>(length), n, r, so),
        torch::data::DataLoaderOptions(4));
    for (std::uint64_t epoch = 0; epoch < 2; ++epoch) {
      std::vector<std::size_t> seen;
      for (auto& batch : *loader) {
        for (std::int64_t i = 0; i < batch.data.size(0); ++i) seen.push_back(static_cast<std::size_t>(batch.data[i][0].item<float>()));
      }
      gradsync::DistributedSampler expected(static_cast<std::size_t>(length), n, r, so);
      expected.set_epoch(epoch);
      CHECK(seen == expected.indices());
    }
  }
  // Save after two batches of epoch 1, load into a fresh sampler: the rest of epoch 1 follows.
  auto load = [](torch::serialize::OutputArchive& out, gradsync::TorchDistributedSampler& to) {
    std::ostringstream bytes;
    out.save_to(bytes);
    torch::serialize::InputArchive in;
    std::istringstream is(bytes.str());
    in.load_from(is);
    to.load(in);
  };
  auto round_trip = [&](const gradsync::TorchDistributedSampler& from, gradsync::TorchDistributedSampler& to) {
    torch::serialize::OutputArchive out;
    from.save(out);
    load(out, to);
  };
  gradsync::TorchDistributedSampler a(static_cast<std::size_t>(length), n, 1);
  a.set_epoch(1);
  auto first = a.next(3).value();
  auto second = a.next(3).value();
  gradsync::TorchDistributedSampler b(static_cast<std::size_t>(length), n, 1);
  round_trip(a, b);
  b.reset();  // what the loader does at begin(): it must not start the epoch over
  std::vector<std::size_t> rest;
  while (auto batch = b.next(5)) rest.insert(rest.end(), batch->begin(), batch->end());
  std::vector<std::size_t> all = first;
  all.insert(all.end(), second.begin(), second.end());
  all.insert(all.end(), rest.begin(), rest.end());
  gradsync::DistributedSampler expected(static_cast<std::size_t>(length), n, 1);
  expected.set_epoch(1);
  CHECK(b.epoch() == 1);
  CHECK(all == expected.indices());
  // An archive of an earlier version (the epoch and this rank's position) loads as it did.
  torch::serialize::OutputArchive legacy;
  legacy.write("epoch", torch::tensor(std::int64_t{1}), /*is_buffer=*/true);
  legacy.write("position", torch::tensor(std::int64_t{6}), /*is_buffer=*/true);
  gradsync::TorchDistributedSampler old(static_cast<std::size_t>(length), n, 1);
  load(legacy, old);
  old.reset();
  CHECK(old.next(100).value() == rest);

  // Every rank at 6 of 8: 18 of the epoch's 23 taken. Two ranks continue
  // from 9 of their 12; four would repeat or skip one and are refused, as is
  // another dataset.
  for (int r = 0; r < 2; ++r) {
    gradsync::TorchDistributedSampler two(static_cast<std::size_t>(length), 2, r);
    round_trip(a, two);
    two.reset();
    std::vector<std::size_t> left;
    while (auto batch = two.next(4)) left.insert(left.end(), batch->begin(), batch->end());
    gradsync::DistributedSampler at_two(static_cast<std::size_t>(length), 2, r);
    at_two.set_epoch(1);
    const auto order = at_two.indices();
    CHECK(left == std::vector<std::size_t>(order.begin() + 9, order.end()));
  }
  gradsync::TorchDistributedSampler four(static_cast<std::size_t>(length), 4, 0);
  CHECK_THROWS_WITH_AS(round_trip(a, four), doctest::Contains("without repeating or skipping"),
                       gradsync::InvalidArgument);
  gradsync::TorchDistributedSampler longer(static_cast<std::size_t>(length) + 1, n, 1);
  CHECK_THROWS_WITH_AS(round_trip(a, longer), doctest::Contains("over 23 samples"), gradsync::InvalidArgument);
  // A finished epoch resumes finished at another world size: nothing left
  // of it, then the next epoch from its start.
  while (a.next(8)) {
  }
  gradsync::TorchDistributedSampler done(static_cast<std::size_t>(length), 4, 3);
  round_trip(a, done);
  done.reset();
  CHECK_FALSE(done.next(4).has_value());
  done.reset();
  CHECK(done.epoch() == 2);
  CHECK(done.next(100).value().size() == done.num_samples());
}

TEST_CASE("tensor_span shares a tensor's memory and refuses what it cannot") {
  auto t = torch::arange(6, torch::kFloat);
  auto s = gradsync::tensor_span<float>(t, "t");
  CHECK(s.data() == t.data_ptr<float>());
  CHECK(s.size() == 6);
  CHECK(gradsync::data_type_of(torch::kBFloat16) == gradsync::DataType::bfloat16);
  CHECK(gradsync::data_type_of(torch::kHalf) == gradsync::DataType::float16);
  CHECK_FALSE(gradsync::data_type_of(torch::kBool).has_value());
  CHECK_THROWS_WITH_AS(gradsync::tensor_span<double>(t, "t"), doctest::Contains("not the one asked for"),
                       gradsync::InvalidArgument);
  CHECK_THROWS_WITH_AS(gradsync::tensor_span<float>(t.view({2, 3}).t(), "u"), doctest::Contains("u as a buffer"),
                       gradsync::InvalidArgument);
}

}  // namespace test_torch_ddp
