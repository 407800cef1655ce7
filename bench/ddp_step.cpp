// ddp_step: where a ReplicatedTrainer step goes — compute, gradient
// communication, and the part of it hidden behind backward — at N = 1, 2, 4
// ranks on the Threads backend.
//
//   ddp_step [--steps S] [--ranks 1,2,4] [--large-only|--small-only]
//
// Models: the peer measurement's MLP 784-1024-1024-10 (1.86M parameters)
// and an MLP 784-2048-2048-2048-10 (10.0M), per-rank batch 64, plain SGD.
// Columns (ms per step, rank 0, mean over S steps after warm-up):
//   step      wall time of trainer.step()
//   compute   forward + backward on the rank's thread
//   comm      the progress worker's time in bucket all-reduces
//   exposed   time step() waited for communication after backward
//   hidden    comm - exposed: communication overlapped with backward
//   flat      one AllReduce of all gradients alone, same algorithm (Auto)
// "overlap off" launches every bucket after backward, for comparison.

#include <gradsync/gradsync.hpp>

#include "../examples/eigen_mlp.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct Row {
  double step = 0, compute = 0, comm = 0, exposed = 0, flat = 0;
};

Row measure(const std::vector<int>& sizes, int ranks, int steps, bool overlap) {
  constexpr int batch = 64;
  Row row;
  gradsync::run_threads(ranks, [&](gradsync::Communicator<gradsync::Threads>& comm) {
    std::mt19937 rng(5 + comm.rank());
    std::normal_distribution<float> normal;
    std::vector<float> x(std::size_t(batch) * sizes[0]);
    std::vector<int> y(batch);
    for (float& v : x) v = normal(rng);
    for (int& v : y) v = static_cast<int>(rng() % 10);
    gradsync::ReplicatedTrainerOptions o;
    o.sync.overlap = overlap;
    gradsync::ReplicatedTrainer trainer(comm, example::EigenMlp(sizes, 1), gradsync::Sgd<float>({.lr = 0.01}), o);
    const example::Batch b{x.data(), y.data(), batch};
    for (int i = 0; i < 3; ++i) trainer.step(b);
    comm.barrier();
    trainer.reset_stats();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) trainer.step(b);
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // One flat all-reduce of every gradient, alone.
    auto grads = trainer.gradients();
    gradsync::AllReduce<> all_reduce;
    all_reduce(comm, grads, gradsync::Avg{});
    comm.barrier();
    const auto t1 = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) all_reduce(comm, grads, gradsync::Avg{});
    const double flat = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    if (comm.rank() == 0) {
      const auto& s = trainer.stats();
      row = {wall / steps, s.compute_seconds / steps, s.comm_seconds / steps, s.exposed_comm_seconds / steps,
             flat / steps};
    }
  });
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  Eigen::setNbThreads(1);
  int steps = 20;
  std::vector<int> ranks{1, 2, 4};
  bool small = true, large = true;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--steps" && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
    } else if (k == "--ranks" && i + 1 < argc) {
      ranks.clear();
      std::stringstream ss(argv[++i]);
      for (std::string t; std::getline(ss, t, ',');) ranks.push_back(std::stoi(t));
    } else if (k == "--large-only") {
      small = false;
    } else if (k == "--small-only") {
      large = false;
    } else {
      std::fprintf(stderr, "usage: ddp_step [--steps S] [--ranks 1,2,4] [--large-only|--small-only]\n");
      return 2;
    }
  }
  std::vector<std::pair<const char*, std::vector<int>>> models;
  if (small) models.push_back({"MLP 784-1024-1024-10 (1.86M params)", {784, 1024, 1024, 10}});
  if (large) models.push_back({"MLP 784-2048-2048-2048-10 (10.0M params)", {784, 2048, 2048, 2048, 10}});
  for (const auto& [name, sizes] : models) {
    const int s = sizes.size() > 4 ? std::max(3, steps / 4) : steps;
    std::printf("# %s, per-rank batch 64, SGD, Threads, %d steps; ms per step (rank 0)\n", name, s);
    std::printf("#  N  overlap     step  compute     comm  exposed   hidden     flat  samples/s\n");
    double base = 0;
    for (int n : ranks) {
      for (bool overlap : {true, false}) {
        const Row r = measure(sizes, n, s, overlap);
        const double sps = 64.0 * n / r.step;
        if (n == 1 && overlap) base = sps;
        std::printf("%4d  %-7s %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f %10.0f", n, overlap ? "on" : "off", 1e3 * r.step,
                    1e3 * r.compute, 1e3 * r.comm, 1e3 * r.exposed, 1e3 * std::max(0.0, r.comm - r.exposed),
                    1e3 * r.flat, sps);
        if (overlap && n > 1 && base > 0) {
          std::printf("   weak-scaling eff %.0f%%, comm/flat %.2f", 100 * sps / (n * base), r.comm / r.flat);
        }
        std::printf("\n");
        std::fflush(stdout);
      }
    }
  }
}
