// The timeline: each rank's collectives with their words and times, one
// Chrome trace file per rank, the worker's calls on its own track, the cap
// on events, and nothing at all when it is off (test/trace/ checks the
// trainers' timelines as JSON, with tools/trace-summary).

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "gradsync/collectives.hpp"
#include "support/common.hpp"
#include "support/temp_dir.hpp"
#include "support/trace_events.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_trace_recorder {

namespace gs = gradsync;
using gs::Communicator;
using gs::Threads;

/// Runs `body` with GRADSYNC_TRACE set to `dir` (unset for nullptr), set
/// before any rank's thread starts so every rank reads it, and puts back
/// what the environment held.
template <class F>
void with_trace_env(const char* dir, F&& body) {
  const char* was = std::getenv("GRADSYNC_TRACE");
  const std::optional<std::string> old = was ? std::optional<std::string>(was) : std::nullopt;
  dir ? setenv("GRADSYNC_TRACE", dir, 1) : unsetenv("GRADSYNC_TRACE");
  struct Restore {
    const std::optional<std::string>& old;
    ~Restore() { old ? setenv("GRADSYNC_TRACE", old->c_str(), 1) : unsetenv("GRADSYNC_TRACE"); }
  } restore{old};
  body();
}

TEST_CASE("timeline: GRADSYNC_TRACE writes each rank's collectives, in order, with their words") {
  auto g = test::rng_for("timeline calls");
  INFO("GRADSYNC_TEST_SEED = " << test::test_seed());
  const test::TempDir dir;
  constexpr int world = 3;
  const int calls = 3 + static_cast<int>(g() % 5);
  const std::size_t count = 1 + g() % 300;
  with_trace_env(dir.path.c_str(), [&] {
    gs::run_threads(world, [&](Communicator<Threads>& comm) {
      CHECK(comm.tracing());
      std::vector<float> v(count, static_cast<float>(comm.rank()));
      for (int i = 0; i < calls; ++i) {
        if (i % 2) {
          gs::Broadcast<gs::Ring>{}(comm, std::span<float>(v), i % world);
        } else {
          gs::AllReduce<gs::Ring>{}(comm, std::span<float>(v), gs::Sum{});
        }
      }
    });
  });
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    const test::TraceFile f = test::read_trace(dir.path / ("gradsync-trace-rank" + std::to_string(r) + ".json"));
    CHECK(f.text.starts_with("{\"traceEvents\": ["));
    CHECK(f.text.find("\"dropped\": 0") != std::string::npos);
    CHECK(f.text.find("\"name\": \"rank " + std::to_string(r) + "\"") != std::string::npos);
    int seen = 0;
    double last = 0;
    for (const test::TraceLine& e : f.events) {
      CHECK(e.pid == r);
      CHECK(e.dur >= 0);
      CHECK(e.ts >= last);
      last = e.ts;
      if (e.cat != "communication") continue;
      ++seen;
      CHECK(e.name == (seen % 2 ? "AllReduce" : "Broadcast"));
      CHECK(test::trace_field(e.line, "seq") == std::to_string(seen));
      CHECK(test::trace_field(e.line, "bytes") == std::to_string(count * sizeof(float)));
      CHECK(test::trace_field(e.line, "dtype") == "float");
      CHECK(test::trace_field(e.line, "backend") == "Threads");
      CHECK(test::trace_field(e.line, "algorithm") == "ring");
    }
    CHECK(seen == calls);
  }
}

namespace {

/// Set on the thread of the rank whose transport is slow.
thread_local bool slow_rank = false;
constexpr auto slow_op = std::chrono::milliseconds(40);

/// Host memory whose copies and reductions take `slow_op` longer on the slow rank.
gs::detail::threads::Memory slow_memory() {
  gs::detail::threads::Memory m;
  m.copy = [](void* d, const void* s, std::size_t n) {
    if (slow_rank) std::this_thread::sleep_for(slow_op);
    std::memcpy(d, s, n);
  };
  m.reduce = [](gs::DataType t, gs::OpKind op, void* d, const void* s, std::size_t n) {
    if (slow_rank) std::this_thread::sleep_for(slow_op);
    gs::detail::reduce_into_erased(t, op, d, s, n);
  };
  return m;
}

}  // namespace

TEST_CASE("timeline: peer_wait_us is a collective's wait for a slow peer, not the time it moved data") {
  const test::TempDir dir;
  constexpr int world = 3;
  constexpr int slow = 1;
  auto shared = std::make_shared<gs::detail::threads::World>(world);
  std::vector<std::thread> ranks;
  std::vector<std::string> errors(world);
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      slow_rank = r == slow;
      Communicator<Threads> comm(shared, r, slow_memory());
      try {
        comm.trace_to(dir.path.string());
        std::vector<float> v(3 * 1024, 1.0f);
        gs::AllReduce<gs::Ring>{}(comm, std::span<float>(v), gs::Sum{});
        comm.write_trace();
      } catch (const std::exception& e) {
        shared->abort(r, gs::detail::RankNames::world(), comm.sequence() + 1, e.what());
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (const std::string& e : errors) REQUIRE(e == "");
  // A ring on 3 ranks: the slow rank receives at least 4 times (2 reductions, 2 copies), 160 ms or
  // more in all. Its neighbours wait for it: one for its sends, one for it to finish reading theirs.
  double waited[world] = {}, moving[world] = {};
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    const test::TraceFile f = test::read_trace(dir.path / ("gradsync-trace-rank" + std::to_string(r) + ".json"));
    const auto e = std::find_if(f.events.begin(), f.events.end(), [](const auto& x) { return x.name == "AllReduce"; });
    REQUIRE(e != f.events.end());
    const std::string wait = test::trace_field(e->line, "peer_wait_us");
    REQUIRE(!wait.empty());
    waited[r] = std::strtod(wait.c_str(), nullptr);
    moving[r] = e->dur - std::strtod(test::trace_field(e->line, "agree_us").c_str(), nullptr);
    CAPTURE(waited[r]);
    CAPTURE(moving[r]);
    CHECK(waited[r] >= 0);
    CHECK(waited[r] <= moving[r] + 1);
  }
  const double slow_us = 4 * std::chrono::duration<double, std::micro>(slow_op).count();
  CAPTURE(waited[0]);
  CAPTURE(waited[1]);
  CAPTURE(waited[2]);
  // The slow rank's own copies are not waits: at least their time is left
  // over. (What it waits besides, for a neighbour to wake up and go on,
  // grows with the machine's load, so it is not compared.)
  CHECK(moving[slow] - waited[slow] >= 0.99 * slow_us);
  // The slow rank sends to its successor after each of its first three slow
  // operations, so the successor waits about three of them (120 ms). Asked
  // is one: a neighbour that leaves the call's agreement late, or that the
  // machine deschedules, waits less (under TSan on two busy cores, 20 ms of
  // a 30 ms wait went so when an operation took 10 ms).
  for (const int r : {0, 2}) CHECK(waited[r] >= slow_us / 4);
}

TEST_CASE("timeline: off, no rank records or writes anything; write_trace says how to turn it on") {
  const test::TempDir dir;
  const auto cwd = std::filesystem::current_path();
  with_trace_env(nullptr, [&] {
    gs::run_threads(3, [&](Communicator<Threads>& comm) {
      CHECK_FALSE(comm.tracing());
      std::vector<double> v(7, 1.0);
      gs::AllReduce<gs::Ring>{}(comm, std::span<double>(v), gs::Sum{});
      CHECK_THROWS_WITH_AS(comm.write_trace(dir.path.string()), doctest::Contains("GRADSYNC_TRACE=DIR"),
                           gs::InvalidArgument);
    });
  });
  CHECK(std::filesystem::is_empty(dir.path));
  CHECK_FALSE(std::filesystem::exists(cwd / "gradsync-trace-rank0.json"));
}

TEST_CASE("timeline: a rank keeps its first max_events and counts the rest as dropped") {
  const test::TempDir dir;
  gs::run_threads(3, [&](Communicator<Threads>& comm) {
    comm.trace_to(dir.path.string(), 4);
    std::vector<float> v(5, 1.0f);
    for (int i = 0; i < 10; ++i) gs::AllReduce<gs::Ring>{}(comm, std::span<float>(v), gs::Sum{});
  });
  for (int r = 0; r < 3; ++r) {
    const test::TraceFile f = test::read_trace(dir.path / ("gradsync-trace-rank" + std::to_string(r) + ".json"));
    // The kept collectives; an agreement's wait of 1 µs or more adds a
    // "wait" slice inside its call, not an event of its own.
    const auto kept = std::count_if(f.events.begin(), f.events.end(),
                                    [](const test::TraceLine& e) { return e.cat == "communication"; });
    CHECK(kept == 4);
    CHECK(f.text.find("\"recorded\": 10, \"dropped\": 6") != std::string::npos);
  }
}

TEST_CASE("timeline: a progress worker's calls go on its own track, a split group's into the rank's file") {
  const test::TempDir dir;
  gs::run_threads(3, [&](Communicator<Threads>& comm) {
    comm.trace_to(dir.path.string());
    std::vector<float> v(64, 1.0f);
    {
      gs::ProgressWorker<Threads> worker(comm);
      worker.submit("worker's all-reduce", [&](Communicator<Threads>& c) {
        gs::AllReduce<gs::Ring>{}(c, std::span<float>(v), gs::Sum{});
      }).wait();
    }
    auto half = comm.split(comm.rank() % 2);
    REQUIRE(half);
    gs::AllReduce<gs::Ring>{}(*half, std::span<float>(v), gs::Sum{});
    const std::string path = comm.write_trace();
    CHECK(path == (dir.path / ("gradsync-trace-rank" + std::to_string(comm.rank()) + ".json")).string());
  });
  for (int r = 0; r < 3; ++r) {
    const test::TraceFile f = test::read_trace(dir.path / ("gradsync-trace-rank" + std::to_string(r) + ".json"));
    std::vector<std::string> tracks;
    for (const test::TraceLine& e : f.events) {
      if (e.cat == "communication") tracks.push_back(f.thread_names.at(e.tid) + " " + e.name);
    }
    std::sort(tracks.begin(), tracks.end());
    CHECK(tracks == std::vector<std::string>{"caller AllReduce", "caller Split", "progress worker AllReduce"});
  }
}

}  // namespace test_trace_recorder
