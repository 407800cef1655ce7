// One data-parallel LibTorch training step, timed: gradsync::DistributedDataParallel
// on Threads (one LibTorch thread per rank), at each world size asked for.
//
//   libtorch_ddp_step                       N = 1, 2, 4; 784-1024-1024-10 MLP; batch 64; SGD
//   libtorch_ddp_step --ranks 2 --steps 50 --warmup 5 --hidden 1024
//
// Prints one line per N: median ms per step on rank 0 (forward, backward
// with its bucketed all-reduce, optimizer), samples/s over all ranks, and
// the weak-scaling efficiency against N = 1 of the same run. The PyTorch
// DDP peer (bench/torch_ddp_peer.py) runs the same model, batch and
// optimizer in the same LibTorch kernels; bench/libtorch_compare.py
// interleaves the two.

#include <gradsync/gradsync.hpp>
#include <gradsync/integration/torch.hpp>

#include "../examples/torch_mlp.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

struct Args {
  std::vector<int> ranks{1, 2, 4};
  int steps = 30, warmup = 5, batch = 64, hidden = 1024;
};

Args parse(int argc, char** argv) {
  Args a;
  bool ranks_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> int {
      if (i + 1 >= argc) throw std::runtime_error(k + " expects a value");
      return std::stoi(argv[++i]);
    };
    if (k == "--ranks") {
      if (!ranks_given) a.ranks.clear();
      ranks_given = true;
      a.ranks.push_back(next());
    } else if (k == "--steps") {
      a.steps = next();
    } else if (k == "--warmup") {
      a.warmup = next();
    } else if (k == "--batch") {
      a.batch = next();
    } else if (k == "--hidden") {
      a.hidden = next();
    } else {
      throw std::runtime_error("unknown option " + k + " (expected --ranks N (repeatable) --steps --warmup --batch --hidden)");
    }
  }
  for (int n : a.ranks) {
    if (n < 1) throw std::runtime_error("--ranks must be positive");
  }
  if (a.steps < 1 || a.warmup < 0 || a.batch < 1 || a.hidden < 1) {
    throw std::runtime_error("--steps, --batch and --hidden must be positive, --warmup not negative");
  }
  return a;
}

/// Median ms per step on rank 0, and the early-bucket fraction.
struct Result {
  double ms = 0;
  double early = 0;
  std::size_t params = 0;
};

Result run(int n, const Args& a) {
  Result out;
  gradsync::run_threads(n, [&](gradsync::Communicator<gradsync::Threads>& comm) {
    torch::set_num_threads(1);
    torch::manual_seed(static_cast<std::uint64_t>(comm.rank()) + 1);
    example::Net net(a.hidden);
    gradsync::DistributedDataParallel ddp(comm, net);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01));
    const torch::Tensor x = torch::randn({a.batch, 784});
    const torch::Tensor y = torch::randint(10, {a.batch}, torch::kInt64);
    std::vector<double> ms;
    for (int s = 0; s < a.warmup + a.steps; ++s) {
      if (s == a.warmup) ddp.reset_stats();
      // Every rank starts the step together, so rank 0 times its own step,
      // not the others' late start.
      comm.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      opt.zero_grad();
      torch::nn::functional::cross_entropy(ddp(x), y).backward();
      opt.step();
      const auto t1 = std::chrono::steady_clock::now();
      if (s >= a.warmup) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    if (comm.rank() == 0) {
      std::sort(ms.begin(), ms.end());
      out.ms = ms[ms.size() / 2];
      const auto& st = ddp.stats();
      out.early = st.buckets_launched ? double(st.buckets_launched_early) / double(st.buckets_launched) : 0.0;
      std::size_t p = 0;
      for (const auto& t : net->parameters()) p += static_cast<std::size_t>(t.numel());
      out.params = p;
    }
  });
  return out;
}

}  // namespace

int main(int argc, char** argv) try {
  const Args a = parse(argc, argv);
  double base = 0;
  for (int n : a.ranks) {
    const Result r = run(n, a);
    if (n == a.ranks.front()) {
      std::printf("# gradsync DDP (LibTorch), MLP 784-%d-%d-10 (%.2fM params), per-rank batch %d, SGD, Threads, "
                  "%d steps (median)\n#  N   ms/step  samples/s  weak-eff  early-buckets\n",
                  a.hidden, a.hidden, double(r.params) / 1e6, a.batch, a.steps);
    }
    const double sps = 1000.0 * n * a.batch / r.ms;
    if (n == 1) base = sps;
    std::printf("%4d %9.2f %10.0f %8s %14.2f\n", n, r.ms, sps,
                base > 0 ? (std::to_string(static_cast<int>(100 * sps / (n * base) + 0.5)) + "%").c_str() : "-",
                r.early);
    std::fflush(stdout);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "libtorch_ddp_step: %s\n", e.what());
  return 2;
}
