// PinnedHostSpace, ShardedTrainer's offload space on a GPU: it compiles with
// the host compiler wherever the Nccl backend does, and where a GPU is
// present, a round trip through device memory returns the bytes it took.
// Without a CUDA device it reports SKIP (exit 77) with the reason and is never
// counted as passed.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gradsync/backend/nccl/pinned_host_space.hpp"
#include "../support/common.hpp"

TEST_CASE("PinnedHostSpace: zeroed aligned pinned memory, and copies to the device and back") {
  auto rng = test::rng_for("pinned host space");
  std::uniform_int_distribution<std::size_t> sizes(1, 1 << 20);
  const std::size_t n = sizes(rng);
  INFO("seed = " << test::test_seed() << ", floats = " << n);
  gradsync::PinnedHostSpace space;
  CHECK(std::string(space.name()) == "pinned host");
  auto* a = static_cast<float*>(space.allocate(n * sizeof(float)));
  auto* b = static_cast<float*>(space.allocate(n * sizeof(float)));
  CHECK(reinterpret_cast<std::uintptr_t>(a) % 64 == 0);
  cudaPointerAttributes attributes{};
  REQUIRE(cudaPointerGetAttributes(&attributes, a) == cudaSuccess);
  CHECK(attributes.type == cudaMemoryTypeHost);
  bool zero = true;
  for (std::size_t i = 0; i < n; ++i) zero = zero && a[i] == 0.0f;
  CHECK(zero);
  std::normal_distribution<float> d;
  for (std::size_t i = 0; i < n; ++i) a[i] = d(rng);
  float* device = nullptr;
  REQUIRE(cudaMalloc(&device, n * sizeof(float)) == cudaSuccess);
  space.copy_in(device, a, n * sizeof(float));
  space.copy_out(b, device, n * sizeof(float));
  space.wait();
  CHECK(std::memcmp(a, b, n * sizeof(float)) == 0);
  cudaFree(device);
  space.deallocate(a, n * sizeof(float));
  space.deallocate(b, n * sizeof(float));
}

#include "../support/cuda_device_main.hpp"
