// Deadlines and faults on the Mpi backend, run under mpirun with 2..4 ranks;
// at 4, on sub-communicators too, whose errors name world ranks.
#include <doctest/doctest.h>

#include <gradsync/backend/mpi.hpp>
#include <gradsync/core/endpoint_of.hpp>
#include <gradsync/collectives.hpp>

#include "support/common.hpp"
#include "support/world.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <random>
#include <regex>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace mpi_failures {

namespace gs = gradsync;
using namespace std::chrono_literals;

namespace {

/// A fresh communicator per case: a failed one stays failed.
std::string skipped_collective_message(auto algo) {
  gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
  comm.set_timeout(300ms);
  std::vector<float> x(1000, 1.0f);
  gs::AllReduce<decltype(algo)>{}(comm, std::span<float>(x));  // #1 succeeds everywhere
  std::string what;
  if (comm.rank() == 1) {
    // Rank 1 skips #2 and sits out the others' deadline.
    std::this_thread::sleep_for(600ms);
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      gs::AllReduce<decltype(algo)>{}(comm, std::span<float>(x));
    } catch (const gs::Timeout& e) {
      what = e.what();
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK_MESSAGE(waited < 0.3 + 0.25, "rank ", comm.rank(), " took ", waited, " s to time out");
  }
  test::idle_barrier();
  return what;
}

/// What one rank's call ended with: the exception's class and text, and how long it took.
struct Outcome {
  std::string kind = "none";
  std::string what;
  double seconds = 0;
};

template <class F>
Outcome outcome(F&& f) {
  Outcome o;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    f();
  } catch (const gs::Error& e) {
    o = {test::error_kind(e), e.what()};
  }
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return o;
}


/// Every rank raised InvalidArgument quickly, naming its own call and another that differs.
void check_disagreement(const Outcome& o, const std::string& mine, const std::string& other) {
  INFO("rank ", test::mpi_rank(), ": ", o.kind, ": ", o.what);
  CHECK(o.kind == "InvalidArgument");
  CHECK(o.what.find("gradsync: ranks disagree on a collective: rank " + std::to_string(test::mpi_rank()) + " called " +
                    mine) != std::string::npos);
  CHECK(o.what.find(other) != std::string::npos);
  // Far below the deadline: the verdict, not a timeout, ended it.
  CHECK(o.seconds < 2.0);
}

/// check_disagreement, with `mine` and `other` regular expressions.
void check_disagreement_pattern(const Outcome& o, const std::string& mine, const std::string& other) {
  INFO("rank ", test::mpi_rank(), ": ", o.kind, ": ", o.what);
  CHECK(o.kind == "InvalidArgument");
  CHECK(std::regex_search(o.what, std::regex("gradsync: ranks disagree on a collective: rank " +
                                             std::to_string(test::mpi_rank()) + " called " + mine)));
  CHECK(std::regex_search(o.what, std::regex(other)));
  CHECK(o.seconds < 2.0);
}

}  // namespace

TEST_CASE_TEMPLATE("a rank that skips a call whose count differs makes every rank throw InvalidArgument naming both",
                   Algo, gs::Ring, gs::Tree, gs::RecursiveHalvingDoubling, gs::Native, gs::Auto) {
  gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
  comm.set_timeout(10s);
  // The program calls AllReduce on 1000 floats, then on 7; rank 1 skips the first.
  std::vector<float> big(1000, 1.0f), small(7, 1.0f);
  const Outcome o = outcome([&] {
    if (comm.rank() != 1) gs::AllReduce<Algo>{}(comm, std::span<float>(big));
    gs::AllReduce<Algo>{}(comm, std::span<float>(small));
  });
  // Auto's pick and RHD's path are part of the algorithm's name
  // ("auto:tree", "rhd-short"), and depend on the count.
  const std::string algo = std::string(Algo::name) + "[-:a-z]*";
  const std::string call = "AllReduce #1 \\(" + algo;
  const std::string mine = call + (comm.rank() == 1 ? ", 7 x" : ", 1000 x");
  const std::string other = comm.rank() == 1 ? "called " + call + ", 1000 x" : "rank 1 called " + call + ", 7 x";
  check_disagreement_pattern(o, mine, other);
  // Nothing returned a wrong sum: no rank came back normally.
  test::idle_barrier();
}

TEST_CASE_TEMPLATE("ranks that pass different roots to Broadcast all throw InvalidArgument", Algo, gs::Ring, gs::Tree,
                   gs::RecursiveHalvingDoubling, gs::Native) {
  gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
  comm.set_timeout(10s);
  std::vector<float> x(100, static_cast<float>(comm.rank()));
  const int root = comm.rank() == 1 ? 1 : 0;
  const Outcome o = outcome([&] { gs::Broadcast<Algo>{}(comm, std::span<float>(x), root); });
  const std::string algo(Algo::name);
  const std::string mine = "Broadcast #1 (" + algo + ", 100 x float, root " + std::to_string(root) + ")";
  const std::string other = comm.rank() == 1 ? "root 0)" : "rank 1 called Broadcast #1 (" + algo + ", 100 x float, root 1)";
  check_disagreement(o, mine, other);
  test::idle_barrier();
}

TEST_CASE_TEMPLATE("AllReduce on one rank and AllGather on another throw InvalidArgument everywhere", Algo, gs::Ring,
                   gs::Native) {
  gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
  comm.set_timeout(10s);
  std::vector<float> x(64, 1.0f), all(64 * static_cast<std::size_t>(comm.size()));
  const Outcome o = outcome([&] {
    if (comm.rank() == 1) {
      gs::AllGather<Algo>{}(comm, std::span<const float>(x), std::span<float>(all));
    } else {
      gs::AllReduce<Algo>{}(comm, std::span<float>(x));
    }
  });
  const std::string mine = comm.rank() == 1 ? "AllGather #1" : "AllReduce #1";
  const std::string other = comm.rank() == 1 ? "called AllReduce #1" : "rank 1 called AllGather #1";
  check_disagreement(o, mine, other);
  test::idle_barrier();
}

// The agreement goes through shared memory on one host, otherwise by
// recursive doubling, with a fold for world sizes that are not powers of two
// (run this file at -np 3 and 5 as well as 2 and 4). Both ways, here.
TEST_CASE("at any world size, the ranks agree call after call, and any one rank that differs is named everywhere") {
  for (const bool by_messages : {false, true}) {
    // Read at construction, on every rank alike.
    if (by_messages) setenv("GRADSYNC_MPI_AGREEMENT", "messages", 1);
    INFO("GRADSYNC_MPI_AGREEMENT=", by_messages ? "messages" : "(unset)");
    {
      gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
      comm.set_timeout(10s);
      const auto p = static_cast<float>(comm.size());
      for (std::size_t n = 1; n <= 40; ++n) {
        std::vector<float> x(n, static_cast<float>(comm.rank() + 1));
        gs::AllReduce<gs::Auto>{}(comm, std::span<float>(x));
        CHECK(x[n - 1] == p * (p + 1) / 2);
        comm.barrier();
      }
    }
    for (int odd = 0; odd < test::mpi_size(); ++odd) {
      gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
      comm.set_timeout(10s);
      std::vector<float> x(comm.rank() == odd ? 5 : 4, 1.0f);
      gs::AllReduce<gs::Ring>{}(comm, std::span<float>(x.data(), 3));  // #1 agrees
      const Outcome o = outcome([&] { gs::AllReduce<gs::Ring>{}(comm, std::span<float>(x)); });
      const std::string odd_call = "rank " + std::to_string(odd) + " called AllReduce #2 (ring, 5 x";
      check_disagreement(o, comm.rank() == odd ? "AllReduce #2 (ring, 5 x" : "AllReduce #2 (ring, 4 x",
                         comm.rank() == odd ? "called AllReduce #2 (ring, 4 x" : odd_call);
      test::idle_barrier();
    }
    unsetenv("GRADSYNC_MPI_AGREEMENT");
  }
}

TEST_CASE_TEMPLATE("with check_calls off, labelled calls are still checked: labels that differ fail every rank",
                   Algo, gs::Ring, gs::Tree, gs::RecursiveHalvingDoubling, gs::Native, gs::Auto) {
  // The trainers label every call: their step, unit and learning rate are
  // what tells ranks that would train different models apart.
  for (const bool by_messages : {false, true}) {
    if (by_messages) setenv("GRADSYNC_MPI_AGREEMENT", "messages", 1);
    INFO("GRADSYNC_MPI_AGREEMENT=", by_messages ? "messages" : "(unset)");
    for (int odd = 0; odd < test::mpi_size(); ++odd) {
      gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD, gs::MpiOptions{.check_calls = false});
      comm.set_timeout(10s);
      std::vector<float> x(100, 1.0f);
      gs::AllReduce<Algo>{}(comm, std::span<float>(x));  // unlabelled, unchecked
      gs::AllReduce<Algo>{{.label = {.id = 7}}}(comm, std::span<float>(x));  // labelled alike
      const gs::Options mine{.label = {.id = comm.rank() == odd ? 9u : 8u}};
      const Outcome o = outcome([&] { gs::AllReduce<Algo>{mine}(comm, std::span<float>(x)); });
      INFO("rank ", comm.rank(), ", odd rank ", odd, ": ", o.kind, ": ", o.what);
      CHECK(o.kind == "InvalidArgument");
      CHECK(o.what.find("gradsync: ranks disagree on a collective: rank " + std::to_string(comm.rank())) == 0);
      CHECK(o.what.find(comm.rank() == odd ? "label 0x0000000000000008" : "label 0x0000000000000009") !=
            std::string::npos);
      CHECK(o.seconds < 2.0);
      test::idle_barrier();
    }
    unsetenv("GRADSYNC_MPI_AGREEMENT");
  }
}

TEST_CASE("MpiOptions that differ between ranks throw InvalidArgument on every rank at construction") {
  for (const bool on_check : {true, false}) {
    for (int odd = 0; odd < test::mpi_size(); ++odd) {
      gs::MpiOptions o;
      if (test::mpi_rank() == odd && on_check) o.check_calls = false;
      if (test::mpi_rank() == odd && !on_check) o.failure_policy = gs::MpiFailurePolicy::abort_job;
      const Outcome got = outcome([&] { gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD, o); });
      INFO("rank ", test::mpi_rank(), ", odd rank ", odd, ": ", got.kind, ": ", got.what);
      CHECK(got.kind == "InvalidArgument");
      CHECK(got.what.find("the ranks were given different MpiOptions (this rank: check_calls") != std::string::npos);
      test::idle_barrier();
    }
  }
}

TEST_CASE("ranks that disagree only on the chunk size or on determinism throw InvalidArgument") {
  for (const bool on_chunks : {true, false}) {
    gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
    comm.set_timeout(10s);
    std::vector<float> x(1000, 1.0f);
    gs::Options opt;
    if (comm.rank() == 1 && on_chunks) opt.chunk_bytes = 1024;
    if (comm.rank() == 1 && !on_chunks) opt.deterministic = true;
    const Outcome o = outcome([&] { gs::AllReduce<gs::Ring>{opt}(comm, std::span<float>(x)); });
    check_disagreement(o, "AllReduce #1 (ring, 1000 x float, sum", on_chunks ? "chunks of 1024 B" : "deterministic");
    test::idle_barrier();
  }
}

TEST_CASE("after a Timeout the communicator refuses every later call at once") {
  gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
  comm.set_timeout(300ms);
  std::vector<float> x(10, 1.0f);
  // Rank 1 sits the call out: the others time out.
  if (comm.rank() != 1) {
    const Outcome first = outcome([&] { gs::AllReduce<gs::Ring>{}(comm, std::span<float>(x)); });
    INFO("rank ", comm.rank(), ": ", first.what);
    CHECK(first.kind == "Timeout");
    CHECK(comm.failed());
    const Outcome again = outcome([&] { gs::AllReduce<gs::Ring>{}(comm, std::span<float>(x)); });
    INFO(again.what);
    CHECK(again.kind == "Aborted");
    CHECK(again.what.find("AllReduce #1 (ring") != std::string::npos);
    // Local work only; the limit is below the 300 ms timeout, so a wait would
    // show, and far above what a descheduled rank on a busy machine loses.
    CHECK(again.seconds < 0.2);
  }
  test::idle_barrier();
}

TEST_CASE("a rank that fails makes the others fail fast, naming it") {
  gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
  // Only rank 1's deadline is short; the others would wait 20 s on their own.
  comm.set_timeout(comm.rank() == 1 ? std::chrono::nanoseconds(200ms) : std::chrono::nanoseconds(20s));
  std::vector<float> x(1000, 1.0f);
  gs::AllReduce<gs::Ring>{}(comm, std::span<float>(x));
  // Rank 0 comes to #2 a second late: rank 1 times out first.
  if (comm.rank() == 0) std::this_thread::sleep_for(1s);
  const Outcome o = outcome([&] { gs::AllReduce<gs::Ring>{}(comm, std::span<float>(x)); });
  INFO("rank ", comm.rank(), ": ", o.kind, ": ", o.what);
  if (comm.rank() == 1) {
    CHECK(o.kind == "Timeout");
  } else {
    CHECK((o.kind == "Timeout" || o.kind == "Aborted"));
    // Rank 1's own words, not "rank 1 failed: rank 1 timed out".
    CHECK(o.what.find("because rank 1 timed out") != std::string::npos);
    CHECK(o.what.find("AllReduce #2") != std::string::npos);
    CHECK(o.seconds < 2.0);
  }
  test::idle_barrier();
}

TEST_CASE("a rank that leaves makes the others fail fast, naming it") {
  std::optional<gs::Communicator<gs::Mpi>> comm(std::in_place, MPI_COMM_WORLD);
  comm->set_timeout(20s);
  std::vector<float> x(1000, 1.0f);
  gs::AllReduce<gs::Ring>{}(*comm, std::span<float>(x));
  const int rank = comm->rank();
  if (rank == 1) {
    comm.reset();
  } else {
    const Outcome o = outcome([&] { gs::AllReduce<gs::Ring>{}(*comm, std::span<float>(x)); });
    INFO("rank ", rank, ": ", o.kind, ": ", o.what);
    CHECK(o.kind == "Aborted");
    CHECK(o.what.find("rank 1 left after 1 call (its communicator was destroyed)") != std::string::npos);
    CHECK(o.seconds < 2.0);
  }
  test::idle_barrier();
}

TEST_CASE("MpiOptions are taken at construction, and unchecked calls still work") {
  gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD, gs::MpiOptions{.check_calls = false});
  CHECK(gs::detail::endpoint_of(comm).failure_policy == gs::MpiFailurePolicy::throw_error);
  std::vector<float> x(10, 1.0f);
  gs::AllReduce<gs::Native>{}(comm, std::span<float>(x));
  gs::AllReduce<gs::Ring>{}(comm, std::span<float>(x));
  comm.barrier();
  CHECK(x[0] == static_cast<float>(comm.size() * comm.size()));
  gs::Communicator<gs::Mpi> checked(MPI_COMM_WORLD, gs::MpiOptions{.failure_policy = gs::MpiFailurePolicy::throw_error});
  checked.barrier();
  gs::AllReduce<gs::Tree>{}(checked, std::span<float>(x));
  CHECK(x[0] == static_cast<float>(comm.size() * comm.size() * comm.size()));
}

/// Every Native collective on `staged` (throw_error: MPI works on the
/// endpoint's buffer) and on `direct` (abort_job: on the caller's), with the
/// same inputs: small integers, so every result is exact whatever MPI's
/// order. Each rank draws every rank's input from the job's seed.
template <class T, class Op>
void native_on_both(gs::Communicator<gs::Mpi>& staged, gs::Communicator<gs::Mpi>& direct, std::uint64_t seed,
                    std::size_t count, bool deterministic) {
  const int n = staged.size(), rank = staged.rank();
  CAPTURE(seed);
  CAPTURE(count);
  CAPTURE(deterministic);
  INFO("element type of ", sizeof(T), " bytes, op ", Op::name, ", rank ", rank, " of ", n);
  std::mt19937_64 g(seed ^ (count * 0x9E3779B97F4A7C15ull));
  std::uniform_int_distribution<int> value(-1000, 1000);
  const std::size_t total = count * static_cast<std::size_t>(n);
  // all[r]: rank r's input of `total` elements (AllReduce uses the first `count`).
  std::vector<std::vector<T>> all(static_cast<std::size_t>(n), std::vector<T>(total));
  for (auto& v : all)
    for (T& x : v) x = static_cast<T>(value(g));
  const std::vector<T>& mine = all[static_cast<std::size_t>(rank)];
  const int root = static_cast<int>(g() % static_cast<std::uint64_t>(n));
  auto reduced = [&](std::size_t i) {
    T acc = all[0][i];
    for (int r = 1; r < n; ++r) acc = Op::apply(acc, all[static_cast<std::size_t>(r)][i]);
    if constexpr (gs::detail::HasFinish<Op>) acc = Op::finish(acc, n);
    return acc;
  };
  const gs::Options opt{.deterministic = deterministic};
  for (gs::Communicator<gs::Mpi>* comm : {&staged, &direct}) {
    const char* which = comm == &staged ? "throw_error (staged)" : "abort_job (caller's buffers)";
    INFO(which);
    std::vector<T> out(count), inplace(mine.begin(), mine.begin() + static_cast<std::ptrdiff_t>(count));
    gs::AllReduce<gs::Native>{opt}(*comm, std::span<const T>(mine.data(), count), std::span<T>(out), Op{});
    gs::AllReduce<gs::Native>{opt}(*comm, std::span<T>(inplace), Op{});
    for (std::size_t i = 0; i < count; ++i) {
      REQUIRE(out[i] == reduced(i));
      REQUIRE(inplace[i] == reduced(i));
    }
    std::vector<T> block(count);
    gs::ReduceScatter<gs::Native>{opt}(*comm, std::span<const T>(mine), std::span<T>(block), Op{});
    for (std::size_t i = 0; i < count; ++i) REQUIRE(block[i] == reduced(static_cast<std::size_t>(rank) * count + i));
    std::vector<T> gathered(total), own(total);
    gs::AllGather<gs::Native>{}(*comm, std::span<const T>(mine.data(), count), std::span<T>(gathered));
    std::copy_n(mine.begin(), count, own.begin() + static_cast<std::ptrdiff_t>(rank * count));
    gs::AllGather<gs::Native>{}(*comm, std::span<const T>(own.data() + rank * count, count), std::span<T>(own));
    for (std::size_t i = 0; i < total; ++i) {
      REQUIRE(gathered[i] == all[i / count][i % count]);
      REQUIRE(own[i] == all[i / count][i % count]);
    }
    std::vector<T> bcast(rank == root ? mine : std::vector<T>(total, T(-1)));
    gs::Broadcast<gs::Native>{}(*comm, std::span<T>(bcast), root);
    for (std::size_t i = 0; i < total; ++i) REQUIRE(bcast[i] == all[static_cast<std::size_t>(root)][i]);
  }
}

TEST_CASE("under abort_job, Native runs on the caller's buffers and returns what it returns under throw_error") {
  // A failed call under abort_job ends the job before it returns, so MPI may
  // work on the caller's buffers; the results must not change.
  gs::Communicator<gs::Mpi> staged(MPI_COMM_WORLD);
  gs::Communicator<gs::Mpi> direct(MPI_COMM_WORLD,
                                   gs::MpiOptions{.failure_policy = gs::MpiFailurePolicy::abort_job});
  std::uint64_t seed = test::test_seed();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  std::mt19937_64 g(seed);
  for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1} + g() % 5000}) {
    for (bool deterministic : {false, true}) {
      native_on_both<float, gs::Sum>(staged, direct, seed, count, deterministic);
      native_on_both<std::int32_t, gs::Avg>(staged, direct, seed + 1, count, deterministic);
      native_on_both<double, gs::Max>(staged, direct, seed + 2, count, deterministic);
    }
  }
}

TEST_CASE_TEMPLATE("a rank that skips a collective makes the others time out, naming it", Algo, gs::Ring, gs::Tree,
                   gs::RecursiveHalvingDoubling, gs::Native) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::string what = skipped_collective_message(Algo{});
  INFO("rank ", rank, ": ", what);
  if (rank != 1) {
    CHECK(what.find("timed out") != std::string::npos);
    CHECK(what.find("AllReduce #2") != std::string::npos);
    CHECK(what.find("rank " + std::to_string(rank)) != std::string::npos);
    // Native waits for the agreement before MPI starts; on one host the
    // shared slots tell which rank never came.
    if constexpr (std::is_same_v<Algo, gs::Native>) CHECK(what.find("(rank 1 has not called it)") != std::string::npos);
  }
}

/// Lets MPI advance whatever it still holds (abandoned requests included)
/// for a while, on every rank.
void let_mpi_progress() {
  for (int i = 0; i < 20; ++i) {
    test::idle_barrier();
    std::this_thread::sleep_for(5ms);
  }
}

TEST_CASE("a Native call abandoned at its deadline never writes into the caller's buffer afterwards") {
  gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
  std::vector<float> x(std::size_t{1} << 24, 1.0f);
  std::vector<float> warm(1, 1.0f);
  gs::AllReduce<gs::Native>{}(comm, std::span<float>(warm));
  // 64 MiB: rank 0 gives up while MPI's all-reduce is running (after the
  // agreement, given 3 ms), and the others follow on its notice.
  if (comm.rank() == 0) comm.set_timeout(3ms);
  test::idle_barrier();
  const Outcome o = outcome([&] { gs::AllReduce<gs::Native>{}(comm, std::span<float>(x)); });
  INFO("rank ", comm.rank(), ": ", o.kind, ": ", o.what);
  if (o.kind == "none") {
    CHECK(x[0] == static_cast<float>(comm.size()));
  } else {
    CHECK(o.what.find("AllReduce #2") != std::string::npos);
    // The caller owns its buffer again: MPI finishing the abandoned
    // collective must not show up in it.
    std::fill(x.begin(), x.end(), -7.0f);
  }
  let_mpi_progress();
  if (o.kind != "none") CHECK(std::count(x.begin(), x.end(), -7.0f) == static_cast<std::ptrdiff_t>(x.size()));
}

TEST_CASE("a deterministic Native AllReduce that fails is named as the AllReduce, not its inner AllGather") {
  gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
  comm.set_timeout(1ms);
  std::vector<float> x(std::size_t{1} << 22, 1.0f);
  const Outcome o =
      outcome([&] { gs::AllReduce<gs::Native>{gs::Options{.deterministic = true}}(comm, std::span<float>(x)); });
  INFO("rank ", comm.rank(), ": ", o.kind, ": ", o.what);
  if (o.kind != "none") {
    CHECK(o.what.find("AllReduce #1") != std::string::npos);
    CHECK(o.what.find("AllGather") == std::string::npos);
  }
  let_mpi_progress();
}

TEST_CASE("a rank that comes to a call its peers already gave up on refuses it at once, posting nothing") {
  gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
  comm.set_timeout(300ms);
  // Large enough that the peers' sends wait for the late rank's receives.
  std::vector<float> x(std::size_t{1} << 20, 1.0f);
  if (comm.rank() == 1) std::this_thread::sleep_for(700ms);
  const Outcome o = outcome([&] { gs::AllReduce<gs::Ring>{}(comm, std::span<float>(x)); });
  INFO("rank ", comm.rank(), ": ", o.kind, ": ", o.what);
  if (comm.rank() == 1) {
    CHECK((o.kind == "Timeout" || o.kind == "Aborted"));
    CHECK(o.what.find("abandoned AllReduce #1") != std::string::npos);
    // Below the 300 ms timeout, so waiting for it would show.
    CHECK(o.seconds < 0.2);
  } else {
    CHECK(o.kind == "Timeout");
  }
  // The peers' buffers go away while their sends are still posted.
  x = std::vector<float>();
  let_mpi_progress();
}

TEST_CASE_TEMPLATE("a rank that sends more than the others expect writes nothing past their buffers", Algo, gs::Ring,
                   gs::Tree, gs::RecursiveHalvingDoubling) {
  gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
  comm.set_timeout(2s);
  // Large enough to go by MPI's single-copy path; a canary follows the data.
  const std::size_t n = 50000;
  const std::size_t mine = comm.rank() == 1 ? n + 4096 : n;
  std::vector<double> x(n + 4096 + 4096, 1.0);
  std::fill(x.begin() + static_cast<std::ptrdiff_t>(mine), x.end(), -3.0);
  const Outcome o = outcome([&] { gs::AllReduce<Algo>{}(comm, std::span<double>(x.data(), mine)); });
  INFO("rank ", comm.rank(), ": ", o.kind, ": ", o.what);
  CHECK(o.kind == "InvalidArgument");
  let_mpi_progress();
  CHECK(std::count(x.begin() + static_cast<std::ptrdiff_t>(mine), x.end(), -3.0) ==
        static_cast<std::ptrdiff_t>(x.size() - mine));
}

TEST_CASE("bad arguments throw before any communication") {
  gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
  std::vector<float> a(10), b(11);
  CHECK_THROWS_AS(gs::AllReduce<gs::Ring>{}(comm, std::span<const float>(a), std::span<float>(b)), gs::InvalidArgument);
  CHECK_THROWS_AS(gs::Broadcast<gs::Native>{}(comm, std::span<float>(a), comm.size()), gs::InvalidArgument);
}

TEST_CASE("the communicator is a duplicate and knows the node-local rank") {
  gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
  int result = MPI_UNEQUAL;
  MPI_Comm_compare(gs::detail::endpoint_of(comm).mpi_comm(), MPI_COMM_WORLD, &result);
  CHECK(result == MPI_CONGRUENT);
  CHECK(comm.local_rank() >= 0);
  CHECK(comm.local_rank() < gs::detail::endpoint_of(comm).local_size());
}

namespace {

/// The job's seed, the same on every rank.
std::uint64_t job_seed() {
  std::uint64_t seed = test::test_seed();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  return seed;
}

/// Four ranks in two groups by parity, each ordered by the keys `key`:
/// how errors on world rank q's group name it.
std::string parity_name(int q, const std::vector<int>& key, const std::string& group) {
  int i = 0;
  for (int p = q % 2; p < 4; p += 2)
    if (key[static_cast<std::size_t>(p)] < key[static_cast<std::size_t>(q)] ||
        (key[static_cast<std::size_t>(p)] == key[static_cast<std::size_t>(q)] && p < q))
      ++i;
  return "world rank " + std::to_string(q) + " (rank " + std::to_string(i) + " of " + group + ")";
}

/// Runs `body(comm, faulty)` on four ranks (a job of another size skips it)
/// with one faulty world rank drawn from the job's seed, so every rank draws
/// the same; then the ranks leave together, waiting without spinning.
template <class Body>
void with_one_faulty_of_four(Body body) {
  if (test::mpi_size() != 4) return;
  std::mt19937_64 g(job_seed());
  const int faulty = static_cast<int>(g() % 4);
  CAPTURE(test::test_seed());
  CAPTURE(faulty);
  gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
  body(comm, faulty);
  test::idle_barrier();
}

/// Checks how world rank r's call ended on a split by parity: in the group
/// without the faulty rank it returned; in the faulty rank's group `check()`
/// says what it must have thrown.
template <class Check>
void check_by_parity(int r, int faulty, const Outcome& o, Check check) {
  INFO("rank ", r, ": ", o.kind, ": ", o.what);
  if (r % 2 != faulty % 2) {
    CHECK(o.kind == "none");
  } else {
    check();
  }
}

}  // namespace

TEST_CASE("on a split communicator, ranks that disagree are named by world rank, then by rank in the group") {
  if (test::mpi_size() != 4) return;
  std::mt19937_64 g(job_seed());
  for (int trial = 0; trial < 4; ++trial) {
    std::vector<int> key(4);
    for (int& k : key) k = static_cast<int>(g() % 3);
    const int faulty = static_cast<int>(g() % 4);
    const bool named = g() % 2 == 0;
    const bool native = g() % 2 == 0;
    gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
    comm.set_timeout(10s);
    const int r = comm.rank();
    CAPTURE(test::test_seed());
    CAPTURE(trial);
    CAPTURE(faulty);
    CAPTURE(named);
    CAPTURE(native);
    auto group = [&](int q) { return (named ? "shard group " : "group of color ") + std::to_string(q % 2); };
    std::optional<gs::Communicator<gs::Mpi>> half =
        named ? comm.split(r % 2, key[static_cast<std::size_t>(r)], group(r)) : comm.split(r % 2, key[static_cast<std::size_t>(r)]);
    std::vector<float> x(r == faulty ? 5 : 4, 1.0f);
    const Outcome o = outcome([&] {
      if (native) {
        gs::AllReduce<gs::Native>{}(*half, std::span<float>(x));
      } else {
        gs::AllReduce<gs::Ring>{}(*half, std::span<float>(x));
      }
    });
    check_by_parity(r, faulty, o, [&] {
      CHECK(o.kind == "InvalidArgument");
      CHECK(o.what.find("gradsync: ranks disagree on a collective: " + parity_name(r, key, group(r)) +
                        " called AllReduce #1") == 0);
      // The other member of the group is the one whose call differs.
      const int other = r == faulty ? (r + 2) % 4 : faulty;
      CHECK(o.what.find(", " + parity_name(other, key, group(r)) + " called AllReduce #1") != std::string::npos);
      CHECK(o.what.find(r == faulty ? ", 4 x float" : ", 5 x float") != std::string::npos);
      CHECK(o.seconds < 2.0);
    });
    test::idle_barrier();
  }
}

TEST_CASE_TEMPLATE("on a split communicator, a timeout names the rank that never came by world rank", Algo, gs::Ring,
                   gs::Native) {
  with_one_faulty_of_four([](gs::Communicator<gs::Mpi>& comm, int faulty) {
    const int r = comm.rank();
    const std::vector<int> key{0, 0, 0, 0};
    const std::string group = "replica group " + std::to_string(r % 2);
    std::optional<gs::Communicator<gs::Mpi>> half = comm.split(r % 2, 0, group);
    half->set_timeout(300ms);
    std::vector<float> x(100, 1.0f);
    if (r == faulty) {
      // Never comes, and stays past its peer's deadline: leaving would be named as leaving.
      std::this_thread::sleep_for(700ms);
    } else {
      const Outcome o = outcome([&] { gs::AllReduce<Algo>{}(*half, std::span<float>(x)); });
      check_by_parity(r, faulty, o, [&] {
        CHECK(o.kind == "Timeout");
        CHECK(o.what.find("gradsync: " + parity_name(r, key, group) + " timed out after 0.3") == 0);
        CHECK(o.what.find("AllReduce #1") != std::string::npos);
        // Native waits for the agreement, whose shared slots tell who never came; Ring for its neighbour.
        const std::string missing = parity_name(faulty, key, group);
        CHECK(o.what.find(std::is_same_v<Algo, gs::Native> ? "(" + missing + " has not called it)"
                                                           : "waiting for " + missing + " to") != std::string::npos);
      });
    }
  });
}

TEST_CASE("on a split communicator, a member that destroys it is named by world rank, as leaving") {
  with_one_faulty_of_four([](gs::Communicator<gs::Mpi>& comm, int faulty) {
    comm.set_timeout(20s);
    const int r = comm.rank();
    const std::vector<int> key{0, 0, 0, 0};
    std::optional<gs::Communicator<gs::Mpi>> half = comm.split(r % 2, 0);
    std::vector<float> x(100, 1.0f);
    gs::AllReduce<gs::Ring>{}(*half, std::span<float>(x));
    if (r == faulty) {
      half.reset();
    } else {
      const Outcome o = outcome([&] { gs::AllReduce<gs::Ring>{}(*half, std::span<float>(x)); });
      check_by_parity(r, faulty, o, [&] {
        const std::string group = "group of color " + std::to_string(r % 2);
        CHECK(o.kind == "Aborted");
        CHECK(o.what.find("gradsync: " + parity_name(r, key, group) + " abandoned AllReduce #2") == 0);
        CHECK(o.what.find("because " + parity_name(faulty, key, group) +
                          " left after 1 call (its communicator was destroyed), so it will never join it") !=
              std::string::npos);
        CHECK(o.seconds < 2.0);
      });
    }
  });
}

TEST_CASE("ranks whose cost models pick different algorithms fail every rank at once, naming both") {
  // The test mpi_cost_models_differ gives rank 0 a latency-bound cost model
  // and the others a bandwidth-bound one (GRADSYNC_COST_MODEL, read by each
  // process): Auto picks apart, and so does RHD between its short and its
  // halving path. Elsewhere every rank has the same and every call returns.
  const bool differ = std::getenv("GRADSYNC_TEST_COST_MODELS_DIFFER") != nullptr;
  const std::string calls[] = {"AllReduce<Auto>", "Broadcast<Auto>", "AllReduce<RecursiveHalvingDoubling>"};
  for (int k = 0; k < 3; ++k) {
    INFO(calls[k] << " on 100 floats, cost models " << std::string(differ ? "differ" : "alike"));
    gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
    comm.set_timeout(10s);
    std::vector<float> x(100, static_cast<float>(comm.rank() + 1));
    const Outcome o = outcome([&] {
      if (k == 0) gs::AllReduce<gs::Auto>{}(comm, std::span<float>(x));
      if (k == 1) gs::Broadcast<gs::Auto>{}(comm, std::span<float>(x), 0);
      if (k == 2) gs::AllReduce<gs::RecursiveHalvingDoubling>{}(comm, std::span<float>(x));
    });
    INFO("rank " << comm.rank() << ": " << o.kind << ": " << o.what);
    if (differ) {
      CHECK(o.kind == "InvalidArgument");
      CHECK(o.what.find("gradsync: ranks disagree on a collective: rank " + std::to_string(comm.rank())) == 0);
      CHECK(o.seconds < 2.0);
    } else {
      const int n = comm.size();
      CHECK(o.kind == "none");
      CHECK(x[99] == (k == 1 ? 1.0f : static_cast<float>(n * (n + 1) / 2)));
    }
    test::idle_barrier();
  }
}

}  // namespace mpi_failures
