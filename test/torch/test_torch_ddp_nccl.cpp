// DistributedDataParallel on CUDA tensors over Nccl: one rank per
// visible GPU, each on its own thread, against one LibTorch process on the
// concatenated batch; refusals of tensors on the wrong device. A file of the
// LibTorch tests' binary where NCCL is found, run as its helper
// `test_torch_ddp --helper torch_ddp_nccl [DOCTEST OPTIONS]`: without a GPU,
// or with a LibTorch built without CUDA (Debian's), that reports SKIP (exit
// 77) and is never counted as passed.
//
// Tolerances: float32 as in test_torch_ddp (1e-6 relative would hold on the
// CPU), widened to 1e-5 because cuBLAS may pick different kernels, so
// different summation orders, for a batch of b and one of N·b. bfloat16 as
// in test_torch_ddp_half: steps · 2^-8.

#include "torch_ddp_support.hpp"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../support/helper_main.hpp"
#include "torch_nccl_world.hpp"

namespace test_torch_ddp_nccl {

namespace {

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(12, 32))),
        fc2(register_module("fc2", torch::nn::Linear(32, 16))),
        fc3(register_module("fc3", torch::nn::Linear(16, 5))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return fc3(torch::tanh(fc2(torch::relu(fc1(x))))).to(torch::kFloat);
  }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(Mlp);

/// `extra` only where forward is asked to use it.
struct BranchyImpl : torch::nn::Module {
  BranchyImpl()
      : fc(register_module("fc", torch::nn::Linear(6, 4))), extra(register_module("extra", torch::nn::Linear(4, 4))) {}
  torch::Tensor forward(const torch::Tensor& x, bool use_extra) {
    const torch::Tensor h = fc(x);
    return use_extra ? extra(h) : h;
  }
  torch::nn::Linear fc, extra;
};
TORCH_MODULE(Branchy);

using namespace test_torch;

/// Runs body(rank, comm) on one thread per rank; returns each rank's error ("" if none).
template <class F>
std::vector<std::string> on_every_rank(test::TorchNcclWorld& world, F body) {
  std::vector<std::string> errors(static_cast<std::size_t>(world.size()));
  std::vector<std::thread> threads;
  for (int r = 0; r < world.size(); ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r, world.rank(r));
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
        if (errors[static_cast<std::size_t>(r)].empty()) errors[static_cast<std::size_t>(r)] = "(empty what())";
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace

// Skipped (doctest::skip) unless run by the helper below, which has seen a GPU.
TEST_CASE("DistributedDataParallel on Nccl: one rank per GPU matches one process on the N·b batch" * doctest::skip()) {
  CAPTURE(test::test_seed());
  const int n = test::visible_gpus();
  CAPTURE(n);
  auto world = test::make_torch_nccl_world(n);
  const std::int64_t b = 7;
  const int steps = 5;
  struct Case {
    const char* name;
    torch::Dtype dtype;
    double tolerance;
  };
  for (const Case c : {Case{"float", torch::kFloat, 1e-5}, Case{"bfloat16", torch::kBFloat16, steps * 0x1p-8}}) {
    for (const bool small_buckets : {false, true}) {
      const std::string type_name = c.name;
      CAPTURE(type_name);
      CAPTURE(small_buckets);
      auto rng = test::rng_for("ddp nccl " + type_name);
      torch::manual_seed(rng());
      Mlp init_model;
      init_model->to(c.dtype);
      const auto init = snapshot(*init_model);
      const auto x = torch::randn({n * b, 12}).to(c.dtype);
      const auto y = torch::randint(0, 5, {n * b}, torch::kInt64);

      const torch::Device gpu0(torch::kCUDA, 0);
      Mlp ref;
      ref->to(gpu0, c.dtype);
      load(*ref, init);
      auto ref_opt = make_sgd(*ref);
      train(ref, ref_opt, x.to(gpu0), y.to(gpu0), steps);
      const auto expected = snapshot(*ref);

      std::vector<std::vector<torch::Tensor>> got(static_cast<std::size_t>(n));
      std::vector<std::size_t> early(static_cast<std::size_t>(n)), buckets(static_cast<std::size_t>(n));
      const auto errors = on_every_rank(*world, [&](int r, gradsync::DeviceCommunicator& comm) {
        const torch::Device dev(torch::kCUDA, static_cast<c10::DeviceIndex>(comm.device()));
        Mlp m;
        m->to(dev, c.dtype);
        // Only rank 0 starts from the reference weights: construction broadcasts them.
        if (r == 0) load(*m, init);
        gradsync::DistributedDataParallelOptions o;
        if (small_buckets) o.first_bucket_cap_bytes = o.bucket_cap_bytes = 256;
        gradsync::DistributedDataParallel ddp(comm, m, o);
        auto opt = make_sgd(*m);
        const auto mx = x.narrow(0, r * b, b).to(dev), my = y.narrow(0, r * b, b).to(dev);
        train(ddp, opt, mx, my, steps);
        early[static_cast<std::size_t>(r)] = ddp.stats().buckets_launched_early;
        buckets[static_cast<std::size_t>(r)] = ddp.buckets().size();
        got[static_cast<std::size_t>(r)] = snapshot(*m);
      });
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        REQUIRE(errors[static_cast<std::size_t>(r)] == "");
        CHECK(bitwise_equal(got[static_cast<std::size_t>(r)], got[0]));
        // With 256-byte buckets every layer has several: all but the last
        // to be ready start inside backward, on every step.
        if (small_buckets) CHECK(early[static_cast<std::size_t>(r)] >= steps * (buckets[static_cast<std::size_t>(r)] - 1));
      }
      const double error = relative(got[0], expected), moved = relative(expected, init);
      CAPTURE(error);
      CAPTURE(moved);
      CHECK(moved >= 4 * c.tolerance);
      CHECK(error <= c.tolerance);
    }
  }
}

// The flags of which parameters some rank used are all-reduced through
// device memory: a rank whose grad of `extra` was reset to undefined (as
// zero_grad with set_to_none leaves it) and that did not use it gets the
// average too, or its optimizer would skip what the last rank steps.
TEST_CASE("DistributedDataParallel on Nccl: a parameter one rank uses gets the average on every rank" *
          doctest::skip()) {
  const int n = test::visible_gpus();
  CAPTURE(n);
  if (n < 2) {
    MESSAGE("one GPU: no rank to leave `extra` unused; this case needs two");
    return;
  }
  auto world = test::make_torch_nccl_world(n);
  std::vector<std::vector<torch::Tensor>> got(static_cast<std::size_t>(n));
  std::vector<int> defined(static_cast<std::size_t>(n));
  const auto errors = on_every_rank(*world, [&](int r, gradsync::DeviceCommunicator& comm) {
    const torch::Device dev(torch::kCUDA, static_cast<c10::DeviceIndex>(comm.device()));
    Branchy m;
    m->to(dev);
    gradsync::DistributedDataParallelOptions o;
    o.find_unused_parameters = true;
    gradsync::DistributedDataParallel ddp(comm, m, o);
    torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int s = 0; s < 2; ++s) {
      for (auto& p : m->parameters()) p.mutable_grad().reset();
      ddp(torch::ones({3, 6}, dev) * static_cast<double>(r + 1), r == n - 1).sum().backward();
      defined[static_cast<std::size_t>(r)] = m->extra->weight.grad().defined() ? 1 : 0;
      opt.step();
    }
    got[static_cast<std::size_t>(r)] = snapshot(*m);
  });
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    REQUIRE(errors[static_cast<std::size_t>(r)] == "");
    CHECK(defined[static_cast<std::size_t>(r)] == 1);
    CHECK(bitwise_equal(got[static_cast<std::size_t>(r)], got[0]));
  }
}

TEST_CASE("DistributedDataParallel on Nccl: tensors on the wrong device are refused, naming the parameter" *
          doctest::skip()) {
  const int n = test::visible_gpus();
  auto world = test::make_torch_nccl_world(n);
  SUBCASE("a module left on the CPU") {
    const auto errors = on_every_rank(*world, [&](int, gradsync::DeviceCommunicator& comm) {
      Mlp m;
      gradsync::DistributedDataParallel ddp(comm, m);
    });
    for (const auto& e : errors) {
      CAPTURE(e);
      CHECK(e.find("parameter 'fc1.weight' cannot be synchronised: it is on cpu") != std::string::npos);
    }
  }
  SUBCASE("one parameter on another device than the communicator's") {
    const auto errors = on_every_rank(*world, [&](int, gradsync::DeviceCommunicator& comm) {
      Mlp m;
      m->to(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(comm.device())));
      // Another GPU where there is one; the meta device stands in otherwise.
      const torch::Device other = n > 1 ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>((comm.device() + 1) % n))
                                        : torch::Device(torch::kMeta);
      m->fc2->to(other);
      gradsync::DistributedDataParallel ddp(comm, m);
    });
    for (const auto& e : errors) {
      CAPTURE(e);
      CHECK(e.find("parameter 'fc2.weight' cannot be synchronised: it is on ") != std::string::npos);
      CHECK(e.find("communicator works on cuda:") != std::string::npos);
    }
  }
  SUBCASE("CUDA tensors on a host backend") {
    std::vector<std::string> errors(2);
    gradsync::run_threads(2, [&](gradsync::Communicator<gradsync::Threads>& comm) {
      try {
        Mlp m;
        m->to(torch::Device(torch::kCUDA, 0));
        gradsync::DistributedDataParallel ddp(comm, m);
      } catch (const gradsync::InvalidArgument& e) {
        errors[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    for (const auto& e : errors) {
      CAPTURE(e);
      CHECK(e.find("parameter 'fc1.weight' cannot be synchronised: it is on cuda:0, and this backend moves host memory") !=
            std::string::npos);
    }
  }
}

/// The helper's main: SKIP (77) without a GPU that LibTorch and the CUDA
/// runtime both see; otherwise doctest over this file's cases alone.
int helper_main(int argc, char** argv) {
  if (!torch::cuda::is_available()) {
    std::printf("SKIP: this LibTorch has no CUDA, or sees no GPU (torch::cuda::is_available() is false)\n");
    return 77;
  }
  if (test::visible_gpus() == 0) {
    std::printf("SKIP: the CUDA runtime sees no GPU\n");
    return 77;
  }
  doctest::Context ctx(argc, argv);
  ctx.addFilter("source-file", __FILE__);
  ctx.setOption("no-skip", true);
  return ctx.run();
}

GRADSYNC_TEST_HELPER("torch_ddp_nccl", helper_main);

}  // namespace test_torch_ddp_nccl
