// What FiniteScan costs where it is a pass of its own: ReplicatedTrainer's
// and DistributedDataParallel's buckets are reduced in place, and the scan
// reads each again after the reduction. 1,863,690 floats (ddp_step's small
// MLP), warm and after streaming 64 MiB through the caches as a step does.
//   c++ -std=c++20 -O3 -march=native -Iinclude bench/results/finite_scan_cost.cpp -o /tmp/finite_scan_cost
#include <gradsync/train/common/finite_scan.hpp>

#include <chrono>
#include <cstdio>
#include <vector>

int main() {
  std::vector<float> g(1863690, 0.001f), sweep(std::size_t{16} << 20);
  using Scan = gradsync::detail::FiniteScan<float>;
  for (const bool cold : {false, true}) {
    double total = 0;
    int found = 0;
    for (int i = 0; i < 50; ++i) {
      if (cold) for (float& v : sweep) v += 1.0f;
      const auto t0 = std::chrono::steady_clock::now();
      found += Scan::any(g) ? 1 : 0;
      total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    std::printf("%s: %.3f ms per scan of %zu floats (%d found)\n", cold ? "cold" : "warm", 1e3 * total / 50, g.size(),
                found);
  }
}
