// fully_shard's gathers ahead of use (FullyShardOptions::max_gathered_units):
// the same parameters with prefetch on and off, every strategy, and
// DistributedDataParallel's; a step's trace of gathers issued ahead, alike
// on every rank; the gathered bytes within the limit; a rank that throws
// with a prefetch in flight fails every rank at once.
//
// Every rank's result is collected and checked on the main thread after
// run_threads, so a failing rank never leaves the others waiting.

#include "torch_fsdp_support.hpp"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

// Its own namespace: test/torch/meson.build compiles it in one translation
// unit with the other LibTorch test files (a unity build).
namespace test_torch_fsdp_prefetch {

namespace {

using Comm = gradsync::Communicator<gradsync::Threads>;
using Scheduler = gradsync::detail::TorchGatherScheduler<gradsync::detail::TorchShardedUnit<gradsync::Threads>>;
using gradsync::ShardingStrategy;
using gradsync::detail::TorchGatherEvent;
using namespace test_torch;
using namespace test_torch_fsdp_support;

Data rank_rows(const Data& d, int rank, std::int64_t b) {
  return {d.x.narrow(0, rank * b, b), d.y.narrow(0, rank * b, b)};
}

/// The scheduler of the units wrapped with `comm`.
std::shared_ptr<Scheduler> scheduler_of(Comm& comm) { return Scheduler::of(&comm, false); }

/// A block whose forward records the bytes every unit of `units` holds
/// gathered at that moment, and throws when `fail` says so.
struct ProbeBlockImpl : torch::nn::Module {
  ProbeBlockImpl(int in, int hidden, int out)
      : a(register_module("a", torch::nn::Linear(in, hidden))),
        b(register_module("b", torch::nn::Linear(hidden, out))) {
    to(torch::kDouble);
  }
  torch::Tensor forward(torch::Tensor x) {
    std::size_t held = 0;
    for (const auto& u : units) held += u->gathered_bytes();
    most = std::max(most, held);
    if (fail && fail()) {
      // What was issued last is this rank's gather of the unit after this one.
      if (on_fail) on_fail();
      throw std::runtime_error("boom in a block's forward");
    }
    return torch::tanh(b(torch::relu(a(x))));
  }
  torch::nn::Linear a, b;
  std::vector<std::shared_ptr<gradsync::detail::TorchUnit>> units;
  std::size_t most = 0;
  std::function<bool()> fail;
  std::function<void()> on_fail;
};
TORCH_MODULE(ProbeBlock);

/// Four wrapped blocks of different sizes in a row, under a root that is
/// not wrapped (its head stays replicated): every gathered byte is a
/// block's, which max_gathered_units counts.
struct ChainImpl : torch::nn::Module {
  ChainImpl()
      : b1(register_module("b1", ProbeBlock(12, 16, 10))),
        b2(register_module("b2", ProbeBlock(10, 24, 10))),
        b3(register_module("b3", ProbeBlock(10, 8, 10))),
        b4(register_module("b4", ProbeBlock(10, 20, 12))),
        head(register_module("head", torch::nn::Linear(12, 5))) {
    head->to(torch::kDouble);
  }
  torch::Tensor forward(torch::Tensor x) {
    torch::Tensor h = b4(b3(b2(b1(x))));
    if (last) last(h);
    return head(h);
  }
  std::vector<gradsync::ShardedModule<ProbeBlock>*> blocks() { return {&b1, &b2, &b3, &b4}; }
  gradsync::ShardedModule<ProbeBlock> b1, b2, b3, b4;
  torch::nn::Linear head;
  /// Called with b4's output, after its unit hooked it.
  std::function<void(torch::Tensor&)> last;
};
TORCH_MODULE(Chain);

/// Each block of `m` wrapped with `o`, then told every unit (for its probe).
void wrap_chain(Chain& m, Comm& comm, const gradsync::FullyShardOptions& o) {
  std::vector<std::shared_ptr<gradsync::detail::TorchUnit>> units;
  for (auto* b : m->blocks()) {
    gradsync::fully_shard(*b, comm, o);
    units.push_back(gradsync::detail::find_torch_unit(b->ptr().get()));
  }
  for (auto* b : m->blocks()) (*b)->units = units;
}

/// A block's padded parameters over n ranks, in bytes of double.
std::size_t padded_bytes(std::int64_t in, std::int64_t hidden, std::int64_t out, std::int64_t n) {
  const std::int64_t p = in * hidden + hidden + hidden * out + out;
  return static_cast<std::size_t>((p + n - 1) / n * n) * sizeof(double);
}

std::string describe(const std::vector<TorchGatherEvent>& trace) {
  std::string out;
  for (const auto& e : trace) {
    out += std::string(e.backward ? "B" : "F") + (e.ahead ? "+" : "") + std::to_string(e.unit) + " ";
  }
  return out;
}

}  // namespace

TEST_CASE("fully_shard: prefetch on and off give the same parameters, bit for bit, every strategy, and "
          "DistributedDataParallel's") {
  CAPTURE(test::test_seed());
  const std::int64_t b = 3;
  const int steps = 5;
  const auto init = initial_state("fsdp prefetch parity init");
  struct Case {
    ShardingStrategy strategy;
    int n, shard_size;
  };
  for (const Case c : {Case{ShardingStrategy::FullShard, 3, 0}, Case{ShardingStrategy::ShardGradOp, 3, 0},
                       Case{ShardingStrategy::NoShard, 2, 0}, Case{ShardingStrategy::HybridShard, 4, 2}}) {
    const std::string strategy_name = gradsync::name(c.strategy);
    CAPTURE(strategy_name);
    CAPTURE(c.n);
    Data d = make_data(c.n * b, "fsdp prefetch parity data");
    d.x = d.x.to(torch::kDouble);
    PerRank ddp = run_ranks(c.n, [&](Comm& comm) {
      Net m;
      if (comm.rank() == 0) load_state(*m, init);
      gradsync::DistributedDataParallel dp(comm, m);
      auto o = make_optimizer(Opt::adam, *m);
      fit([&](const torch::Tensor& x) { return dp(x); }, *o, rank_rows(d, comm.rank(), b), steps);
      return state(*m);
    });
    REQUIRE(ddp.errors[0] == "");
    std::vector<PerRank> runs;
    std::vector<std::size_t> ahead;
    for (const std::size_t limit : {std::size_t{1}, std::size_t{2}, std::size_t{3}}) {
      std::atomic<std::size_t> issued{0};
      runs.push_back(run_ranks(c.n, [&](Comm& comm) {
        gradsync::ShardedModule<Net> m;
        if (comm.rank() == 0) load_state(*m, init);
        gradsync::FullyShardOptions o;
        o.strategy = c.strategy;
        o.shard_size = c.shard_size;
        o.max_gathered_units = limit;
        wrap(m, comm, o);
        auto opt = make_optimizer(Opt::adam, *m);
        fit([&](const torch::Tensor& x) { return m(x); }, *opt, rank_rows(d, comm.rank(), b), steps);
        for (const auto& e : scheduler_of(comm)->trace()) issued += e.ahead ? 1 : 0;
        return values(gradsync::full_state_dict(m));
      }));
      ahead.push_back(issued);
    }
    for (std::size_t i = 0; i < runs.size(); ++i) {
      CAPTURE(i);
      for (std::size_t r = 0; r < runs[i].errors.size(); ++r) {
        CAPTURE(r);
        REQUIRE(runs[i].errors[r] == "");
        CHECK(bitwise_equal(runs[i].params[r], runs[0].params[0]));
      }
    }
    const double from_ddp = max_relative(runs[1].params[0], ddp.params[0]);
    CAPTURE(from_ddp);
    CHECK(from_ddp <= 1e-5);
    // Off issues nothing ahead; on, the sharded strategies do (NoShard gathers nothing).
    CHECK(ahead[0] == 0);
    const bool gathers = c.strategy != ShardingStrategy::NoShard;
    CHECK((ahead[1] > 0) == gathers);
    CHECK((ahead[2] > 0) == gathers);
  }
}

TEST_CASE("fully_shard: a step's trace gathers the next unit ahead in forward and in backward, alike on every rank") {
  CAPTURE(test::test_seed());
  const int n = 3;
  const std::int64_t b = 2;
  Data d = make_data(n * b, "fsdp prefetch trace data");
  d.x = d.x.to(torch::kDouble);
  for (const std::size_t limit : {std::size_t{1}, std::size_t{2}}) {
    CAPTURE(limit);
    std::vector<std::vector<std::string>> traces(static_cast<std::size_t>(n));
    PerRank got = run_ranks(n, [&](Comm& comm) {
      gradsync::ShardedModule<Net> m;
      gradsync::FullyShardOptions o;
      o.max_gathered_units = limit;
      wrap(m, comm, o);  // b1: unit 0, b2: unit 1, the root: unit 2
      auto opt = make_optimizer(Opt::sgd_momentum, *m);
      const Data mine = rank_rows(d, comm.rank(), b);
      for (int s = 0; s < 3; ++s) {
        opt->zero_grad();
        torch::nn::functional::cross_entropy(m(mine.x), mine.y).backward();
        opt->step();
        traces[static_cast<std::size_t>(comm.rank())].push_back(describe(scheduler_of(comm)->trace()));
      }
      return std::vector<torch::Tensor>{};
    });
    for (std::size_t r = 0; r < traces.size(); ++r) {
      CAPTURE(r);
      REQUIRE(got.errors[r] == "");
      REQUIRE(traces[r].size() == 3);
      CHECK(traces[r] == traces[0]);
    }
    // The first forward has no order to follow; its backward follows it
    // reversed. Later forwards follow the one before. Off: all on demand.
    const std::string first_forward = "F2 F0 F1 ";
    if (limit == 1) {
      CHECK(traces[0][0] == first_forward + "B2 B1 B0 ");
      CHECK(traces[0][2] == "F2 F0 F1 B2 B1 B0 ");
    } else {
      CHECK(traces[0][0] == first_forward + "B2 B+1 B+0 ");
      CHECK(traces[0][1] == "F2 F+0 F+1 B2 B+1 B+0 ");
      CHECK(traces[0][2] == traces[0][1]);
    }
  }
}

TEST_CASE("fully_shard: the units max_gathered_units counts never hold more than it times the largest unit, "
          "or twice it") {
  CAPTURE(test::test_seed());
  const int n = 3, steps = 3;
  const std::int64_t b = 2;
  Data d = make_data(n * b, "fsdp prefetch limit data");
  d.x = d.x.to(torch::kDouble);
  std::size_t largest = 0;
  for (const auto& [in, hidden, out] : {std::tuple{12, 16, 10}, std::tuple{10, 24, 10}, std::tuple{10, 8, 10},
                                        std::tuple{10, 20, 12}}) {
    largest = std::max(largest, padded_bytes(in, hidden, out, n));
  }
  for (const ShardingStrategy strategy : {ShardingStrategy::FullShard, ShardingStrategy::HybridShard}) {
    const std::string strategy_name = gradsync::name(strategy);
    CAPTURE(strategy_name);
    for (const std::size_t limit : {std::size_t{0}, std::size_t{1}, std::size_t{2}, std::size_t{3}}) {
      CAPTURE(limit);
      std::vector<std::size_t> peak(static_cast<std::size_t>(n)), sampled(static_cast<std::size_t>(n));
      std::vector<std::size_t> ahead(static_cast<std::size_t>(n));
      PerRank got = run_ranks(n, [&](Comm& comm) {
        Chain m;
        gradsync::FullyShardOptions o;
        o.strategy = strategy;
        o.shard_size = n;  // HybridShard: one group of all, so the sizes above hold
        o.max_gathered_units = limit;
        wrap_chain(m, comm, o);
        auto opt = make_optimizer(Opt::sgd_momentum, *m);
        const Data mine = rank_rows(d, comm.rank(), b);
        const auto r = static_cast<std::size_t>(comm.rank());
        for (int s = 0; s < steps; ++s) {
          opt->zero_grad();
          torch::nn::functional::cross_entropy(m(mine.x), mine.y).backward();
          opt->step();
          for (const auto& e : scheduler_of(comm)->trace()) ahead[r] += e.ahead ? 1 : 0;
        }
        peak[r] = scheduler_of(comm)->peak_transient_bytes();
        for (auto* blk : m->blocks()) sampled[r] = std::max(sampled[r], (*blk)->most);
        return std::vector<torch::Tensor>{};
      });
      // A unit's own gather is never held back: in backward the next unit
      // gathers before the one whose backward is ending has freed its own
      // (the same gradient ends one and starts the other), so two at a time
      // even without prefetch.
      const std::size_t bound = std::max<std::size_t>(limit, 2) * largest;
      for (std::size_t r = 0; r < peak.size(); ++r) {
        CAPTURE(r);
        REQUIRE(got.errors[r] == "");
        CAPTURE(peak[r]);
        CAPTURE(sampled[r]);
        CHECK(peak[r] <= bound);
        // What a block's forward saw held is within what the scheduler tracked.
        CHECK(sampled[r] <= peak[r]);
        CHECK(peak[r] > 0);
        if (limit >= 2) {
          // Two units were held at once: a prefetch beside the running unit.
          CHECK(peak[r] > largest);
          // Steps 2 and 3 gather the 3 blocks after the first ahead in
          // forward, and in backward the 3 before the last.
          CHECK(ahead[r] == 3 + 2 * 6);
        } else {
          CHECK(ahead[r] == 0);
        }
      }
    }
  }
}

TEST_CASE("fully_shard: a rank that throws in a forward or a backward with a prefetch in flight fails every rank "
          "at once") {
  auto rng = test::rng_for("fsdp prefetch fault");
  CAPTURE(test::test_seed());
  for (int round = 0; round < 6; ++round) {
    const auto [n, bad] = draw_odd_rank(rng, 3, 3);
    const int step = 1 + static_cast<int>(rng() % 2);  // counted from 0: a step with an order to follow
    // In forward: in b1, b2 or b3, each with a next unit to prefetch. In
    // backward (FullShard): from a hook on b4's output, which runs after
    // b4's backward began and issued b3's gather.
    const bool backward = rng() % 2 == 0;
    const int block = backward ? 3 : static_cast<int>(rng() % 3);
    const ShardingStrategy strategy =
        backward || rng() % 2 ? ShardingStrategy::FullShard : ShardingStrategy::ShardGradOp;
    const std::string strategy_name = gradsync::name(strategy);
    INFO("round " << round << ": " << n << " ranks, rank " << bad << " throws in block " << block + 1 << "'s "
                  << (backward ? "backward" : "forward") << " in step " << step << ", " << strategy_name);
    const std::int64_t b = 2;
    Data d = make_data(n * b, "fsdp prefetch fault data");
    d.x = d.x.to(torch::kDouble);
    std::vector<int> in_flight(static_cast<std::size_t>(n), -1);
    const Outcomes got = run_failing(n, [&](Comm& comm) {
      Chain m;
      gradsync::FullyShardOptions o;
      o.strategy = strategy;
      wrap_chain(m, comm, o);
      int s = 0;
      const auto r = static_cast<std::size_t>(comm.rank());
      auto* target = m->blocks()[static_cast<std::size_t>(block)];
      auto record = [&, r] {
        const auto& trace = scheduler_of(comm)->trace();
        if (!trace.empty() && trace.back().ahead) in_flight[r] = static_cast<int>(trace.back().unit);
      };
      if (comm.rank() == bad && !backward) {
        (*target)->fail = [&s, step] { return s == step; };
        (*target)->on_fail = record;
      }
      if (comm.rank() == bad && backward) {
        m->last = [&s, step, record](torch::Tensor& h) {
          if (s != step) return;
          h.register_hook([record](const torch::Tensor& /*grad*/) -> torch::Tensor {
            record();
            throw std::runtime_error("boom in a block's backward");
          });
        };
      }
      auto opt = make_optimizer(Opt::sgd_momentum, *m);
      const Data mine = rank_rows(d, comm.rank(), b);
      for (; s < 4; ++s) {
        opt->zero_grad();
        torch::nn::functional::cross_entropy(m(mine.x), mine.y).backward();
        opt->step();
      }
    });
    CAPTURE(got.seconds);
    // The block issued the gather of the unit after it (forward) or before it (backward) before it threw.
    CHECK(in_flight[static_cast<std::size_t>(bad)] == (backward ? block - 1 : block + 1));
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      const auto ru = static_cast<std::size_t>(r);
      INFO(got.kind[ru] << ": " << got.what[ru]);
      CHECK(got.kind[ru] != "returned");
      const std::string boom = backward ? "boom in a block's backward" : "boom in a block's forward";
      if (r == bad) CHECK(got.what[ru].find(boom) != std::string::npos);
    }
    // The waits give up after 10 s: every rank learnt of the failure well before.
    CHECK(got.seconds < 5.0);
  }
}

}  // namespace test_torch_fsdp_prefetch

namespace test_torch_fsdp_prefetch {

TEST_CASE("fully_shard: TorchBufferPool hands a freed buffer's bytes to the next that fits, the smallest, "
          "within its limit") {
  gradsync::detail::TorchBufferPool pool;
  auto storage = [](std::int64_t bytes) { return torch::empty({bytes}, torch::kUInt8).storage(); };
  c10::Storage a = storage(100), b = storage(300), c = storage(200);
  const void* pa = a.data();
  const void* pb = b.data();
  const void* pc = c.data();
  // Freed: the storage object stays, with no bytes.
  pool.reclaim(*a.unsafeGetStorageImpl(), /*held=*/100, /*limit=*/1000);
  pool.reclaim(*b.unsafeGetStorageImpl(), 300, 1000);
  pool.reclaim(*c.unsafeGetStorageImpl(), 200, 1000);
  CHECK(a.nbytes() == 0);
  CHECK(pool.bytes() == 600);
  // 150 bytes: the smallest spare that fits is c's 200, sized 150.
  pool.fill(*a.unsafeGetStorageImpl(), 150);
  CHECK(a.data() == pc);
  CHECK(a.nbytes() == 150);
  CHECK(pool.bytes() == 400);
  // Nothing of 400: a new allocation.
  c10::Storage d = storage(1);
  pool.reclaim(*d.unsafeGetStorageImpl(), 1, 1000);
  pool.fill(*d.unsafeGetStorageImpl(), 400);
  CHECK(d.data() != pa);
  CHECK(d.data() != pb);
  CHECK(d.nbytes() == 400);
  // Over the limit with what is held, the oldest spares go first (a's 100, then b's 300).
  pool.reclaim(*a.unsafeGetStorageImpl(), 150 + 400, 700);
  CHECK(pool.bytes() == 1 + 150);
  pool.fill(*b.unsafeGetStorageImpl(), 120);
  CHECK(b.data() == pc);  // c's bytes, given back as a's 150
}

TEST_CASE("fully_shard: ranks with different max_gathered_units are refused on every rank") {
  PerRank got = run_ranks(3, [&](Comm& comm) {
    gradsync::ShardedModule<Net> m;
    gradsync::FullyShardOptions o;
    if (comm.rank() == 2) o.max_gathered_units = 1;
    gradsync::fully_shard(m->b1, comm, o);
    return std::vector<torch::Tensor>{};
  });
  for (const auto& e : got.errors) {
    CAPTURE(e);
    CHECK(e.find("FullyShardOptions::max_gathered_units") != std::string::npos);
  }
}

}  // namespace test_torch_fsdp_prefetch
