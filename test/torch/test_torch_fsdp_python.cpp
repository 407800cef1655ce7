// The C++ half of check_fsdp_state.py: a fully_shard model trained on N
// ranks, its full state saved for PyTorch to load. check_fsdp_state.py runs
// this file's case with GRADSYNC_FSDP_STATE_N and GRADSYNC_FSDP_STATE_DIR;
// without them the case writes N = 2 into a temporary directory and checks
// that both files are there.
//
// N ranks (Threads) wrap test_torch_fsdp_support's Net (units of 323, 208
// and 65 parameters, which no N in 2..4 divides all of; a frozen
// parameter, a buffer), train two Adam steps on their own rows, and
// save_full_state_dict writes DIR/state.safetensors. DIR/io.safetensors
// then holds a fixed input "x" and "out", the wrapped model's output for it
// (its forward gathers the full parameters from the shards).

#include "torch_fsdp_support.hpp"

#include <gradsync/checkpoint/safetensors_reader.hpp>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "../support/temp_dir.hpp"

// Its own namespace: test/torch/meson.build compiles it in one translation
// unit with the other LibTorch test files (a unity build).
namespace test_torch_fsdp_python {

namespace {

using Comm = gradsync::Communicator<gradsync::Threads>;
using namespace test_torch_fsdp_support;

gradsync::checkpoint::TensorData double_tensor(const std::string& name, const torch::Tensor& t) {
  gradsync::checkpoint::TensorInfo info{name, gradsync::checkpoint::TensorDtype::F64, {}};
  for (std::int64_t d : t.sizes()) info.shape.push_back(static_cast<std::uint64_t>(d));
  return {info, std::span<const std::byte>(static_cast<const std::byte*>(t.data_ptr()), t.nbytes())};
}

/// Trains on `n` ranks and writes DIR/state.safetensors and DIR/io.safetensors.
void write_state(int n, const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  const auto init = initial_state("fsdp python init");
  const std::int64_t b = 3;
  test_torch::Data d = test_torch::make_data(n * b, "fsdp python data");
  d.x = d.x.to(torch::kDouble);
  const torch::Tensor x = test_torch::make_data(7, "fsdp python input").x.to(torch::kDouble);
  gradsync::run_threads(n, gradsync::ThreadsOptions{.timeout = std::chrono::seconds(60)}, [&](Comm& comm) {
    torch::set_num_threads(1);
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
  });
}

}  // namespace

TEST_CASE("fully_shard: the full state and a forward's output, written for PyTorch to load") {
  INFO("GRADSYNC_TEST_SEED = " << test::test_seed());
  const char* n_env = std::getenv("GRADSYNC_FSDP_STATE_N");
  const char* dir_env = std::getenv("GRADSYNC_FSDP_STATE_DIR");
  if (n_env != nullptr && dir_env != nullptr) {
    const int n = std::atoi(n_env);
    REQUIRE(n >= 1);
    write_state(n, dir_env);
    return;
  }
  const test::TempDir tmp;
  write_state(2, tmp.path);
  CHECK(std::filesystem::file_size(tmp.path / "state.safetensors") > 0);
  CHECK(std::filesystem::file_size(tmp.path / "io.safetensors") > 0);
}

}  // namespace test_torch_fsdp_python
