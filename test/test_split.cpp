// Communicator::split: sub-communicators of the ranks that pass the same
// color, ordered by key then rank, on every backend that declares split.
// Their collectives give the right results while the parent still works; a
// rank that calls something else or skips the split is named; a member that
// throws makes its sub-communicator's peers fail fast. Every failure on a
// sub-communicator names its ranks by their world rank first, then within
// the group ("world rank 5 (rank 1 of shard group 2)"). Built plainly it runs
// on Threads; with GRADSYNC_TEST_MPI (test/mpi/meson.build) on Mpi.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradsync/core/endpoint_of.hpp"
#include "gradsync/collectives.hpp"
#include "support/common.hpp"
#include "support/world.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_split {

namespace gs = gradsync;
using Comm = gs::Communicator<test::Backend>;
using Clock = std::chrono::steady_clock;

// The capabilities each backend declares, and the public API following them.
template <class C>
concept HasLocalRank = requires(const C& c) { c.local_rank(); };
template <class C>
concept HasEndpoint = requires(C& c) { c.endpoint(); };
static_assert(gs::backend_traits<gs::Threads>::split);
static_assert(gs::backend_traits<gs::Threads>::native_collectives);
static_assert(gs::backend_traits<gs::Threads>::native_rank_ordered);
static_assert(!gs::backend_traits<gs::Threads>::knows_hosts);
static_assert(gs::backend_traits<gs::Threads>::host_memory);
static_assert(!HasLocalRank<gs::Communicator<gs::Threads>>, "local_rank() exists only where the backend knows hosts");
static_assert(!HasEndpoint<gs::Communicator<gs::Threads>>, "the public Communicator hands out no endpoint");
static_assert(std::is_same_v<decltype(std::declval<gs::Communicator<gs::Threads>&>().split(0, 0)),
                             std::optional<gs::Communicator<gs::Threads>>>);
#ifdef GRADSYNC_TEST_MPI
static_assert(gs::backend_traits<gs::Mpi>::split);
static_assert(gs::backend_traits<gs::Mpi>::native_collectives);
static_assert(!gs::backend_traits<gs::Mpi>::native_rank_ordered);
static_assert(gs::backend_traits<gs::Mpi>::knows_hosts);
static_assert(gs::backend_traits<gs::Mpi>::host_memory);
static_assert(HasLocalRank<gs::Communicator<gs::Mpi>>);
static_assert(!HasEndpoint<gs::Communicator<gs::Mpi>>);
#endif

namespace {

bool contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

/// A way to split n ranks: rank r's (color, key).
struct Pattern {
  const char* name;
  std::function<std::pair<int, int>(int r, int n)> color_key;
};

std::vector<Pattern> patterns() {
  return {
      {"parity", [](int r, int) { return std::pair{r % 2, 0}; }},
      {"parity, keys reversed", [](int r, int) { return std::pair{r % 2, -r}; }},
      {"singletons", [](int r, int) { return std::pair{r, 0}; }},
      {"one group, keys reversed", [](int r, int n) { return std::pair{7, n - r}; }},
      {"last rank in none", [](int r, int n) { return std::pair{r == n - 1 ? gs::no_color : r % 2, 0}; }},
      {"colors out of order, equal keys", [](int r, int n) { return std::pair{(n - r) % 3 * 5, 3}; }},
      {"shuffled keys with ties", [](int r, int) { return std::pair{r < 2 ? 1 : 0, r * 7 % 3}; }},
  };
}

/// The parent ranks of rank r's group, in their new order (empty: none).
std::vector<int> expected_group(const Pattern& p, int r, int n) {
  const auto [color, key] = p.color_key(r, n);
  std::vector<std::pair<int, int>> members;
  if (color == gs::no_color) return {};
  for (int q = 0; q < n; ++q) {
    const auto [c, k] = p.color_key(q, n);
    if (c == color) members.emplace_back(k, q);
  }
  std::sort(members.begin(), members.end());
  std::vector<int> out;
  for (const auto& m : members) out.push_back(m.second);
  return out;
}

/// Parent rank q's contribution: small multiples of 1/4, so every sum is
/// exact in double whatever the order.
std::vector<double> values(int q, std::size_t count) {
  std::vector<double> v(count);
  for (std::size_t i = 0; i < count; ++i) v[i] = 0.25 * static_cast<double>((q + 1) * static_cast<int>(i % 13 + 1));
  return v;
}

template <class Algo>
std::string check_all_reduce(Comm& comm, int parent_rank, const std::vector<int>& group, std::size_t count,
                             const char* what) {
  std::vector<double> data = values(parent_rank, count);
  gs::AllReduce<Algo>{}(comm, std::span<double>(data));
  std::vector<double> want(count, 0.0);
  for (int q : group) {
    const std::vector<double> v = values(q, count);
    for (std::size_t i = 0; i < count; ++i) want[i] += v[i];
  }
  for (std::size_t i = 0; i < count; ++i) {
    if (data[i] != want[i]) {
      return std::string(what) + ": AllReduce<" + std::string(Algo::name) + "> element " + std::to_string(i) +
             " is " + std::to_string(data[i]) + ", want " + std::to_string(want[i]);
    }
  }
  return {};
}

/// Rank r's part of one pattern: split, check the group, run collectives on
/// it and on the parent, split the child again. Returns what went wrong.
std::string run_pattern(Comm& comm, const Pattern& p) {
  const int r = comm.rank();
  const int n = comm.size();
  const auto [color, key] = p.color_key(r, n);
  const std::vector<int> group = expected_group(p, r, n);
  std::optional<Comm> child = comm.split(color, key);
  std::string problem;
  const std::vector<int> everyone = [&] {
    std::vector<int> all(static_cast<std::size_t>(n));
    for (int q = 0; q < n; ++q) all[static_cast<std::size_t>(q)] = q;
    return all;
  }();
  if (group.empty()) {
    if (child) return "got a communicator for no_color";
  } else if (!child) {
    return "got no communicator for color " + std::to_string(color);
  } else {
    const auto me = std::find(group.begin(), group.end(), r) - group.begin();
    if (child->size() != static_cast<int>(group.size()) || child->rank() != me) {
      return "rank " + std::to_string(child->rank()) + " of " + std::to_string(child->size()) + ", want " +
             std::to_string(me) + " of " + std::to_string(group.size());
    }
    if (child->sequence() != 1 && child->sequence() != 0) return "a new communicator starts with calls made";
    if (child->timeout() != comm.timeout()) return "the timeout is not inherited";
    // The new order, as the group itself reports it.
    std::vector<double> mine{static_cast<double>(r)};
    std::vector<double> order(group.size());
    gs::AllGather<gs::Ring>{}(*child, std::span<const double>(mine), std::span<double>(order));
    for (std::size_t i = 0; i < group.size(); ++i)
      if (order[i] != group[i]) return "AllGather order: position " + std::to_string(i) + " holds rank " +
                                       std::to_string(order[i]) + ", want " + std::to_string(group[i]);
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{1000}}) {
      for (const std::string& s : {check_all_reduce<gs::Ring>(*child, r, group, count, "child"),
                                   check_all_reduce<gs::Tree>(*child, r, group, count, "child"),
                                   check_all_reduce<gs::RecursiveHalvingDoubling>(*child, r, group, count, "child"),
                                   check_all_reduce<gs::Native>(*child, r, group, count, "child"),
                                   check_all_reduce<gs::Auto>(*child, r, group, count, "child")}) {
        if (!s.empty()) return s;
      }
    }
    child->barrier();
  }
  // The parent still works, between and after the children's calls.
  problem = check_all_reduce<gs::Ring>(comm, r, everyone, 100, "parent");
  if (!problem.empty()) return problem;
  if (child) {
    // A child splits too; its halves by new rank.
    std::optional<Comm> grandchild = child->split(child->rank() % 2, 0);
    if (!grandchild) return "the nested split gave no communicator";
    std::vector<int> half;
    for (std::size_t i = 0; i < group.size(); ++i)
      if (static_cast<int>(i) % 2 == child->rank() % 2) half.push_back(group[i]);
    problem = check_all_reduce<gs::Tree>(*grandchild, r, half, 77, "grandchild");
    if (!problem.empty()) return problem;
  }
  return check_all_reduce<gs::Native>(comm, r, everyone, 10, "parent after");
}

}  // namespace

TEST_CASE("split groups ranks by color, ordered by key then rank; children and parent both work") {
  for (int n = 1; n <= 5; ++n) {
    for (const Pattern& p : patterns()) {
      if (!test::world_has(n)) continue;
      CAPTURE(n);
      CAPTURE(p.name);
      std::vector<std::string> problems(static_cast<std::size_t>(n));
      test::run_world(n, [&](Comm& comm) {
        std::string& mine = problems[static_cast<std::size_t>(comm.rank())];
        try {
          mine = run_pattern(comm, p);
        } catch (const std::exception& e) {
          mine = std::string("threw: ") + e.what();
        }
      });
      for (std::size_t r : test::local_ranks(n)) CHECK_MESSAGE(problems[r].empty(), "rank " << r << ": " << problems[r]);
    }
  }
}

TEST_CASE("a color below zero other than no_color throws InvalidArgument before anything is sent") {
  for (int n : {1, 3, 4}) {
    if (!test::world_has(n)) continue;
    std::vector<std::string> problems(static_cast<std::size_t>(n));
    test::run_world(n, [&](Comm& comm) {
      std::string& mine = problems[static_cast<std::size_t>(comm.rank())];
      try {
        (void)comm.split(-5, 0);
        mine = "split(-5) did not throw";
      } catch (const gs::InvalidArgument& e) {
        if (!contains(e.what(), "-5") || !contains(e.what(), "no_color")) mine = std::string("message: ") + e.what();
      }
      if (comm.sequence() != 0 || comm.failed()) mine += "; the refused split counted as a call";
      std::vector<double> x(8, 1.0);
      gs::AllReduce<gs::Ring>{}(comm, std::span<double>(x));
      if (x[0] != n) mine += "; the communicator does not work after";
    });
    for (std::size_t r : test::local_ranks(n)) CHECK_MESSAGE(problems[r].empty(), "rank " << r << ": " << problems[r]);
  }
}

/// How each rank's body of a failure test ended, and when.
struct Outcomes {
  /// The body's own result, the expected exception's message, or "threw: "
  /// and any other exception's.
  std::vector<std::string> text;
  std::vector<double> seconds;
};

/// Runs `body(comm)` (returning a string) on n ranks with a 30 s deadline and
/// records how each ended; Expected is the exception the test waits for.
template <class Expected, class Body>
Outcomes outcomes(int n, Body body) {
  Outcomes o{std::vector<std::string>(static_cast<std::size_t>(n)), std::vector<double>(static_cast<std::size_t>(n))};
  test::run_world(n, [&](Comm& comm) {
    comm.set_timeout(std::chrono::seconds(30));
    const auto r = static_cast<std::size_t>(comm.rank());
    const auto t0 = Clock::now();
    try {
      o.text[r] = body(comm);
    } catch (const Expected& e) {
      o.text[r] = e.what();
    } catch (const std::exception& e) {
      o.text[r] = std::string("threw: ") + e.what();
    }
    o.seconds[r] = std::chrono::duration<double>(Clock::now() - t0).count();
  });
  return o;
}

TEST_CASE("a rank that calls something else instead of split: every rank names both calls") {
  for (int n : {3, 4}) {
    if (!test::world_has(n)) continue;
    CAPTURE(n);
    const Outcomes o = outcomes<gs::InvalidArgument>(n, [](Comm& comm) {
      if (comm.rank() == 1) {
        std::vector<float> x(4, 1.0f);
        gs::AllReduce<gs::Ring>{}(comm, std::span<float>(x));
      } else {
        (void)comm.split(0, 0);
      }
      return std::string("no error");
    });
    for (std::size_t r : test::local_ranks(n)) {
      CAPTURE(r);
      CHECK_MESSAGE(contains(o.text[r], "Split #1"), o.text[r]);
      CHECK_MESSAGE(contains(o.text[r], "AllReduce #1"), o.text[r]);
      CHECK_MESSAGE(!contains(o.text[r], "threw: "), o.text[r]);
    }
  }
}

TEST_CASE("a rank that skips split is named by the others, at once") {
  for (int n : {3, 4}) {
    if (!test::world_has(n)) continue;
    CAPTURE(n);
    const Outcomes o = outcomes<gs::Aborted>(n, [n](Comm& comm) {
      // The last rank leaves: its communicator is destroyed as it returns.
      if (comm.rank() == n - 1) return std::string("left");
      (void)comm.split(comm.rank() % 2, 0);
      return std::string("no error");
    });
    for (std::size_t r : test::local_ranks(n)) {
      if (static_cast<int>(r) == n - 1) continue;
      CAPTURE(r);
      CHECK_MESSAGE(contains(o.text[r], "rank " + std::to_string(n - 1)), o.text[r]);
      CHECK_MESSAGE(contains(o.text[r], "Split"), o.text[r]);
      CHECK_MESSAGE(!contains(o.text[r], "threw: "), o.text[r]);
      CHECK_MESSAGE(o.seconds[r] < 10.0, "took " << o.seconds[r] << " s");
    }
  }
}

TEST_CASE("a member that throws makes its sub-communicator's peers fail fast; the other group goes on") {
  for (int n : {3, 4}) {
    if (!test::world_has(n)) continue;
    CAPTURE(n);
    const Outcomes o = outcomes<gs::Aborted>(n, [](Comm& comm) {
      const int r = comm.rank();
      std::optional<Comm> half = comm.split(r % 2, 0);
      std::vector<double> x(1000, 1.0);
      gs::AllReduce<gs::Ring>{}(*half, std::span<double>(x));
      // Rank 2 fails between two calls of its group {0, 2}.
      if (r == 2) throw std::runtime_error("rank 2's own failure");
      gs::AllReduce<gs::Tree>{}(*half, std::span<double>(x));
      return std::string(x[0] == half->size() * half->size() ? "ok" : "wrong sum");
    });
    for (std::size_t r : test::local_ranks(n)) {
      CAPTURE(r);
      if (r == 2) {
        CHECK(o.text[r] == "threw: rank 2's own failure");
      } else if (r % 2 == 0) {
        CHECK_MESSAGE(contains(o.text[r], "rank 1"), o.text[r]);  // rank 2 is rank 1 of the group
        CHECK_MESSAGE(o.seconds[r] < 10.0, "took " << o.seconds[r] << " s");
      } else {
        CHECK(o.text[r] == "ok");
      }
    }
  }
}

#ifdef GRADSYNC_TEST_MPI
TEST_CASE("Mpi: a child keeps its parent's options; without call checks split is barrier then MPI_Comm_split") {
  const int n = test::mpi_size();
  const int r = test::mpi_rank();
  gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD, gs::MpiOptions{.check_calls = false});
  comm.set_timeout(std::chrono::seconds(60));
  std::optional<gs::Communicator<gs::Mpi>> half = comm.split(r % 2, -r);
  REQUIRE(half);
  CHECK(half->timeout() == comm.timeout());
  CHECK(gs::detail::endpoint_of(*half).failure_policy == gs::MpiFailurePolicy::throw_error);
  // Every rank of this job shares one host, so the child's local rank is its rank.
  CHECK(half->local_rank() == half->rank());
  const int members = (n - r % 2 + 1) / 2;
  CHECK(half->size() == members);
  CHECK(half->rank() == members - 1 - r / 2);
  std::vector<double> x(333, 1.5);
  gs::AllReduce<gs::Native>{}(*half, std::span<double>(x));
  CHECK(x[332] == 1.5 * members);
}
#else
TEST_CASE("run_threads rethrows a member's own failure, not its sub-communicator peers' Aborted") {
  // The member's sub-communicator is destroyed while its exception unwinds,
  // before run_threads hears of it: the peers' Aborted must not win.
  for (int trial = 0; trial < 20; ++trial) {
    try {
      gs::run_threads(4, [](Comm& comm) {
        std::optional<Comm> half = comm.split(comm.rank() % 2, 0);
        std::vector<double> x(64, 1.0);
        if (comm.rank() == 2) throw std::runtime_error("rank 2's own failure");
        gs::AllReduce<gs::Ring>{}(*half, std::span<double>(x));
        comm.barrier();
      });
      FAIL("run_threads did not throw");
    } catch (const std::runtime_error& e) {
      CHECK(std::string(e.what()) == "rank 2's own failure");
    } catch (const std::exception& e) {
      FAIL("trial " << trial << ": run_threads rethrew " << e.what());
    }
  }
}

TEST_CASE("a sub-communicator may outlive its parent") {
  std::vector<std::string> problems(3);
  gs::run_threads(3, [&](Comm& comm) {
    std::optional<Comm> all = comm.split(0, -comm.rank());
    std::optional<Comm> mirrored;
    {
      // A parent made here, gone before its child is used.
      std::optional<Comm> parent = all->split(0, 0);
      mirrored.emplace(std::move(*parent->split(0, -parent->rank())));
    }
    std::vector<double> x{1.0 + comm.rank()};
    gs::AllReduce<gs::Native>{}(*mirrored, std::span<double>(x));
    if (x[0] != 6.0) problems[static_cast<std::size_t>(comm.rank())] = "sum " + std::to_string(x[0]);
  });
  for (const auto& p : problems) CHECK(p.empty());
}

namespace {

/// A random split of 4 to 6 ranks into groups of at least two members, and
/// the world rank whose fault a test injects.
struct Layout {
  int n = 0;
  std::vector<int> color, key;
  int faulty = 0;

  int color_of(int r) const { return color[static_cast<std::size_t>(r)]; }
  /// World rank r's rank within its group: ordered by key, then world rank.
  int group_rank(int r) const {
    int i = 0;
    for (int q = 0; q < n; ++q) {
      const auto qq = static_cast<std::size_t>(q), rr = static_cast<std::size_t>(r);
      if (color[qq] == color[rr] && (key[qq] < key[rr] || (key[qq] == key[rr] && q < r))) ++i;
    }
    return i;
  }
  /// Whether world rank r shares the faulty rank's group.
  bool with_faulty(int r) const { return color_of(r) == color_of(faulty); }
  /// How errors on a sub-communicator name world rank q: its group named
  /// `group`, or by default after its color.
  std::string name(int q, const std::string& group = "") const {
    return "world rank " + std::to_string(q) + " (rank " + std::to_string(group_rank(q)) + " of " +
           (group.empty() ? "group of color " + std::to_string(color_of(q)) : group) + ")";
  }
  std::string describe() const {
    std::string s = "n = " + std::to_string(n) + ", faulty world rank " + std::to_string(faulty) + ", (color, key):";
    for (int r = 0; r < n; ++r) s += " (" + std::to_string(color_of(r)) + ", " + std::to_string(key[r]) + ")";
    return s;
  }
};

Layout random_layout(std::mt19937_64& g) {
  Layout l;
  l.n = 4 + static_cast<int>(g() % 3);
  const int groups = 1 + static_cast<int>(g() % static_cast<std::uint64_t>(l.n / 2));
  std::vector<int> colors;
  while (static_cast<int>(colors.size()) < groups) {
    const int c = static_cast<int>(g() % 50);
    if (std::find(colors.begin(), colors.end(), c) == colors.end()) colors.push_back(c);
  }
  std::vector<int> order(static_cast<std::size_t>(l.n));
  for (int r = 0; r < l.n; ++r) order[static_cast<std::size_t>(r)] = r;
  std::shuffle(order.begin(), order.end(), g);
  l.color.assign(static_cast<std::size_t>(l.n), 0);
  l.key.assign(static_cast<std::size_t>(l.n), 0);
  // Two members for each group first, then the rest anywhere.
  for (int i = 0; i < l.n; ++i) {
    const int c = i < 2 * groups ? i / 2 : static_cast<int>(g() % static_cast<std::uint64_t>(groups));
    l.color[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])] = colors[static_cast<std::size_t>(c)];
  }
  for (int& k : l.key) k = static_cast<int>(g() % 5) - 2;
  l.faulty = static_cast<int>(g() % static_cast<std::uint64_t>(l.n));
  return l;
}

/// How one world rank's part of a fault test ended.
struct Ending {
  std::string kind = "none";
  std::string what;
};

/// Runs `body(world_rank, child, ending)` on every rank of `l`, with `child`
/// split from the world by l's colors and keys inside the try, so that an
/// exception leaving the body destroys it while it unwinds. What the body
/// throws is recorded by class; the body may record an ending of its own.
template <class Body>
std::vector<Ending> run_layout(const Layout& l, Body body) {
  std::vector<Ending> endings(static_cast<std::size_t>(l.n));
  gs::run_threads(l.n, gs::ThreadsOptions{.timeout = std::chrono::seconds(30)}, [&](Comm& comm) {
    const int r = comm.rank();
    Ending& e = endings[static_cast<std::size_t>(r)];
    try {
      std::optional<Comm> child = comm.split(l.color_of(r), l.key[static_cast<std::size_t>(r)]);
      body(r, child, e);
    } catch (const std::exception& x) {
      e = {test::error_kind(x), x.what()};
    }
  });
  return endings;
}

bool starts_with(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }

/// One AllReduce on `comm`, by the algorithm `pick` chooses.
void all_reduce_any(Comm& comm, std::span<float> x, std::uint64_t pick, gs::Options o = {}) {
  switch (pick % 4) {
    case 0: gs::AllReduce<gs::Ring>{o}(comm, x); break;
    case 1: gs::AllReduce<gs::Tree>{o}(comm, x); break;
    case 2: gs::AllReduce<gs::RecursiveHalvingDoubling>{o}(comm, x); break;
    default: gs::AllReduce<gs::Native>{o}(comm, x); break;
  }
}

/// A correct AllReduce on a group the fault is not in: "ok" if it summed.
void all_reduce_ok(Comm& comm, Ending& e, std::uint64_t pick) {
  std::vector<float> x(4, 1.0f);
  all_reduce_any(comm, std::span<float>(x), pick);
  e.what = x[0] == static_cast<float>(comm.size()) ? "ok" : "wrong sum";
}

/// Runs check(r, ending) for each rank of the faulty rank's group (but the
/// faulty rank itself when `but_faulty`), with the rank and its ending in
/// the message of every check that fails.
template <class Check>
void for_faulty_group(const Layout& l, const std::vector<Ending>& e, bool but_faulty, Check check) {
  for (int r = 0; r < l.n; ++r) {
    if (!l.with_faulty(r) || (but_faulty && r == l.faulty)) continue;
    const Ending& m = e[static_cast<std::size_t>(r)];
    CAPTURE(r);
    INFO(m.kind << ": " << m.what);
    check(r, m);
  }
}

/// What the ranks of groups without the fault must have seen: nothing.
void check_other_groups(const Layout& l, const std::vector<Ending>& e) {
  for (int r = 0; r < l.n; ++r) {
    if (l.with_faulty(r)) continue;
    CAPTURE(r);
    CHECK_MESSAGE(e[static_cast<std::size_t>(r)].what == "ok", e[static_cast<std::size_t>(r)].what);
  }
}

/// Runs `body(l, algo, g)` `trials` times, each on a layout and an
/// algorithm pick freshly drawn from the case's own generator `g` (named by
/// `salt`, so one case replays alone), with the seed, the trial and both
/// picks in the message of every check that fails.
template <class Body>
void for_trials(std::string_view salt, int trials, Body body) {
  std::mt19937_64 g = test::rng_for(salt);
  for (int trial = 0; trial < trials; ++trial) {
    const Layout l = random_layout(g);
    const std::uint64_t algo = g();
    CAPTURE(test::test_seed());
    CAPTURE(trial);
    CAPTURE(l.describe());
    CAPTURE(algo % 4);
    body(l, algo, g);
  }
}

}  // namespace

TEST_CASE("on a split communicator, a disagreement names both ranks by world rank, then by rank in the group") {
  for_trials("split names: disagreement", 12, [&](const Layout& l, std::uint64_t algo, std::mt19937_64& g) {
    const bool by_label = g() % 2 == 0;
    CAPTURE(by_label);
    const std::vector<Ending> e = run_layout(l, [&](int r, std::optional<Comm>& child, Ending& mine) {
      if (!l.with_faulty(r)) return all_reduce_ok(*child, mine, algo);
      // Only the faulty rank's call differs: in its count or in its label.
      std::vector<float> x(r == l.faulty && !by_label ? 5 : 4, 1.0f);
      gs::Options o;
      o.label.id = r == l.faulty && by_label ? 8 : 7;
      all_reduce_any(*child, std::span<float>(x), algo, o);
    });
    for_faulty_group(l, e, false, [&](int, const Ending& m) {
      CHECK(m.kind == "InvalidArgument");
      // Whichever rank saw it first, its words reach every rank: each names
      // the faulty rank and a rank whose call differs from its, both in full.
      CHECK(starts_with(m.what, "gradsync: ranks disagree on a collective: world rank "));
      CHECK(contains(m.what, l.name(l.faulty) + " called AllReduce #1"));
      CHECK(contains(m.what, "), world rank "));
      CHECK(!contains(m.what, ": rank "));
    });
    check_other_groups(l, e);
  });
}

TEST_CASE("on a split communicator, a timeout names the waiting rank and the rank that never came by world rank") {
  for_trials("split names: timeout", 4, [&](const Layout& l, std::uint64_t algo, std::mt19937_64&) {
    std::atomic<int> given_up{0};
    int waiting = 0;
    for (int r = 0; r < l.n; ++r) waiting += l.with_faulty(r) && r != l.faulty ? 1 : 0;
    const std::vector<Ending> e = run_layout(l, [&](int r, std::optional<Comm>& child, Ending& mine) {
      if (!l.with_faulty(r)) return all_reduce_ok(*child, mine, algo);
      child->set_timeout(std::chrono::milliseconds(300));
      if (r == l.faulty) {
        // Never comes to the call, and stays until its peers have given up:
        // leaving earlier would be named as leaving.
        const auto until = Clock::now() + std::chrono::seconds(20);
        while (given_up.load() < waiting && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        return;
      }
      try {
        std::vector<float> x(4, 1.0f);
        all_reduce_any(*child, std::span<float>(x), algo);
      } catch (...) {
        ++given_up;
        throw;
      }
      ++given_up;
    });
    for_faulty_group(l, e, true, [&](int r, const Ending& m) {
      // Its own deadline, or a peer's that passed first.
      CHECK((m.kind == "Timeout" || m.kind == "Aborted"));
      CHECK(starts_with(m.what, "gradsync: " + l.name(r) + (m.kind == "Timeout" ? " timed out" : " abandoned")));
      CHECK(contains(m.what, "timed out after 0.3"));
      CHECK(contains(m.what, l.name(l.faulty) + " has not started it (it has made no call)"));
    });
    check_other_groups(l, e);
  });
}

TEST_CASE("on a split communicator, a member whose exception destroys it is named by world rank, as a failure") {
  for_trials("split names: throw", 12, [&](const Layout& l, std::uint64_t algo, std::mt19937_64&) {
    const std::vector<Ending> e = run_layout(l, [&](int r, std::optional<Comm>& child, Ending& mine) {
      if (!l.with_faulty(r)) return all_reduce_ok(*child, mine, algo);
      std::vector<float> x(4, 1.0f);
      all_reduce_any(*child, std::span<float>(x), algo);
      if (r == l.faulty) throw std::runtime_error("the faulty rank's own failure");
      all_reduce_any(*child, std::span<float>(x), algo);
    });
    for_faulty_group(l, e, false, [&](int r, const Ending& m) {
      if (r == l.faulty) {
        CHECK(m.what == "the faulty rank's own failure");
        return;
      }
      CHECK(m.kind == "Aborted");
      CHECK(starts_with(m.what, "gradsync: " + l.name(r) + " abandoned AllReduce #2"));
      CHECK(contains(m.what, "because " + l.name(l.faulty) +
                                 " will never join it: an exception on that rank destroyed its communicator after 1 call"));
      CHECK(!contains(m.what, " left"));
    });
    check_other_groups(l, e);
  });
}

TEST_CASE("on a split communicator, a member that destroys it is named by world rank, as leaving") {
  for_trials("split names: leave", 12, [&](const Layout& l, std::uint64_t algo, std::mt19937_64& g) {
    const int calls = 1 + static_cast<int>(g() % 3);
    CAPTURE(calls);
    const std::vector<Ending> e = run_layout(l, [&](int r, std::optional<Comm>& child, Ending& mine) {
      if (!l.with_faulty(r)) return all_reduce_ok(*child, mine, algo);
      std::vector<float> x(4, 1.0f);
      for (int c = 0; c < calls; ++c) all_reduce_any(*child, std::span<float>(x), algo);
      if (r == l.faulty) {
        child.reset();
        return;
      }
      all_reduce_any(*child, std::span<float>(x), algo);
    });
    const std::string after = std::to_string(calls) + (calls == 1 ? " call" : " calls");
    for_faulty_group(l, e, true, [&](int r, const Ending& m) {
      CHECK(m.kind == "Aborted");
      CHECK(starts_with(m.what, "gradsync: " + l.name(r) + " abandoned AllReduce #" + std::to_string(calls + 1)));
      CHECK(contains(m.what, "because " + l.name(l.faulty) + " left after " + after +
                                 " (its communicator was destroyed), so it will never join it"));
    });
    check_other_groups(l, e);
  });
}

TEST_CASE("on a split communicator, bad arguments are named by world rank, before anything is sent") {
  for_trials("split names: bad arguments", 12, [&](const Layout& l, std::uint64_t algo, std::mt19937_64& g) {
    const int which = static_cast<int>(g() % 5);
    CAPTURE(which);
    const std::vector<Ending> e = run_layout(l, [&](int r, std::optional<Comm>& child, Ending& mine) {
      if (r == l.faulty) {
        const int p = child->size();
        std::vector<float> a(4, 1.0f), b(3, 1.0f), c(4 * static_cast<std::size_t>(p) + 1, 1.0f);
        try {
          switch (which) {
            case 0: gs::AllReduce<gs::Ring>{}(*child, std::span<const float>(a), std::span<float>(b)); break;
            case 1: gs::Broadcast<gs::Tree>{}(*child, std::span<float>(a), p); break;
            case 2: gs::AllGather<gs::Native>{}(*child, std::span<const float>(a), std::span<float>(c)); break;
            case 3: gs::ReduceScatter<gs::Ring>{}(*child, std::span<const float>(c), std::span<float>(a)); break;
            default: (void)child->split(-3, 0); break;
          }
          mine = {"none", "no error"};
        } catch (const gs::InvalidArgument& x) {
          mine = {"InvalidArgument", x.what()};
        }
        if (child->sequence() != 0 || child->failed()) mine.what += "; the refused call counted as a call";
      }
      // The group still works: nothing was sent.
      std::vector<float> x(4, 1.0f);
      all_reduce_any(*child, std::span<float>(x), algo);
      if (x[0] != static_cast<float>(child->size())) mine.what += "; wrong sum after";
      if (r != l.faulty) mine.what = "ok";
    });
    const Ending& m = e[static_cast<std::size_t>(l.faulty)];
    INFO(m.kind << ": " << m.what);
    CHECK(m.kind == "InvalidArgument");
    const char* collective[] = {"AllReduce", "Broadcast", "AllGather", "ReduceScatter"};
    if (which < 4) {
      CHECK(starts_with(m.what, "gradsync: " + std::string(collective[which]) + " on " + l.name(l.faulty) + ": "));
    } else {
      CHECK(starts_with(m.what, "gradsync: " + l.name(l.faulty) + ": split expects a color >= 0"));
    }
    for (int r = 0; r < l.n; ++r) {
      if (r == l.faulty) continue;
      CAPTURE(r);
      CHECK(e[static_cast<std::size_t>(r)].what == "ok");
    }
  });
}

TEST_CASE("on a split communicator that failed, a later call is refused naming the rank by world rank") {
  for_trials("split names: refused", 8, [&](const Layout& l, std::uint64_t algo, std::mt19937_64&) {
    const std::vector<Ending> e = run_layout(l, [&](int r, std::optional<Comm>& child, Ending& mine) {
      if (!l.with_faulty(r)) return all_reduce_ok(*child, mine, algo);
      std::vector<float> x(r == l.faulty ? 5 : 4, 1.0f);
      try {
        all_reduce_any(*child, std::span<float>(x), algo);
      } catch (const gs::InvalidArgument&) {
      }
      x.resize(4);
      all_reduce_any(*child, std::span<float>(x), algo);
    });
    for_faulty_group(l, e, false, [&](int r, const Ending& m) {
      CHECK(m.kind == "Aborted");
      CHECK(starts_with(m.what, "gradsync: " + l.name(r) + ": AllReduce #2 ("));
      CHECK(contains(m.what, "refused: this communicator failed earlier"));
      CHECK(contains(m.what, "(AllReduce #1 ("));
    });
    check_other_groups(l, e);
  });
}

TEST_CASE("a group named at split, and a group split from it, are named so; world ranks stay the root's") {
  for_trials("split names: named and nested", 8, [&](const Layout& l, std::uint64_t algo, std::mt19937_64&) {
    std::vector<Ending> e(static_cast<std::size_t>(l.n));
    gs::run_threads(l.n, gs::ThreadsOptions{.timeout = std::chrono::seconds(30)}, [&](Comm& comm) {
      const int r = comm.rank();
      Ending& mine = e[static_cast<std::size_t>(r)];
      const std::string group = "shard group " + std::to_string(l.color_of(r));
      std::optional<Comm> shard = comm.split(l.color_of(r), l.key[static_cast<std::size_t>(r)], group);
      // One group of the shard group's members in reverse order, unnamed:
      // named after its color within the shard group's name.
      std::optional<Comm> reversed = shard->split(3, -shard->rank());
      if (!l.with_faulty(r)) return all_reduce_ok(*reversed, mine, algo);
      std::vector<float> x(r == l.faulty ? 5 : 4, 1.0f);
      try {
        all_reduce_any(*reversed, std::span<float>(x), algo);
      } catch (const gs::InvalidArgument& ex) {
        mine = {"InvalidArgument", ex.what()};
      }
    });
    // Rank i of a shard group of m members is rank m - 1 - i of its reversal.
    int m = 0;
    for (int q = 0; q < l.n; ++q) m += l.with_faulty(q) ? 1 : 0;
    const std::string shard = "shard group " + std::to_string(l.color_of(l.faulty));
    const std::string faulty = "world rank " + std::to_string(l.faulty) + " (rank " +
                               std::to_string(m - 1 - l.group_rank(l.faulty)) + " of group of color 3 in " + shard + ")";
    for_faulty_group(l, e, false, [&](int, const Ending& o) {
      CHECK(o.kind == "InvalidArgument");
      CHECK(contains(o.what, faulty + " called AllReduce #1"));
    });
    check_other_groups(l, e);
  });
}
#endif

}  // namespace test_split
