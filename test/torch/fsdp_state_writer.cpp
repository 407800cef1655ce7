// The C++ half of check_fsdp_state.py: a fully_shard model trained on N
// ranks, its full state saved for PyTorch to load.
//
//   fsdp_state_writer N DIR
//
// N ranks (Threads) wrap test_torch_fsdp_support's Net (units of 323, 208
// and 65 parameters, which no N in 2..4 divides all of; a frozen
// parameter, a buffer), train two Adam steps on their own rows, and
// save_full_state_dict writes DIR/state.safetensors. DIR/io.safetensors
// then holds a fixed input "x" and "out", the wrapped model's output for it
// (its forward gathers the full parameters from the shards). Prints the
// seed (GRADSYNC_TEST_SEED replays it); exits 1 with the error on failure.

// The support headers include doctest, whose implementation this file's
// own main needs (see torch_ddp_support.hpp).
#define DOCTEST_CONFIG_IMPLEMENT
#include "torch_fsdp_support.hpp"

#include <gradsync/checkpoint/safetensors_reader.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using Comm = gradsync::Communicator<gradsync::Threads>;
using namespace test_torch_fsdp_support;

gradsync::checkpoint::TensorData double_tensor(const std::string& name, const torch::Tensor& t) {
  gradsync::checkpoint::TensorInfo info{name, gradsync::checkpoint::TensorDtype::F64, {}};
  for (std::int64_t d : t.sizes()) info.shape.push_back(static_cast<std::uint64_t>(d));
  return {info, std::span<const std::byte>(static_cast<const std::byte*>(t.data_ptr()), t.nbytes())};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: fsdp_state_writer N DIR\n");
    return 2;
  }
  // The support headers' REQUIREs, outside a test case, go to this context.
  doctest::Context context;
  context.setAsDefaultForAssertsOutOfTestCases();
  context.setAssertHandler([](const doctest::AssertData& a) {
    std::fprintf(stderr, "fsdp_state_writer: %s:%d: %s failed\n", a.m_file, a.m_line, a.m_expr);
    std::exit(1);
  });
  const int n = std::atoi(argv[1]);
  const std::filesystem::path dir = argv[2];
  std::printf("fsdp_state_writer: N=%d seed GRADSYNC_TEST_SEED=%llu\n", n,
              static_cast<unsigned long long>(test::test_seed()));
  try {
    std::filesystem::create_directories(dir);
    const auto init = initial_state("fsdp python init");
    const std::int64_t b = 3;
    test_torch::Data d = test_torch::make_data(n * b, "fsdp python data");
    d.x = d.x.to(torch::kDouble);
    const torch::Tensor x = test_torch::make_data(7, "fsdp python input").x.to(torch::kDouble);
    std::mutex mutex;
    std::string failure;
    gradsync::run_threads(n, gradsync::ThreadsOptions{.timeout = std::chrono::seconds(60)}, [&](Comm& comm) {
      torch::set_num_threads(1);
      try {
        gradsync::ShardedModule<Net> m;
        load_and_wrap(m, comm, init, gradsync::ShardingStrategy::FullShard);
        const test_torch::Data mine{d.x.narrow(0, comm.rank() * b, b), d.y.narrow(0, comm.rank() * b, b)};
        auto opt = make_optimizer(Opt::adam, *m);
        fit([&](const torch::Tensor& in) { return m(in); }, *opt, mine, 2);
        gradsync::save_full_state_dict(m, comm, dir / "state.safetensors");
        torch::NoGradGuard no_grad;
        const torch::Tensor out = m(x).contiguous();
        if (comm.rank() == 0) {
          const std::vector<gradsync::checkpoint::TensorData> io{double_tensor("x", x.contiguous()),
                                                                 double_tensor("out", out)};
          gradsync::checkpoint::save_safetensors(dir / "io.safetensors", io);
        }
      } catch (const std::exception& e) {
        const std::lock_guard<std::mutex> lock(mutex);
        if (failure.empty()) failure = "rank " + std::to_string(comm.rank()) + ": " + e.what();
        throw;
      }
    });
    if (!failure.empty()) throw std::runtime_error(failure);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp_state_writer: %s\n", e.what());
    return 1;
  }
  return 0;
}
