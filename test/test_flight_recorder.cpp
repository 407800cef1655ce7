// The flight recorder: each communicator's ring of its last calls, and the
// record every rank writes when a call fails (test/flight/ checks what
// tools/flight-analyze makes of the records, under faults).

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gradsync/collectives.hpp"
#include "support/common.hpp"
#include "support/temp_dir.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_flight_recorder {

namespace gs = gradsync;
using gs::Communicator;
using gs::Threads;
using gs::detail::FlightRecorder;
using gs::detail::FlightState;

std::string read(const std::filesystem::path& p) {
  std::ifstream f(p);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

std::size_t occurrences(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

/// Sets GRADSYNC_FLIGHT_DIR for its lifetime (before any rank's thread
/// starts, so every rank reads it).
struct FlightDir {
  explicit FlightDir(const std::filesystem::path& p) { setenv("GRADSYNC_FLIGHT_DIR", p.c_str(), 1); }
  ~FlightDir() {
    if (old.empty()) {
      unsetenv("GRADSYNC_FLIGHT_DIR");
    } else {
      setenv("GRADSYNC_FLIGHT_DIR", old.c_str(), 1);
    }
  }
  std::string old = std::getenv("GRADSYNC_FLIGHT_DIR") ? std::getenv("GRADSYNC_FLIGHT_DIR") : "";
};

TEST_CASE("flight record: the ring keeps the last calls, oldest first, with how far each got") {
  auto g = test::rng_for("flight ring");
  // Capacities are rounded up to a power of two.
  const std::size_t capacity = std::size_t{1} << (g() % 4), calls = capacity + g() % 20;
  CAPTURE(capacity);
  CAPTURE(calls);
  FlightRecorder ring(capacity);
  for (std::size_t k = 1; k <= calls; ++k) {
    gs::detail::CallInfo call{};
    call.collective = gs::Collective::all_reduce;
    call.seq = k;
    auto& e = ring.issue(call);
    CHECK(e.state == FlightState::issued);
    FlightRecorder::start(e);
    if (k % 3) FlightRecorder::end(e, k == calls ? FlightState::failed : FlightState::completed);
  }
  CHECK(ring.recorded() == calls);
  REQUIRE(ring.held() == std::min(capacity, calls));
  for (std::size_t i = 0; i < ring.held(); ++i) {
    const auto& e = ring.entry(i);
    const std::uint64_t seq = calls - ring.held() + 1 + i;
    CHECK(e.call.seq == seq);
    CHECK(e.issued_ns > 0);
    if (seq % 3 == 0) {
      CHECK(e.state == FlightState::started);
      CHECK(e.ended_ns == 0);
    } else if (seq == calls) {
      // Only a failed call's end is timed (precisely; its start coarsely).
      CHECK(e.state == FlightState::failed);
      CHECK(e.ended_ns + 10'000'000 >= e.issued_ns);
    } else {
      CHECK(e.state == FlightState::completed);
      CHECK(e.ended_ns == 0);
    }
    if (i) CHECK(e.issued_ns >= ring.entry(i - 1).issued_ns);
  }
}

TEST_CASE("flight record: written on request, each rank's last calls, completed") {
  test::TempDir dir;
  std::vector<std::string> paths(3);
  gs::run_threads(3, [&](Communicator<Threads>& comm) {
    std::vector<float> x(101, 1.0f), all(303);
    for (int k = 0; k < 5; ++k) gs::AllReduce{}(comm, std::span<float>(x));
    gs::AllGather{}(comm, std::span<const float>(x), std::span<float>(all));
    paths[static_cast<std::size_t>(comm.rank())] = comm.write_flight_record(dir.path.string());
  });
  for (int r = 0; r < 3; ++r) {
    const auto expected = dir.path / ("gradsync-flight-world-rank" + std::to_string(r) + ".json");
    CHECK(paths[static_cast<std::size_t>(r)] == expected.string());
    const std::string text = read(expected);
    CHECK(occurrences(text, "\"state\": \"completed\"") == 6);
    CHECK(occurrences(text, "\"collective\": \"AllReduce\"") == 5);
    CHECK(occurrences(text, "\"what\": \"AllGather #6 (") == 1);
    CHECK(occurrences(text, "\"reason\": \"requested\"") == 1);
    CHECK(occurrences(text, "\"rank\": " + std::to_string(r) + ",") == 1);
  }
}

TEST_CASE("flight record: 256 calls by default, into the working directory unless GRADSYNC_FLIGHT_DIR says") {
  test::TempDir dir;
  std::vector<std::string> texts(3);
  gs::run_threads(3, [&](Communicator<Threads>& comm) {
    std::vector<float> x(1, 1.0f);
    for (int k = 0; k < 300; ++k) gs::AllReduce{}(comm, std::span<float>(x));
    texts[static_cast<std::size_t>(comm.rank())] = read(comm.write_flight_record(dir.path.string()));
  });
  for (const std::string& text : texts) {
    CHECK(occurrences(text, "\"capacity\": 256,") == 1);
    CHECK(occurrences(text, "\"recorded\": 300,") == 1);
    CHECK(occurrences(text, "\"state\": \"completed\"") == 256);
    // The oldest kept is call 45, the newest call 300.
    CHECK(occurrences(text, "{\"seq\": 45,") == 1);
    CHECK(occurrences(text, "{\"seq\": 44,") == 0);
    CHECK(occurrences(text, "{\"seq\": 300,") == 1);
  }
  const FlightDir env(dir.path);
  CHECK(gs::detail::flight_dir() == dir.path.string());
  setenv("GRADSYNC_FLIGHT_DIR", "off", 1);
  CHECK(gs::detail::flight_dir().empty());
  unsetenv("GRADSYNC_FLIGHT_DIR");
  CHECK(gs::detail::flight_dir() == ".");
}

TEST_CASE("flight record: a failing call writes every rank's record, named by its group and world rank") {
  // Two groups of a split world; in one of them a rank calls something else
  // at a random call: every rank of that group records the call as failed,
  // and the other group writes nothing.
  auto g = test::rng_for("flight failure");
  const int n = 4 + static_cast<int>(g() % 3);
  const int odd = static_cast<int>(g() % 2), bad_call = 2 + static_cast<int>(g() % 4);
  CAPTURE(n);
  CAPTURE(odd);
  CAPTURE(bad_call);
  test::TempDir dir;
  const FlightDir env(dir.path);
  std::mutex m;
  std::vector<int> failed_world_ranks;
  gs::run_threads(n, [&](Communicator<Threads>& comm) {
    comm.set_timeout(std::chrono::seconds(20));
    const int color = comm.rank() % 2;
    auto group = comm.split(color, 0, color ? "odd ranks" : "even ranks");
    std::vector<float> x(37, 1.0f), all(37 * static_cast<std::size_t>(group->size()));
    try {
      for (int k = 1; k <= 6; ++k) {
        if (color == 1 && group->rank() == odd && k == bad_call) {
          gs::AllGather{}(*group, std::span<const float>(x), std::span<float>(all));
        } else {
          gs::AllReduce{}(*group, std::span<float>(x));
        }
      }
    } catch (const gs::InvalidArgument&) {
      const std::lock_guard lock(m);
      failed_world_ranks.push_back(comm.rank());
    }
  });
  std::vector<int> files;
  for (const auto& f : std::filesystem::directory_iterator(dir.path)) {
    const std::string name = f.path().filename().string();
    INFO(name);
    REQUIRE(name.starts_with("gradsync-flight-odd-ranks-rank"));
    files.push_back(std::stoi(name.substr(30)));
    const std::string text = read(f.path());
    CHECK(occurrences(text, "\"reason\": \"InvalidArgument\"") == 1);
    CHECK(occurrences(text, "\"state\": \"failed\"") == 1);
    CHECK(occurrences(text, "\"state\": \"completed\"") == static_cast<std::size_t>(bad_call - 1));
    CHECK(occurrences(text, "\"group\": \"odd ranks\"") == 1);
  }
  std::sort(files.begin(), files.end());
  std::sort(failed_world_ranks.begin(), failed_world_ranks.end());
  CHECK(files == failed_world_ranks);
  CHECK(files.size() == static_cast<std::size_t>(n / 2));
}

TEST_CASE("flight record: GRADSYNC_FLIGHT_ENTRIES sizes the ring, and 0 keeps none and writes no record") {
  const char* was = std::getenv("GRADSYNC_FLIGHT_ENTRIES");
  const std::string old = was ? was : "";
  struct Restore {
    bool had;
    std::string value;
    ~Restore() { had ? setenv("GRADSYNC_FLIGHT_ENTRIES", value.c_str(), 1) : unsetenv("GRADSYNC_FLIGHT_ENTRIES"); }
  } restore{was != nullptr, old};
  const std::pair<const char*, std::size_t> cases[] = {{"100", 100}, {"0", 0}, {"", 256}, {"12x", 256}, {"9999999", 1u << 20}};
  for (const auto& c : cases) {
    const char* text = c.first;
    CAPTURE(text);
    setenv("GRADSYNC_FLIGHT_ENTRIES", text, 1);
    CHECK(gs::detail::flight_capacity() == c.second);
  }

  FlightRecorder none(0);
  gs::detail::CallInfo call{};
  call.seq = 1;
  auto& e = none.issue(call);
  FlightRecorder::start(e);
  FlightRecorder::end(e, FlightState::failed);
  CHECK(none.recorded() == 0);
  CHECK(none.held() == 0);

  // A failing call under GRADSYNC_FLIGHT_ENTRIES=0 still fails as always, and leaves no file.
  test::TempDir dir;
  const FlightDir env(dir.path);
  setenv("GRADSYNC_FLIGHT_ENTRIES", "0", 1);
  std::atomic<int> failed{0};
  gs::run_threads(3, gs::ThreadsOptions{.timeout = std::chrono::milliseconds(50)}, [&](Communicator<Threads>& comm) {
    std::vector<float> x(7, 1.0f);
    try {
      if (comm.rank() != 1) gs::AllReduce{}(comm, std::span<float>(x));
    } catch (const gs::Error&) {
      ++failed;
    }
  });
  CHECK(failed.load() == 2);
  CHECK(std::filesystem::is_empty(dir.path));
}

TEST_CASE("flight record: a dump signal makes every rank waiting in a call write its ring, the call included") {
  // 3 to 5 ranks, one of them (drawn) late to an AllReduce: the others wait
  // in it, a SIGUSR1 arrives, and each waiting rank writes its record from
  // its own thread while the late rank is still away.
  auto g = test::rng_for("flight record signal");
  const int world = 3 + static_cast<int>(g() % 3);
  const int late = static_cast<int>(g() % static_cast<std::uint64_t>(world));
  INFO("GRADSYNC_TEST_SEED = " << test::test_seed() << ", world = " << world << ", late rank = " << late);
  test::TempDir dir;
  const FlightDir env(dir.path);
  gs::dump_flight_records_on(SIGUSR1);
  const auto path = [&](int r) { return dir.path / ("gradsync-flight-world-rank" + std::to_string(r) + ".json"); };
  std::atomic<bool> dumped{false};
  // Ranks out of the first AllReduce: no signal comes before all are, or a
  // rank still waiting in it (a slow start, under a sanitizer on a busy
  // machine) would answer it, the late one too.
  std::atomic<int> past_first{0};
  std::thread signaller([&] {
    // Every other rank's record written, or give up after 20 s (the check below says which).
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (past_first.load() < world && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    for (int sent = 0; std::chrono::steady_clock::now() < until; ++sent) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      bool all = true;
      for (int r = 0; r < world; ++r) all = all && (r == late || std::filesystem::exists(path(r)));
      if (all) break;
      if (sent % 20 == 0) std::raise(SIGUSR1);  // again each second, as a user would
    }
    dumped = true;
  });
  gs::run_threads(world, gs::ThreadsOptions{.timeout = std::chrono::seconds(60)}, [&](Communicator<Threads>& comm) {
    std::vector<float> x(37, 1.0f);
    gs::AllReduce{}(comm, std::span<float>(x));
    ++past_first;
    if (comm.rank() == late) {
      while (!dumped) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    gs::AllReduce{}(comm, std::span<float>(x));
  });
  signaller.join();
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    if (r == late) {
      CHECK(!std::filesystem::exists(path(r)));
      continue;
    }
    REQUIRE(std::filesystem::exists(path(r)));
    const std::string text = read(path(r));
    CHECK(occurrences(text, "\"reason\": \"signal\"") == 1);
    CHECK(occurrences(text, "\"state\": \"completed\"") == 1);  // the first AllReduce; the second was waiting
    CHECK(occurrences(text, "\"what\": \"AllReduce #2 (") == 1);
  }
}

TEST_CASE("flight record: GRADSYNC_FLIGHT_SIGNAL's names, and a signal that cannot be caught is refused") {
  using gs::detail::parse_signal;
  CHECK(parse_signal("USR1") == SIGUSR1);
  CHECK(parse_signal("SIGUSR2") == SIGUSR2);
  CHECK(parse_signal("10") == 10);
  CHECK(parse_signal("") == 0);
  CHECK(parse_signal("USR3") == 0);
  CHECK(parse_signal("1x") == 0);
  CHECK_THROWS_AS(gs::dump_flight_records_on(SIGKILL), gs::InvalidArgument);
  CHECK_THROWS_AS(gs::dump_flight_records_on(0), gs::InvalidArgument);
}

}  // namespace test_flight_recorder
