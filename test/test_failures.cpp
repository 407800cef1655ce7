// Failures: bad arguments are caught before any communication and say what
// was expected and given; a rank that throws makes the others fail fast; a
// rank that never comes makes the others time out with a message naming it;
// ranks that disagree end in an error, never in a hang or a stray write.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradsync/core/wire_call.hpp"
#include "gradsync/collectives.hpp"
#include "support/common.hpp"
#include "support/instances.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_failures {

namespace gs = gradsync;
using test::Algorithms;
using test::for_each_type;
using Comm = gs::Communicator<gs::Threads>;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

namespace {

bool contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// Messages collected from several ranks.
struct Log {
  std::mutex mutex;
  std::vector<std::string> lines;
  void add(std::string s) {
    std::lock_guard<std::mutex> lock(mutex);
    lines.push_back(std::move(s));
  }
};

/// A collective called with bad arguments, and the same collective called well.
struct BadCall {
  std::string name;
  std::function<void(Comm&, bool bad)> call;
  std::vector<std::string> message_has;
};

/// A collective `C` called with `in` and `out` of the sizes given, each filled with ones:
/// the bad call's sizes, or the good call's.
template <class T, class C>
BadCall with_sizes(std::string name, std::size_t in_good, std::size_t in_bad, std::size_t out_good,
                   std::size_t out_bad, std::vector<std::string> message_has) {
  return {std::move(name),
          [=](Comm& comm, bool bad) {
            std::vector<T> in(bad ? in_bad : in_good, T(1)), out(bad ? out_bad : out_good);
            C{}(comm, std::span<const T>(in), std::span<T>(out));
          },
          std::move(message_has)};
}

/// A collective `C` called on one buffer of `size` ones, its input the first `in_size`
/// elements and its output the `out_size` from `out_bad` (bad) or `out_good` (good).
template <class T, class C>
BadCall in_one_buffer(std::string name, std::size_t size, std::size_t in_size, std::size_t out_size,
                      std::size_t out_good, std::size_t out_bad, std::vector<std::string> message_has) {
  return {std::move(name),
          [=](Comm& comm, bool bad) {
            std::vector<T> buf(size, T(1));
            std::span<T> s(buf);
            C{}(comm, std::span<const T>(s.first(in_size)), s.subspan(bad ? out_bad : out_good, out_size));
          },
          std::move(message_has)};
}

/// AllGather of 4 elements a rank into 12 ones, its input the block of `out`
/// from `in_offset(rank, bad)`: its own block is the good call.
BadCall gather_from_out(std::string name, std::size_t (*in_offset)(int rank, bool bad)) {
  return {std::move(name),
          [in_offset](Comm& comm, bool bad) {
            std::vector<std::int32_t> out(12, 1);
            std::span<std::int32_t> s(out);
            gs::AllGather<gs::Ring>{}(comm, std::span<const std::int32_t>(s.subspan(in_offset(comm.rank(), bad), 4)), s);
          },
          {"AllGather", "overlap"}};
}

/// Broadcast of 5 elements from `bad_root`, or from 0.
BadCall broadcast_from(std::string name, int bad_root) {
  return {std::move(name),
          [bad_root](Comm& comm, bool bad) {
            std::vector<std::int64_t> buf(5, 1);
            gs::Broadcast<gs::Ring>{}(comm, std::span<std::int64_t>(buf), bad ? bad_root : 0);
          },
          {"Broadcast", "[0, 3)", "got " + std::to_string(bad_root)}};
}

/// All bad calls, for a world of 3.
std::vector<BadCall> bad_calls() {
  return {
      with_sizes<float, gs::AllReduce<gs::Ring>>("AllReduce with in and out of different sizes", 10, 10, 10, 12,
                                                 {"AllReduce", "in.size() = 10", "out.size() = 12"}),
      in_one_buffer<float, gs::AllReduce<gs::Ring>>("AllReduce with partially overlapping in and out", 20, 10, 10,
                                                    10, 5, {"AllReduce", "overlap"}),
      with_sizes<double, gs::ReduceScatter<gs::Ring>>("ReduceScatter with in.size() != out.size() * N", 12, 10, 4, 4,
                                                      {"ReduceScatter", "4 * 3 = 12", "in.size() = 10"}),
      in_one_buffer<double, gs::ReduceScatter<gs::Ring>>("ReduceScatter with overlapping in and out", 16, 12, 4, 12,
                                                         8, {"ReduceScatter", "overlap"}),
      with_sizes<std::int32_t, gs::AllGather<gs::Ring>>("AllGather with out.size() != in.size() * N", 4, 4, 12, 10,
                                                        {"AllGather", "4 * 3 = 12", "out.size() = 10"}),
      gather_from_out("AllGather with in overlapping out but not its own block",
                      [](int rank, bool bad) {
                        const auto own = static_cast<std::size_t>(rank) * 4;
                        return bad ? (own + 1) % 9 : own;
                      }),
      gather_from_out("AllGather with in being another rank's block of out",
                      [](int rank, bool bad) { return static_cast<std::size_t>(bad ? (rank + 1) % 3 : rank) * 4; }),
      broadcast_from("Broadcast with root -1", -1),
      broadcast_from("Broadcast with root N", 3),
  };
}

}  // namespace

TEST_CASE("bad arguments throw InvalidArgument before any communication, naming expected and given") {
  for (const BadCall& bad : bad_calls()) {
    INFO(bad.name);
    Log messages;
    std::atomic<int> caught{0};
    std::vector<float> after(3);
    // Every rank makes the bad call and survives it; since nothing was sent,
    // the world is still usable and its next collective is call #1.
    gs::run_threads(3, [&](Comm& comm) {
      try {
        bad.call(comm, true);
      } catch (const gs::InvalidArgument& e) {
        ++caught;
        messages.add(e.what());
      }
      if (comm.sequence() != 0) messages.add("sequence advanced to " + std::to_string(comm.sequence()));
      float x = static_cast<float>(comm.rank());
      gs::AllReduce<gs::Ring>{}(comm, std::span<float>(&x, 1));
      after[static_cast<std::size_t>(comm.rank())] = x;
    });
    CHECK(caught == 3);
    REQUIRE(messages.lines.size() == 3);
    for (const std::string& m : messages.lines) {
      INFO(m);
      for (const std::string& needle : bad.message_has) CHECK(contains(m, needle));
    }
    CHECK(after == std::vector<float>(3, 3.0f));
  }
}

TEST_CASE("one rank's bad arguments: run_threads rethrows its InvalidArgument, the others are Aborted") {
  for (const BadCall& bad : bad_calls()) {
    INFO(bad.name);
    Log aborted;
    const auto t0 = Clock::now();
    try {
      gs::run_threads(3, [&](Comm& comm) {
        try {
          bad.call(comm, comm.rank() == 1);
        } catch (const gs::Aborted& e) {
          aborted.add(e.what());
          throw;
        }
      });
      FAIL_CHECK("run_threads returned normally");
    } catch (const gs::InvalidArgument& e) {
      INFO(e.what());
      CHECK(contains(e.what(), "on rank 1"));
      for (const std::string& needle : bad.message_has) CHECK(contains(e.what(), needle));
    } catch (const std::exception& e) {
      FAIL_CHECK("expected InvalidArgument, got: " << e.what());
    }
    CHECK(seconds_since(t0) < 1.0);
    // Ranks 0 and 2 either never got far enough to notice, or were Aborted.
    for (const std::string& m : aborted.lines) CHECK(contains(m, "rank 1 failed"));
  }
}

TEST_CASE("run_threads rejects a world size below 1 and a timeout that is not positive") {
  std::atomic<int> ran{0};
  auto body = [&](Comm&) { ++ran; };
  CHECK_THROWS_WITH_AS(gs::run_threads(0, body), doctest::Contains("got 0"), gs::InvalidArgument);
  CHECK_THROWS_WITH_AS(gs::run_threads(-1, body), doctest::Contains("got -1"), gs::InvalidArgument);
  CHECK_THROWS_AS(gs::run_threads(2, gs::ThreadsOptions{.timeout = 0ms}, body), gs::InvalidArgument);
  CHECK(ran == 0);
  gs::run_threads(1, [](Comm& comm) {
    CHECK_THROWS_AS(comm.set_timeout(0ms), gs::InvalidArgument);
    CHECK_THROWS_AS(comm.set_timeout(-1s), gs::InvalidArgument);
  });
}

namespace {

std::atomic<int> function_body_calls{0};
void function_body(Comm& comm) { function_body_calls += comm.rank() + 1; }

/// A callable whose unary operator& is not its address.
struct NoAddressOf {
  std::atomic<int>* calls;
  void operator()(Comm&) const { ++*calls; }
  void operator&() const = delete;
};

}  // namespace

TEST_CASE("run_threads runs any callable body: a function, a pointer to one, a const or temporary object") {
  function_body_calls = 0;
  gs::run_threads(3, function_body);
  gs::run_threads(3, &function_body);
  CHECK(function_body_calls == 12);
  std::atomic<int> calls{0};
  const NoAddressOf object{&calls};
  gs::run_threads(2, object);
  gs::run_threads(2, NoAddressOf{&calls});
  CHECK(calls == 4);
}

namespace {

/// Rank `thrower` throws "boom" (after `warmup` good collectives) while the
/// others are inside `collective` number warmup + 1.
template <class Algo>
void boom_case(int n, int thrower, int which, int warmup) {
  Log aborted;
  const auto t0 = Clock::now();
  std::atomic<double> thrown_at{0.0};
  try {
    gs::run_threads(n, [&](Comm& comm) {
      const auto p = static_cast<std::size_t>(comm.size());
      std::vector<float> x(1000, 1.0f), big(1000 * p, 1.0f), small(1000);
      auto step = [&] {
        switch (which) {
          case 0: gs::AllReduce<Algo>{}(comm, std::span<float>(x)); break;
          case 1: gs::ReduceScatter<Algo>{}(comm, std::span<const float>(big), std::span<float>(small)); break;
          case 2: gs::AllGather<Algo>{}(comm, std::span<const float>(x), std::span<float>(big)); break;
          case 3: gs::Broadcast<Algo>{}(comm, std::span<float>(x), 0); break;
          default: comm.barrier(); break;
        }
      };
      for (int i = 0; i < warmup; ++i) step();
      if (comm.rank() == thrower) {
        std::this_thread::sleep_for(20ms);
        thrown_at = seconds_since(t0);
        throw std::runtime_error("boom");
      }
      try {
        step();
      } catch (const gs::Aborted& e) {
        aborted.add(e.what());
        throw;
      }
    });
    FAIL_CHECK("run_threads returned normally");
  } catch (const gs::Error& e) {
    FAIL_CHECK("expected the rank's own std::runtime_error, got gradsync::Error: " << e.what());
  } catch (const std::runtime_error& e) {
    CHECK(std::string_view(e.what()) == "boom");
  }
  const double total = seconds_since(t0);
  CHECK(total - thrown_at.load() < 1.0);
  // Every rank that needed the thrower was told why; in a broadcast some
  // ranks may finish without it.
  if (which == 3) {
    CHECK(!aborted.lines.empty());
  } else {
    CHECK(aborted.lines.size() == static_cast<std::size_t>(n - 1));
  }
  for (const std::string& m : aborted.lines) {
    INFO(m);
    CHECK(contains(m, "rank " + std::to_string(thrower) + " failed: boom"));
  }
}

}  // namespace

TEST_CASE_TEMPLATE("a rank that throws makes the others' collectives fail fast; run_threads rethrows it", Algo,
                   gs::Ring, gs::Tree, gs::RecursiveHalvingDoubling, gs::Native, gs::Auto) {
  // The communicator keeps its 300 s default timeout: a hang would show.
  const char* names[] = {"AllReduce", "ReduceScatter", "AllGather", "Broadcast", "barrier"};
  for (int which = 0; which < 5; ++which) {
    for (int n : {2, 3, 5}) {
      for (int thrower : {0, n - 1}) {
        for (int warmup : {0, 2}) {
          INFO(names[which] << "<" << Algo::name << "> N = " << n << ", rank " << thrower << " throws after "
                            << warmup << " good calls");
          boom_case<Algo>(n, thrower, which, warmup);
        }
      }
    }
  }
}

TEST_CASE("an exception not derived from std::exception is rethrown too") {
  Log aborted;
  try {
    gs::run_threads(3, [&](Comm& comm) {
      if (comm.rank() == 2) throw 42;
      try {
        comm.barrier();
      } catch (const gs::Aborted& e) {
        aborted.add(e.what());
        throw;
      }
    });
    FAIL_CHECK("run_threads returned normally");
  } catch (int v) {
    CHECK(v == 42);
  }
  for (const std::string& m : aborted.lines) CHECK(contains(m, "unknown exception"));
}

namespace {

/// Rank 1 sleeps 600 ms and leaves without calling; the others call. Returns
/// the Timeout's message, and checks it came after the 200 ms deadline.
std::string timeout_message(int n, const std::function<void(Comm&)>& call) {
  const auto t0 = Clock::now();
  std::atomic<double> first_error_at{0.0};
  std::string message;
  try {
    gs::run_threads(n, gs::ThreadsOptions{.timeout = 200ms}, [&](Comm& comm) {
      if (comm.rank() == 1) {
        std::this_thread::sleep_for(600ms);
        return;
      }
      try {
        call(comm);
      } catch (...) {
        double zero = 0.0;
        first_error_at.compare_exchange_strong(zero, seconds_since(t0));
        throw;
      }
    });
    FAIL_CHECK("run_threads returned normally");
  } catch (const gs::Timeout& e) {
    message = e.what();
  } catch (const std::exception& e) {
    FAIL_CHECK("expected Timeout, got: " << e.what());
  }
  CHECK(first_error_at.load() >= 0.19);
  CHECK(first_error_at.load() < 0.55);
  return message;
}

}  // namespace

TEST_CASE("a rank that never arrives: the others time out naming the rank, call and peer") {
  auto all_reduce = [](auto algo) {
    return [](Comm& comm) {
      std::vector<float> x(100, 1.0f);
      gs::AllReduce<typename decltype(algo)::type>{}(comm, std::span<float>(x));
    };
  };
  // On 2 and 3 ranks, the ranks that call time out naming `call` (the
  // collective and its number) and rank 1, the one that never came.
  auto names_the_absent_rank = [](const std::string& call, const std::function<void(Comm&)>& body) {
    for (int n : {2, 3}) {
      const std::string m = timeout_message(n, body);
      INFO("N = " << n << ": " << m);
      CHECK(contains(m, "timed out"));
      CHECK(contains(m, call));
      CHECK(contains(m, "rank 1"));
    }
  };
  SUBCASE("AllReduce<Ring>") { names_the_absent_rank("AllReduce #1", all_reduce(std::type_identity<gs::Ring>{})); }
  SUBCASE("AllReduce<Native>") { names_the_absent_rank("AllReduce #1", all_reduce(std::type_identity<gs::Native>{})); }
  SUBCASE("barrier") { names_the_absent_rank("Barrier #1", [](Comm& comm) { comm.barrier(); }); }
  SUBCASE("the sequence number counts earlier calls, and a rank that left is named at once") {
    // Rank 1 takes part in calls #1 and #2 and leaves before #3: the others
    // learn it from its communicator's destruction, not from the deadline.
    for (int n : {2, 3, 5}) {
      const auto t0 = Clock::now();
      std::string message;
      try {
        gs::run_threads(n, gs::ThreadsOptions{.timeout = 2s}, [&](Comm& comm) {
          std::vector<float> x(10, 1.0f);
          gs::AllReduce<gs::Ring>{}(comm, std::span<float>(x));
          comm.barrier();
          if (comm.rank() == 1) return;
          gs::AllReduce<gs::Ring>{}(comm, std::span<float>(x));
        });
        FAIL_CHECK("run_threads returned normally");
      } catch (const gs::Aborted& e) {
        message = e.what();
      }
      INFO("N = " << n << ": " << message);
      CHECK(contains(message, "AllReduce #3"));
      CHECK(contains(message, "rank 1 left after 2 calls (its run_threads body returned)"));
      CHECK(seconds_since(t0) < 0.5);
    }
  }
}

namespace {

/// Runs `body` on 2 ranks with a short timeout; it must end in InvalidArgument
/// or Timeout, promptly. Returns the message ("" if something else happened).
std::string disagreement(const std::function<void(Comm&)>& body, bool timeout_ok) {
  const auto t0 = Clock::now();
  std::string message;
  try {
    gs::run_threads(2, gs::ThreadsOptions{.timeout = 300ms}, body);
    FAIL_CHECK("run_threads returned normally");
  } catch (const gs::InvalidArgument& e) {
    message = e.what();
    CHECK(contains(message, "disagree"));
  } catch (const gs::Timeout& e) {
    message = e.what();
    CHECK_MESSAGE(timeout_ok, "expected the disagreement to be detected, got: " << message);
  } catch (const std::exception& e) {
    FAIL_CHECK("expected InvalidArgument or Timeout, got: " << e.what());
  }
  CHECK(seconds_since(t0) < 2.0);
  return message;
}

}  // namespace

TEST_CASE_TEMPLATE("ranks that disagree on the call end in an error, not a hang or a stray write", Algo, gs::Ring,
                   gs::Tree, gs::RecursiveHalvingDoubling, gs::Native, gs::Auto) {
  // Every disagreement is named, Auto's too (its calls name what it picked,
  // "auto:ring", which may differ between the two calls).
  constexpr bool timeout_ok = false;
  // Repeated: detection races with the peer's own detection and unwinding.
  for (int i = 0; i < 10; ++i) {
    INFO(Algo::name << ", try " << i);
    {
      INFO("counts 10 and 12");
      // Buffers of exactly the size each rank passes: ASan sees any overrun.
      const std::string m = disagreement(
          [](Comm& comm) {
            std::vector<float> x(comm.rank() == 0 ? 10 : 12, 1.0f);
            gs::AllReduce<Algo>{}(comm, std::span<float>(x));
          },
          timeout_ok);
      INFO(m);
      CHECK(!m.empty());
    }
    {
      INFO("AllReduce on rank 0, Broadcast on rank 1");
      const std::string m = disagreement(
          [](Comm& comm) {
            std::vector<float> x(10, 1.0f);
            if (comm.rank() == 0) {
              gs::AllReduce<Algo>{}(comm, std::span<float>(x));
            } else {
              gs::Broadcast<Algo>{}(comm, std::span<float>(x), 0);
            }
          },
          timeout_ok);
      INFO(m);
      if (contains(m, "disagree")) CHECK((contains(m, "AllReduce") && contains(m, "Broadcast")));
    }
    {
      INFO("float on rank 0, double on rank 1");
      disagreement(
          [](Comm& comm) {
            std::vector<float> f(10, 1.0f);
            std::vector<double> d(10, 1.0);
            if (comm.rank() == 0) {
              gs::AllReduce<Algo>{}(comm, std::span<float>(f));
            } else {
              gs::AllReduce<Algo>{}(comm, std::span<double>(d));
            }
          },
          timeout_ok);
    }
    {
      INFO("Sum on rank 0, Max on rank 1");
      disagreement(
          [](Comm& comm) {
            std::vector<float> x(10, 1.0f);
            if (comm.rank() == 0) {
              gs::AllReduce<Algo>{}(comm, std::span<float>(x), gs::Sum{});
            } else {
              gs::AllReduce<Algo>{}(comm, std::span<float>(x), gs::Max{});
            }
          },
          false);
    }
  }
}

TEST_CASE_TEMPLATE("a disagreement both ranks detect at once unwinds safely, however the race goes", Algo, gs::Ring,
                   gs::Tree, gs::RecursiveHalvingDoubling) {
  // Each rank may find the other's mismatched message while the other is
  // already unwinding; under ASan/TSan a read of the departed rank's state shows.
  const int tries = std::is_same_v<Algo, gs::Ring> ? 1000 : 200;
  int invalid = 0;
  for (int i = 0; i < tries; ++i) {
    try {
      gs::run_threads(2, gs::ThreadsOptions{.timeout = 300ms}, [](Comm& comm) {
        std::vector<float> x(comm.rank() == 0 ? 10 : 12, 1.0f);
        gs::AllReduce<Algo>{}(comm, std::span<float>(x));
      });
    } catch (const gs::InvalidArgument&) {
      ++invalid;
    } catch (const std::exception& e) {
      FAIL_CHECK("try " << i << ": expected InvalidArgument, got: " << e.what());
      break;
    }
  }
  CHECK(invalid == tries);
}

namespace {

/// What one rank's call ended in.
struct Outcome {
  std::string kind = "returned";
  std::string what;
  double seconds = 0;
};

/// Runs `body(comm, faulty)` on n ranks (rank `faulty` is the odd one) with a
/// 5 s deadline and returns each rank's outcome.
std::vector<Outcome> outcomes(int n, int faulty, const std::function<void(Comm&, bool)>& body) {
  std::vector<Outcome> out(static_cast<std::size_t>(n));
  const auto t0 = Clock::now();
  try {
    gs::run_threads(n, gs::ThreadsOptions{.timeout = 5s}, [&](Comm& comm) {
      Outcome& o = out[static_cast<std::size_t>(comm.rank())];
      try {
        body(comm, comm.rank() == faulty);
      } catch (const gs::Error& e) {
        o = {test::error_kind(e), e.what(), seconds_since(t0)};
        throw;
      }
      o.seconds = seconds_since(t0);
    });
  } catch (const gs::Error&) {
  }
  return out;
}

template <class Algo>
void all_reduce_of(Comm& comm, std::size_t count, gs::Options opt = {}) {
  std::vector<float> x(count, 1.0f);
  gs::AllReduce<Algo>{opt}(comm, std::span<float>(x));
}

}  // namespace

TEST_CASE_TEMPLATE("each rank names its own call first in a disagreement, whichever rank found it", Algo, gs::Ring,
                   gs::Tree, gs::RecursiveHalvingDoubling) {
  // The race decides which rank finds the mismatch and fails the world;
  // the other learns of it from there, and must still name its own call first.
  for (int i = 0; i < 100; ++i) {
    const std::vector<Outcome> got = outcomes(2, 1, [](Comm& comm, bool) {
      all_reduce_of<Algo>(comm, 4);
      all_reduce_of<Algo>(comm, 4);
      all_reduce_of<Algo>(comm, comm.rank() == 0 ? 10 : 12);
    });
    for (int r = 0; r < 2; ++r) {
      const Outcome& o = got[static_cast<std::size_t>(r)];
      INFO("try " << i << ", rank " << r << ": " << o.kind << ": " << o.what);
      const std::string own = "rank " + std::to_string(r) + " called AllReduce #3";
      REQUIRE(o.what.starts_with("gradsync: ranks disagree on a collective: " + own));
    }
  }
}

TEST_CASE("on 3 to 5 ranks every rank names a disagreement at once, whatever it is about") {
  auto rng = test::rng_for("disagreement on every rank");
  CAPTURE(test::test_seed());
  struct Case {
    const char* name;
    std::function<void(Comm&, bool)> body;
  };
  const std::vector<Case> cases{
      {"Tree AllReduce of 12 elements on one rank and 9 on the others",
       [](Comm& c, bool odd) { all_reduce_of<gs::Tree>(c, odd ? 12 : 9); }},
      {"deterministic Ring, 12 vs 9", [](Comm& c, bool odd) { all_reduce_of<gs::Ring>(c, odd ? 12 : 9, {.deterministic = true}); }},
      {"deterministic Tree, 12 vs 9", [](Comm& c, bool odd) { all_reduce_of<gs::Tree>(c, odd ? 12 : 9, {.deterministic = true}); }},
      {"deterministic RHD, 12 vs 9",
       [](Comm& c, bool odd) { all_reduce_of<gs::RecursiveHalvingDoubling>(c, odd ? 12 : 9, {.deterministic = true}); }},
      {"Ring with chunks of 64 B on one rank",
       [](Comm& c, bool odd) { all_reduce_of<gs::Ring>(c, 1000, {.chunk_bytes = odd ? 64u : 0u}); }},
      {"Tree with chunks of 64 B on one rank",
       [](Comm& c, bool odd) { all_reduce_of<gs::Tree>(c, 1000, {.chunk_bytes = odd ? 64u : 0u}); }},
      {"Ring on one rank, Native on the others",
       [](Comm& c, bool odd) { odd ? all_reduce_of<gs::Ring>(c, 100) : all_reduce_of<gs::Native>(c, 100); }},
      {"Broadcast<Ring> from a different root",
       [](Comm& c, bool odd) {
         std::vector<double> x(77, 1.0);
         gs::Broadcast<gs::Ring>{}(c, std::span<double>(x), odd ? 1 : 0);
       }},
      {"Broadcast<Tree> from a different root",
       [](Comm& c, bool odd) {
         std::vector<double> x(77, 1.0);
         gs::Broadcast<gs::Tree>{}(c, std::span<double>(x), odd ? 2 : 0);
       }},
      {"Broadcast<RecursiveHalvingDoubling> from a different root",
       [](Comm& c, bool odd) {
         std::vector<double> x(77, 1.0);
         gs::Broadcast<gs::RecursiveHalvingDoubling>{}(c, std::span<double>(x), odd ? 1 : 0);
       }},
      {"AllReduce<Ring> of equal counts with different labels",
       [](Comm& c, bool odd) { all_reduce_of<gs::Ring>(c, 64, {.label = {.id = odd ? 5u : 3u}}); }},
      {"AllGather<Native> of equal counts with different label settings",
       [](Comm& c, bool odd) {
         std::vector<float> in(4, 1.0f), out(4 * static_cast<std::size_t>(c.size()));
         gs::AllGather<gs::Native>{{.label = {.id = 9, .setting = odd ? 2u : 1u}}}(c, std::span<const float>(in),
                                                                                 std::span<float>(out));
       }},
      {"ReduceScatter<Tree> labelled on one rank only",
       [](Comm& c, bool odd) {
         std::vector<double> in(3 * static_cast<std::size_t>(c.size()), 1.0), out(3);
         gs::ReduceScatter<gs::Tree>{{.label = {.id = odd ? 1u : 0u}}}(c, std::span<const double>(in),
                                                                       std::span<double>(out));
       }},
      {"a skipped call (calls of different sizes)",
       [](Comm& c, bool odd) {
         if (!odd) all_reduce_of<gs::Ring>(c, 5);
         all_reduce_of<gs::Ring>(c, 7);
       }},
      {"AllGather on one rank, AllReduce on the others (Native)",
       [](Comm& c, bool odd) {
         if (odd) {
           std::vector<float> in(4, 1.0f), out(4 * static_cast<std::size_t>(c.size()));
           gs::AllGather<gs::Native>{}(c, std::span<const float>(in), std::span<float>(out));
         } else {
           all_reduce_of<gs::Native>(c, 4);
         }
       }},
  };
  for (const Case& k : cases) {
    for (int n = 3; n <= 5; ++n) {
      const int faulty = static_cast<int>(rng() % static_cast<unsigned>(n));
      INFO(k.name << ", N = " << n << ", odd rank " << faulty);
      // Repeated: the detection races with the peers' own.
      for (int i = 0; i < 5; ++i) {
        const std::vector<Outcome> got = outcomes(n, faulty, k.body);
        for (int r = 0; r < n; ++r) {
          const Outcome& o = got[static_cast<std::size_t>(r)];
          INFO("try " << i << ", rank " << r << ": " << o.kind << ": " << o.what);
          CHECK(o.kind == "InvalidArgument");
          CHECK((contains(o.what, "disagree") || contains(o.what, "different arguments")));
          // Under half the 5 s deadline: found, not timed out. No tighter:
          // CI runs this under ThreadSanitizer at nice 19 beside other tests.
          CHECK(o.seconds < 2.5);
        }
      }
    }
  }
}

TEST_CASE("a Native call abandoned by a tiny deadline frees nothing a peer still writes into") {
  // 24 MiB on 3 ranks with a deadline of a few ms: one rank gives up in a
  // barrier while its peers may still be copying into its buffer. ASan sees
  // a use after free if the abandoning rank does not fence them first.
  for (int i = 0; i < 6; ++i) {
    std::vector<Outcome> got = outcomes(3, i % 3, [&](Comm& comm, bool odd) {
      if (odd) comm.set_timeout(std::chrono::microseconds(200 + 500 * i));
      std::vector<float> x(6 << 20, 1.0f);
      gs::AllReduce<gs::Native>{}(comm, std::span<float>(x));
      CHECK(x[x.size() / 2] == 3.0f);
    });
    int returned = 0;
    for (const Outcome& o : got) returned += o.kind == "returned";
    INFO("try " << i);
    // All pass the closing barrier, or none does.
    CHECK((returned == 0 || returned == 3));
  }
}

TEST_CASE("a communicator used from two threads at once says so") {
  std::atomic<int> named{0};
  gs::run_threads(2, [&](Comm& comm) {
    if (comm.rank() == 1) {
      // Rank 1 comes late to its only call, so rank 0's first thread is
      // still inside the barrier when rank 0's second call starts.
      std::this_thread::sleep_for(200ms);
      comm.barrier();
      return;
    }
    std::atomic<bool> inside{false};
    std::thread first([&] {
      inside = true;
      comm.barrier();
    });
    while (!inside) std::this_thread::yield();
    std::this_thread::sleep_for(20ms);  // the first thread is inside the barrier by now
    try {
      std::vector<float> x(3, 1.0f);
      gs::AllReduce<gs::Ring>{}(comm, std::span<float>(x));
    } catch (const gs::InvalidArgument& e) {
      INFO(e.what());
      CHECK(contains(e.what(), "two threads at once"));
      ++named;
    } catch (const std::exception& e) {
      FAIL_CHECK("expected InvalidArgument, got: " << e.what());
    }
    first.join();
  });
  CHECK(named == 1);
}

TEST_CASE("after a failure a communicator refuses every later call at once, naming the failure") {
  for (int n = 3; n <= 5; ++n) {
    std::atomic<int> refused{0};
    try {
      gs::run_threads(n, gs::ThreadsOptions{.timeout = 5s}, [&](Comm& comm) {
        std::vector<float> x(10, 1.0f);
        try {
          if (comm.rank() == 1) x.resize(11);
          gs::AllReduce<gs::Ring>{}(comm, std::span<float>(x));
        } catch (const gs::Error&) {
        }
        CHECK(comm.failed());
        const auto t0 = Clock::now();
        try {
          comm.barrier();
        } catch (const gs::Aborted& e) {
          INFO(e.what());
          CHECK(contains(e.what(), "refused"));
          CHECK(contains(e.what(), "AllReduce #1"));
          // Refused without waiting: a tenth of the 5 s deadline leaves room
          // for a sanitizer build's thread that the scheduler set aside.
          CHECK(seconds_since(t0) < 0.5);
          ++refused;
        }
      });
    } catch (const gs::Error&) {
    }
    CHECK(refused == n);
  }
}

TEST_CASE("after a failure, a new run_threads works normally") {
  CHECK_THROWS_AS(gs::run_threads(4, [](Comm& comm) {
                    if (comm.rank() == 3) throw std::runtime_error("boom");
                    std::vector<float> x(100, 1.0f);
                    gs::AllReduce<gs::Ring>{}(comm, std::span<float>(x));
                  }),
                  std::runtime_error);
  CHECK_THROWS_AS(gs::run_threads(4, gs::ThreadsOptions{.timeout = 100ms},
                                  [](Comm& comm) {
                                    if (comm.rank() == 3) return;
                                    comm.barrier();
                                  }),
                  gs::Aborted);
  CHECK_THROWS_AS(gs::run_threads(4, gs::ThreadsOptions{.timeout = 100ms},
                                  [](Comm& comm) {
                                    if (comm.rank() == 3) std::this_thread::sleep_for(300ms);
                                    else comm.barrier();
                                  }),
                  gs::Timeout);
  for_each_type(Algorithms{}, [](auto algo) {
    using Algo = typename decltype(algo)::type;
    INFO(Algo::name);
    std::vector<std::vector<std::int64_t>> out(4);
    gs::run_threads(4, [&](Comm& comm) {
      auto& x = out[static_cast<std::size_t>(comm.rank())];
      x.assign(33, comm.rank());
      gs::AllReduce<Algo>{}(comm, std::span<std::int64_t>(x));
      comm.barrier();
    });
    for (const auto& x : out) CHECK(x == std::vector<std::int64_t>(33, 6));
  });
}

// Mpi and Nccl name a disagreement from every rank's gathered WireCall with
// one function; here it is held to its contract without a transport.
namespace {
/// Labels as a trainer writes them: the unit's index in the low word.
struct UnitNames final : gs::LabelNames {
  std::string describe(std::uint64_t id, std::uint64_t setting) const override {
    return "gather of unit 'fc" + std::to_string(id) + "', step " + std::to_string(setting);
  }
};
}  // namespace

TEST_CASE("a label mismatch is named in the caller's words on every rank") {
  auto rng = test::rng_for("label names");
  CAPTURE(test::test_seed());
  static const UnitNames names;
  for (int n = 3; n <= 5; ++n) {
    const int faulty = static_cast<int>(rng() % static_cast<unsigned>(n));
    const std::uint64_t step = rng() % 100;
    INFO("N = " << n << ", odd rank " << faulty << ", step " << step);
    const std::vector<Outcome> got = outcomes(n, faulty, [&](Comm& c, bool odd) {
      all_reduce_of<gs::Ring>(c, 32, {.label = {.id = odd ? 3u : 2u, .setting = step, .names = &names}});
    });
    for (int r = 0; r < n; ++r) {
      const Outcome& o = got[static_cast<std::size_t>(r)];
      INFO("rank " << r << ": " << o.kind << ": " << o.what);
      CHECK(o.kind == "InvalidArgument");
      CHECK(contains(o.what, "gather of unit 'fc2', step " + std::to_string(step)));
      CHECK(contains(o.what, "gather of unit 'fc3', step " + std::to_string(step)));
      CHECK(contains(o.what, "rank " + std::to_string(faulty) + " called"));
    }
  }
}

TEST_CASE("WireCall: a call survives the wire, and the first differing rank is named") {
  gs::detail::CallInfo a{.collective = gs::Collective::all_reduce, .algorithm = "ring",
                         .type = gs::DataType::float32, .op = gs::OpKind::sum, .count = 1000, .root = -1,
                         .deterministic = true, .chunk_bytes = 4096, .seq = 7};
  a.label.id = 5;
  const auto wa = gs::detail::WireCall::of(a);
  CHECK(wa.call() == a);
  std::vector<gs::detail::WireCall> all(5, wa);
  const gs::detail::RankNames world;
  CHECK_FALSE(gs::detail::disagreement(2, wa, all, world).has_value());
  // Each field alone must make calls differ, on the wire and in the hash.
  const std::vector<std::function<void(gs::detail::CallInfo&)>> edits = {
      [](auto& c) { c.collective = gs::Collective::all_gather; },
      [](auto& c) { c.algorithm = "tree"; },
      [](auto& c) { c.type = gs::DataType::float64; },
      [](auto& c) { c.op = gs::OpKind::max; },
      [](auto& c) { c.count = 1001; },
      [](auto& c) { c.root = 2; },
      [](auto& c) { c.deterministic = false; },
      [](auto& c) { c.chunk_bytes = 8192; },
      [](auto& c) { c.seq = 8; },
      [](auto& c) { c.label.id = 3; },
      [](auto& c) { c.label.setting = 0x3fb999999999999aull; },
  };
  for (std::size_t k = 0; k < edits.size(); ++k) {
    CAPTURE(k);
    gs::detail::CallInfo b = a;
    edits[k](b);
    const auto wb = gs::detail::WireCall::of(b);
    CHECK_FALSE(wb == wa);
    CHECK(wb.hash() != wa.hash());
    all.assign(5, wa);
    all[3] = wb;
    const auto what = gs::detail::disagreement(1, wa, all, world);
    REQUIRE(what.has_value());
    CHECK(what->find("ranks disagree on a collective: rank 1 called " + gs::detail::describe(a)) != std::string::npos);
    CHECK(what->find("rank 3 called " + gs::detail::describe(b)) != std::string::npos);
    // Rank 3's own view names rank 0, the first whose call differs from its own.
    const auto theirs = gs::detail::disagreement(3, wb, all, world);
    REQUIRE(theirs.has_value());
    CHECK(theirs->find("rank 0 called " + gs::detail::describe(a)) != std::string::npos);
  }
  // On a group split from a split, the ranks are named by their world rank
  // (the root's), then within the group, as the caller's names say.
  const std::vector<int> halves{6, 4, 2, 0};  // the world ranks of a group's members
  const gs::detail::RankNames group = world.split(halves, 1, "shard group 1");
  const gs::detail::RankNames nested = group.split(std::vector<int>{3, 1}, 5, "");
  all.assign(2, wa);
  all[1].count = 999;
  const auto named = gs::detail::disagreement(0, wa, all, nested);
  REQUIRE(named.has_value());
  CHECK(named->find("ranks disagree on a collective: world rank 0 (rank 0 of group of color 5 in shard group 1) "
                    "called ") != std::string::npos);
  CHECK(named->find(", world rank 4 (rank 1 of group of color 5 in shard group 1) called ") != std::string::npos);
  CHECK(world.who(3) == "rank 3");
  CHECK(group.who(1) == "world rank 4 (rank 1 of shard group 1)");
  CHECK(group.split_unmapped(2, "").who(0) == "rank 0 of group of color 2 in shard group 1");
}

}  // namespace test_failures
