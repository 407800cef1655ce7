// DistributedDataParallel with bfloat16 and half parameters: the
// flat gradient keeps the parameters' 16-bit dtype and is all-reduced as it
// is, so N ranks match one process on the N·b batch only to the type's
// precision, and must still be bitwise alike across ranks.
//
// Tolerance: the ranks' gradients differ from the single process's by
// rounding only (each rank rounds its own gradient, the all-reduce rounds
// after each of its N − 1 additions and once after dividing by N). Each
// optimizer step can then round a parameter one unit differently, so after
// `steps` steps ‖ddp − reference‖ / ‖reference‖ ≤ steps · u, with u the
// type's unit of least precision at 1.0 (bfloat16 2^-8, half 2^-11 of the
// 8 resp. 11 significand bits). The parameters must move by much more than
// that, or the check could not see a wrong average (a sum, or a mean over
// the wrong N, is off by a whole update).

#include "torch_ddp_support.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_torch_ddp_half {

namespace {

using Comm = gradsync::Communicator<gradsync::Threads>;
using namespace test_torch;
using Mlp = test_torch::TypedMlp;

struct Case {
  const char* name;
  torch::Dtype dtype, compute;
  double unit;  ///< one unit of least precision at 1.0
};

}  // namespace

TEST_CASE("DistributedDataParallel: bfloat16 and half parameters match one process within the type's precision") {
  CAPTURE(test::test_seed());
  const std::int64_t b = 7;  // per rank; odd on purpose
  const int steps = 5;
  for (const Case c : {Case{"bfloat16", torch::kBFloat16, torch::kBFloat16, 0x1p-8},
                       Case{"half", torch::kHalf, torch::kFloat, 0x1p-11}}) {
    const std::string type_name = c.name;
    CAPTURE(type_name);
    auto rng = test::rng_for(std::string("ddp half init ") + c.name);
    torch::manual_seed(rng());
    const auto init = snapshot(*Mlp(c.dtype, c.compute));
    for (int n : {1, 2, 3, 4}) {
      CAPTURE(n);
      const Data d = make_data(n * b, std::string("ddp half data ") + c.name);
      Mlp ref(c.dtype, c.compute);
      load(*ref, init);
      const auto expected = train_alone(ref, d.x, d.y, steps);

      std::vector<std::vector<torch::Tensor>> got(static_cast<std::size_t>(n));
      std::vector<std::string> errors(static_cast<std::size_t>(n));
      std::vector<std::string> grad_dtype(static_cast<std::size_t>(n));
      gradsync::run_threads(n, [&](Comm& comm) {
        torch::set_num_threads(1);
        const auto r = static_cast<std::size_t>(comm.rank());
        try {
          Mlp m(c.dtype, c.compute);
          // Only rank 0 starts from the reference weights: construction broadcasts them.
          if (comm.rank() == 0) load(*m, init);
          got[r] = train_ddp(comm, m, d.x.narrow(0, comm.rank() * b, b), d.y.narrow(0, comm.rank() * b, b), steps);
          grad_dtype[r] = c10::toString(m->fc1->weight.grad().scalar_type());
        } catch (const gradsync::InvalidArgument& e) {
          errors[r] = e.what();
        }
      });
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        REQUIRE(errors[static_cast<std::size_t>(r)] == "");
        CHECK(grad_dtype[static_cast<std::size_t>(r)] == c10::toString(c.dtype));
        CHECK(bitwise_equal(got[static_cast<std::size_t>(r)], got[0]));
      }
      const double tolerance = steps * c.unit;
      const double moved = relative(expected, init), error = relative(got[0], expected);
      CAPTURE(moved);
      CAPTURE(error);
      CHECK(moved >= 4 * tolerance);
      CHECK(error <= tolerance);
    }
  }
}

TEST_CASE("DistributedDataParallel: a module that mixes 16-bit and float parameters is refused, naming the parameter") {
  CAPTURE(test::test_seed());
  const int n = 2;
  std::vector<std::string> errors(n);
  gradsync::run_threads(n, [&](Comm& comm) {
    try {
      Mlp m(torch::kBFloat16, torch::kBFloat16);
      m->fc2->to(torch::kFloat);
      gradsync::DistributedDataParallel ddp(comm, m);
    } catch (const gradsync::InvalidArgument& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const auto& e : errors) {
    CAPTURE(e);
    CHECK(e.find("parameter 'fc2.weight' is Float but 'fc1.weight' is BFloat16") != std::string::npos);
  }
}

}  // namespace test_torch_ddp_half
