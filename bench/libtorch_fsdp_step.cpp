// One LibTorch training step, timed: gradsync::fully_shard (FullShard,
// ShardGradOp, NoShard) against gradsync::DistributedDataParallel on the
// same model and data, on Threads (one LibTorch thread per rank).
//
//   libtorch_fsdp_step                       N = 1, 2, 4; 784-1024-1024-10 MLP; batch 64; Adam
//   libtorch_fsdp_step --ranks 2 --rounds 5 --steps 20 --warmup 3 --hidden 1024 --sgd
//   libtorch_fsdp_step --ranks 1,2 --only FullShard --only no-comm
//   libtorch_fsdp_step --ranks 2 --only FullShard --max-gathered 1     FullShard with no prefetch
//
// The MLP is examples/torch_mlp.hpp's (Linear-ReLU-Linear-ReLU-Linear), with each
// hidden Linear + ReLU a block that fully_shard wraps, then the root, which
// keeps the head: three units, as PyTorch FSDP2 users wrap a model. Rounds
// interleave the strategies (the first rotates from round to round), each
// on a fresh model from the same seed and the same batches, so all see the
// same machine load; a round's time is rank 0's median step, and the table
// gives the median over rounds with its range, and each strategy's step over
// DDP's of the same round (median and range over rounds).
//
// Two rows say where a step's time goes: "no-comm" runs the same model with
// no wrapper and no communication on every rank at once (forward, backward
// and optimizer only, with the ranks sharing the cores as in the others),
// and "collectives" times, alone, what FullShard moves in one step: one
// AllGather of each unit (FullShard gathers twice: forward and backward),
// one ReduceScatter of each unit's gradient, and one AllReduce of them all
// (DDP's and NoShard's volume). The last column counts rank 0's minor page
// faults per step: fresh memory the step touched. --only STRATEGY runs one
// (repeatable), e.g. under GRADSYNC_TRACE, whose file holds the last run.
// bench/peer/libtorch_fsdp_compare.py runs this interleaved with PyTorch
// 2.x's FSDP2 on the same model, and bench/libtorch_compare.py its DDP with
// --sgd against PyTorch 1.13's DDP (bench/torch_ddp_peer.py).

#include <gradsync/gradsync.hpp>
#include <gradsync/integration/torch.hpp>
#include "perf/shared_launches.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <sys/resource.h>

namespace {

using Comm = gradsync::Communicator<gradsync::Threads>;
using Clock = std::chrono::steady_clock;

/// A hidden layer: Linear then ReLU, one fully_shard unit.
struct BlockImpl : torch::nn::Module {
  BlockImpl(int in, int out) : fc(register_module("fc", torch::nn::Linear(in, out))) {}
  torch::Tensor forward(torch::Tensor x) { return torch::relu(fc(x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Block);

/// examples/torch_mlp.hpp's 784-hidden-hidden-10 MLP, its hidden layers as blocks.
struct NetImpl : torch::nn::Module {
  explicit NetImpl(int hidden)
      : b1(register_module("b1", Block(784, hidden))),
        b2(register_module("b2", Block(hidden, hidden))),
        head(register_module("head", torch::nn::Linear(hidden, 10))) {}
  torch::Tensor forward(torch::Tensor x) { return head(b2(b1(x))); }
  gradsync::ShardedModule<Block> b1, b2;
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

enum class Kind { no_comm, ddp, full_shard, shard_grad_op, no_shard };
constexpr std::array kinds{Kind::ddp, Kind::full_shard, Kind::shard_grad_op, Kind::no_shard, Kind::no_comm};

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::no_comm: return "no-comm";
    case Kind::ddp: return "DDP";
    case Kind::full_shard: return "FullShard";
    case Kind::shard_grad_op: return "ShardGradOp";
    case Kind::no_shard: return "NoShard";
  }
  return "?";
}

struct Args {
  std::vector<int> ranks{1, 2, 4};
  int steps = 20, warmup = 3, batch = 64, hidden = 1024, rounds = 3;
  bool sgd = false;
  /// --max-gathered: FullyShardOptions::max_gathered_units (its default: 2; 1 gathers nothing ahead).
  std::size_t max_gathered = gradsync::FullyShardOptions{}.max_gathered_units;
  std::vector<Kind> only;  ///< --only: these strategies (e.g. for GRADSYNC_TRACE), else all
};

Args parse(int argc, char** argv) {
  Args a;
  bool ranks_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(k + " expects a value");
      return argv[++i];
    };
    if (k == "--ranks") {
      if (!ranks_given) a.ranks.clear();
      ranks_given = true;
      // Repeatable, and each value may be a list: --ranks 1 --ranks 2 or --ranks 1,2,4.
      const std::string v = next();
      for (std::size_t p = 0; p <= v.size();) {
        const std::size_t c = std::min(v.find(',', p), v.size());
        a.ranks.push_back(std::stoi(v.substr(p, c - p)));
        p = c + 1;
      }
    } else if (k == "--steps") {
      a.steps = std::stoi(next());
    } else if (k == "--warmup") {
      a.warmup = std::stoi(next());
    } else if (k == "--batch") {
      a.batch = std::stoi(next());
    } else if (k == "--hidden") {
      a.hidden = std::stoi(next());
    } else if (k == "--rounds") {
      a.rounds = std::stoi(next());
    } else if (k == "--max-gathered") {
      a.max_gathered = static_cast<std::size_t>(std::stoul(next()));
    } else if (k == "--sgd") {
      a.sgd = true;
    } else if (k == "--only") {
      const std::string v = next();
      bool known = false;
      for (Kind c : kinds) {
        if (v == kind_name(c)) {
          a.only.push_back(c);
          known = true;
        }
      }
      if (!known) throw std::runtime_error("--only " + v + ": expected DDP, FullShard, ShardGradOp, NoShard or no-comm");
    } else {
      throw std::runtime_error("unknown option " + k +
                               " (expected --ranks N[,N...] (repeatable) --rounds --steps --warmup --batch --hidden --sgd "
                               "--only STRATEGY (repeatable) --max-gathered N)");
    }
  }
  for (int n : a.ranks) {
    if (n < 1) throw std::runtime_error("--ranks must be positive");
  }
  if (a.steps < 1 || a.warmup < 0 || a.batch < 1 || a.hidden < 1 || a.rounds < 1) {
    throw std::runtime_error("--steps, --rounds, --batch and --hidden must be positive, --warmup not negative");
  }
  return a;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Args& a, const std::vector<torch::Tensor>& params) {
  if (a.sgd) return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.01));
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-3));
}

/// The calling thread's minor page faults so far: fresh memory touched
/// (each a 4 KiB page the kernel zeroes), what allocating per step costs.
long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_THREAD, &u);
  return u.ru_minflt;
}

struct Timed {
  double ms = 0;      ///< rank 0's median step
  double faults = 0;  ///< rank 0's median minor page faults per step
};

/// Rank 0's median ms and page faults per step of `kind` at N = n.
Timed run(int n, Kind kind, const Args& a) {
  Timed out;
  gradsync::run_threads(n, [&](Comm& comm) {
    torch::set_num_threads(1);
    // Same initial model for every strategy (and fully_shard and DDP
    // broadcast rank 0's anyway); each rank its own batch.
    torch::manual_seed(1);
    gradsync::ShardedModule<Net> net(a.hidden);
    torch::manual_seed(static_cast<std::uint64_t>(comm.rank()) + 2);
    const torch::Tensor x = torch::randn({a.batch, 784});
    const torch::Tensor y = torch::randint(10, {a.batch}, torch::kInt64);
    std::unique_ptr<gradsync::DistributedDataParallel<Net, Comm>> ddp;
    if (kind == Kind::ddp) {
      ddp = std::make_unique<gradsync::DistributedDataParallel<Net, Comm>>(comm, Net(net));
    } else if (kind != Kind::no_comm) {
      gradsync::FullyShardOptions o;
      o.strategy = kind == Kind::full_shard      ? gradsync::ShardingStrategy::FullShard
                   : kind == Kind::shard_grad_op ? gradsync::ShardingStrategy::ShardGradOp
                                                 : gradsync::ShardingStrategy::NoShard;
      o.max_gathered_units = a.max_gathered;
      gradsync::fully_shard(net->b1, comm, o);
      gradsync::fully_shard(net->b2, comm, o);
      gradsync::fully_shard(net, comm, o);
    }
    // Built after wrapping: a sharded unit's parameters are then this rank's shards.
    auto opt = make_optimizer(a, net->parameters());
    std::vector<double> ms, faults;
    for (int s = 0; s < a.warmup + a.steps; ++s) {
      // Every rank starts the step together, so rank 0 times its own step,
      // not the others' late start.
      comm.barrier();
      const long f0 = minor_faults();
      const auto t0 = Clock::now();
      opt->zero_grad();
      const torch::Tensor logits = ddp ? (*ddp)(x) : net(x);
      torch::nn::functional::cross_entropy(logits, y).backward();
      opt->step();
      if (s >= a.warmup) {
        ms.push_back(ms_since(t0));
        faults.push_back(double(minor_faults() - f0));
      }
    }
    if (comm.rank() == 0) out = {median(ms), median(faults)};
  });
  return out;
}

/// Median ms, on rank 0, of FullShard's collectives alone: [one AllGather
/// of every unit, one ReduceScatter of every unit, one AllReduce of all].
std::array<double, 3> collectives(int n, const Args& a) {
  const auto h = static_cast<std::size_t>(a.hidden);
  const std::vector<std::size_t> units{784 * h + h, h * h + h, 10 * h + 10};
  std::array<double, 3> out{};
  gradsync::run_threads(n, [&](Comm& comm) {
    const auto N = static_cast<std::size_t>(n);
    std::vector<std::vector<float>> full, part;
    std::size_t total = 0;
    for (std::size_t u : units) {
      const std::size_t c = (u + N - 1) / N;
      full.emplace_back(c * N, 1.0f);
      part.emplace_back(c, 1.0f);
      total += u;
    }
    std::vector<float> all(total, 1.0f);
    std::array<std::vector<double>, 3> ms;
    for (int s = 0; s < a.warmup + a.steps; ++s) {
      comm.barrier();
      auto t0 = Clock::now();
      for (std::size_t u = 0; u < units.size(); ++u) {
        gradsync::AllGather<gradsync::Auto>{}(comm, std::span<const float>(part[u]), std::span<float>(full[u]));
      }
      const double gather = ms_since(t0);
      comm.barrier();
      t0 = Clock::now();
      for (std::size_t u = 0; u < units.size(); ++u) {
        gradsync::ReduceScatter<gradsync::Auto>{}(comm, std::span<const float>(full[u]), std::span<float>(part[u]),
                                                  gradsync::Avg{});
      }
      const double scatter = ms_since(t0);
      comm.barrier();
      t0 = Clock::now();
      gradsync::AllReduce<gradsync::Auto>{}(comm, std::span<float>(all), gradsync::Avg{});
      const double reduce = ms_since(t0);
      if (s >= a.warmup) {
        ms[0].push_back(gather);
        ms[1].push_back(scatter);
        ms[2].push_back(reduce);
      }
    }
    if (comm.rank() == 0) {
      for (std::size_t i = 0; i < 3; ++i) out[i] = median(ms[i]);
    }
  });
  return out;
}

struct Range {
  double med, lo, hi;
};

Range range_of(const std::vector<double>& v) {
  return {median(v), *std::min_element(v.begin(), v.end()), *std::max_element(v.begin(), v.end())};
}

/// "[lo-hi]", one field for parsers.
std::string bracket(const Range& r) {
  char b[64];
  std::snprintf(b, sizeof b, "[%.2f-%.2f]", r.lo, r.hi);
  return b;
}

}  // namespace

int main(int argc, char** argv) try {
  const Args a = parse(argc, argv);
  const std::vector<Kind> run_kinds = a.only.empty() ? std::vector<Kind>(kinds.begin(), kinds.end()) : a.only;
  const bool has_ddp = std::find(run_kinds.begin(), run_kinds.end(), Kind::ddp) != run_kinds.end();
  const auto h = static_cast<std::size_t>(a.hidden);
  const std::size_t params = 784 * h + h + h * h + h + 10 * h + 10;
  std::printf("# gradsync fully_shard against its DistributedDataParallel (LibTorch), MLP 784-%d-%d-10 (%.2fM params; "
              "units b1, b2, root), per-rank batch %d, %s, Threads, one LibTorch thread per rank\n"
              "# %d interleaved rounds of %d steps (after %d warm-up); ms/step: rank 0's median step, median over "
              "rounds [min-max]; xDDP: over DDP's in the same round; faults: rank 0's minor page faults per step\n"
              "#  N  strategy      ms/step [min-max]         xDDP [min-max]       samples/s   faults\n",
              a.hidden, a.hidden, double(params) / 1e6, a.batch, a.sgd ? "SGD lr 0.01" : "Adam lr 1e-3", a.rounds,
              a.steps, a.warmup);
  std::fflush(stdout);
  for (int n : a.ranks) {
    std::map<Kind, std::vector<double>> ms, xddp, faults;
    std::array<std::vector<double>, 3> comm_ms;
    for (int r = 0; r < a.rounds; ++r) {
      std::map<Kind, double> round;
      for (std::size_t i = 0; i < run_kinds.size(); ++i) {
        const Kind k = run_kinds[(i + static_cast<std::size_t>(r)) % run_kinds.size()];
        const Timed t = run(n, k, a);
        round[k] = t.ms;
        ms[k].push_back(t.ms);
        faults[k].push_back(t.faults);
      }
      if (has_ddp) {
        for (Kind k : run_kinds) xddp[k].push_back(round[k] / round[Kind::ddp]);
      }
      if (n > 1 && a.only.empty()) {
        const auto c = collectives(n, a);
        for (std::size_t i = 0; i < 3; ++i) comm_ms[i].push_back(c[i]);
      }
    }
    for (Kind k : run_kinds) {
      const Range t = range_of(ms[k]);
      const Range x = has_ddp ? range_of(xddp[k]) : Range{0, 0, 0};
      std::printf("%4d  %-12s %8.2f %-17s %6.2f %-13s %10.0f %8.0f\n", n, kind_name(k), t.med, bracket(t).c_str(),
                  x.med, bracket(x).c_str(), 1000.0 * n * a.batch / t.med, median(faults[k]));
    }
    if (n > 1 && a.only.empty()) {
      const Range g = range_of(comm_ms[0]), s = range_of(comm_ms[1]), r = range_of(comm_ms[2]);
      std::printf("%4d  collectives  gather %.2f [%.2f-%.2f]  reduce-scatter %.2f [%.2f-%.2f]  all-reduce %.2f "
                  "[%.2f-%.2f] ms (all units, alone; FullShard gathers twice a step)\n",
                  n, g.med, g.lo, g.hi, s.med, s.lo, s.hi, r.med, r.lo, r.hi);
    }
    std::fflush(stdout);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "libtorch_fsdp_step: %s\n", e.what());
  return 2;
}
