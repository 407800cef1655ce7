// A rank that waits inside a gradsync call on the Mpi backend keeps calling
// into MPI, so that its peers' requests that need this rank's MPI to run
// still complete: Open MPI moves messages only inside MPI calls. On one host
// the call agreement is read off shared memory, so a wait for it makes no MPI
// call unless it is made to, and then a large AllReduce followed by a Barrier
// can stall until the deadline.
#include <doctest/doctest.h>

#include <mpi.h>

#include <gradsync/backend/mpi.hpp>
#include <gradsync/collectives.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "../support/common.hpp"
#include "../support/temp_dir.hpp"
#include "../support/trace_events.hpp"
#include "../support/world.hpp"

// Everything in this file is in its own namespace: the Mpi suites compile it
// in one translation unit with other test files (test/mpi/meson.build).
namespace test_mpi_progress {

namespace gs = gradsync;
using namespace std::chrono_literals;

namespace {

/// How long the late rank waits for the others to match its sends: far
/// longer than a wait that calls into MPI needs, far shorter than the deadline.
constexpr auto patience = 3s;

/// Polls `reqs` until all are done or `limit` has passed; what is left then is
/// cancelled (receives) or let go (sends), so that no request outlives the case.
bool finish_within(std::vector<MPI_Request>& reqs, std::chrono::nanoseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  for (;;) {
    int done = 0;
    MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE);
    if (done) return true;
    if (std::chrono::steady_clock::now() > until) break;
    std::this_thread::yield();
  }
  for (MPI_Request& r : reqs) {
    if (r == MPI_REQUEST_NULL) continue;
    MPI_Cancel(&r);
    MPI_Request_free(&r);
  }
  return false;
}

/// The user's own traffic beside gradsync's: a duplicate of the world per case.
struct UserComm {
  MPI_Comm comm = MPI_COMM_NULL;
  UserComm() { MPI_Comm_dup(MPI_COMM_WORLD, &comm); }
  ~UserComm() { MPI_Comm_free(&comm); }
  UserComm(const UserComm&) = delete;
  UserComm& operator=(const UserComm&) = delete;
};

/// The last rank sends every other rank a synchronous message (MPI_Issend) on
/// the user's communicator, and calls `call` only once they have all matched
/// it, or after `patience`. The others post the receive, then call `call` at
/// once and wait there for the last rank. An MPI_Issend completes only once
/// its receiver's MPI has run and matched it, and only the receivers' wait
/// inside `call` can run it. Every rank checks its own side.
template <class Call>
void late_rank_sends_while_others_wait(const std::string& where, std::mt19937_64& rng, Call&& call) {
  const int rank = test::mpi_rank();
  const int n = test::mpi_size();
  const int last = n - 1;
  std::vector<int> payload(static_cast<std::size_t>(n));
  for (int& p : payload) p = static_cast<int>(rng() % 1000000);
  UserComm user;
  std::vector<MPI_Request> reqs;
  if (rank != last) {
    int got = -1;
    reqs.assign(1, MPI_REQUEST_NULL);
    MPI_Irecv(&got, 1, MPI_INT, last, 7, user.comm, &reqs[0]);
    call();
    const bool done = finish_within(reqs, patience);
    CHECK_MESSAGE(done, "rank ", rank, ": the late rank's message never arrived after ", where);
    if (done) CHECK(got == payload[static_cast<std::size_t>(rank)]);
    return;
  }
  // The others should be inside `call` before the messages land: one that
  // lands before their last MPI call on the way in is matched there.
  std::this_thread::sleep_for(100ms);
  reqs.assign(static_cast<std::size_t>(last), MPI_REQUEST_NULL);
  for (int q = 0; q < last; ++q) {
    MPI_Issend(&payload[static_cast<std::size_t>(q)], 1, MPI_INT, q, 7, user.comm, &reqs[static_cast<std::size_t>(q)]);
  }
  const auto t0 = std::chrono::steady_clock::now();
  const bool matched = finish_within(reqs, patience);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK_MESSAGE(matched, "rank ", rank, ": the ranks waiting in ", where, " did not match its MPI_Issend within ",
                waited, " s: their wait made no MPI call");
  call();
}

/// Element i of rank r's input: small integers, so that every sum is exact.
float input(std::uint64_t salt, int r, std::size_t i) {
  return static_cast<float>(static_cast<std::int64_t>((i * 2654435761u + salt * static_cast<std::uint64_t>(r + 1)) % 201) - 100);
}

std::size_t env_or(const char* name, std::size_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? static_cast<std::size_t>(std::strtoull(v, nullptr, 0)) : fallback;
}

template <class Algo>
void all_reduce_checked(gs::Communicator<gs::Mpi>& comm, std::size_t count, std::uint64_t salt, int calls,
                        bool barrier_after) {
  const int n = comm.size();
  std::vector<float> in(count), out(count, 0.0f);
  for (std::size_t i = 0; i < count; ++i) in[i] = input(salt, comm.rank(), i);
  for (int c = 0; c < calls; ++c) {
    gs::AllReduce<Algo>{}(comm, std::span<const float>(in), std::span<float>(out));
    if (barrier_after) comm.barrier();
  }
  std::size_t wrong = 0, first = count;
  for (std::size_t i = 0; i < count; ++i) {
    float want = 0.0f;
    for (int r = 0; r < n; ++r) want += input(salt, r, i);
    if (out[i] != want) {
      if (!wrong) first = i;
      ++wrong;
    }
  }
  CHECK_MESSAGE(wrong == 0, wrong, " of ", count, " elements wrong, the first at ", first);
}

}  // namespace

TEST_CASE("a rank waiting in Barrier keeps MPI moving for a peer's own MPI request") {
  const std::uint64_t seed = test::test_seed();
  CAPTURE(seed);
  auto rng = test::rng_for("barrier progress");
  gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
  comm.set_timeout(30s);
  // A call first, so that the barrier is not the communicator's first.
  std::vector<float> x(3, 1.0f);
  gs::AllReduce<gs::Ring>{}(comm, std::span<float>(x));
  late_rank_sends_while_others_wait("Barrier", rng, [&] { comm.barrier(); });
}

TEST_CASE_TEMPLATE("a rank waiting in an AllReduce for a late peer keeps MPI moving for the peer's own MPI request",
                   Algo, gs::Ring, gs::Tree, gs::RecursiveHalvingDoubling, gs::Native, gs::Auto) {
  const std::uint64_t seed = test::test_seed();
  CAPTURE(seed);
  auto rng = test::rng_for("all_reduce progress");
  gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
  comm.set_timeout(30s);
  // Not divisible by the world size, and now and then smaller than it.
  const std::size_t count = rng() % 8 == 0 ? rng() % 4 : 1 + rng() % 5000;
  const std::uint64_t salt = rng();
  CAPTURE(count);
  late_rank_sends_while_others_wait("AllReduce", rng,
                                    [&] { all_reduce_checked<Algo>(comm, count, salt, 1, false); });
}

// The sequence that stalled: a large AllReduce, then a Barrier, over and
// over. Which message sizes need the receiver's MPI after its receive is
// done depends on the transport: with mpirun's default transports here,
// np 2 stalled from 112 MiB (ring); the tests' own (btl self,vader,tcp)
// never did. GRADSYNC_TEST_PROGRESS_BYTES and _CALLS set the size and the
// number of rounds (meson registers both).
TEST_CASE_TEMPLATE("large AllReduce then Barrier, call after call, completes", Algo, gs::Ring, gs::Tree,
                   gs::RecursiveHalvingDoubling, gs::Native) {
  const std::uint64_t seed = test::test_seed();
  CAPTURE(seed);
  auto rng = test::rng_for("large then barrier");
  const std::size_t bytes = env_or("GRADSYNC_TEST_PROGRESS_BYTES", std::size_t{4} << 20);
  const int calls = static_cast<int>(env_or("GRADSYNC_TEST_PROGRESS_CALLS", 4));
  // A few elements off the round size, so that no world size divides it.
  const std::size_t count = bytes / sizeof(float) - rng() % 7;
  CAPTURE(count);
  gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
  // Far above a healthy call at this size here (0.3 s at 128 MiB): a stall
  // ends as a Timeout on some rank, which fails the case.
  comm.set_timeout(20s);
  all_reduce_checked<Algo>(comm, count, rng(), calls, true);
}

// The timeline's peer_wait_us on Mpi: the ranks that wait in a Ring
// all-reduce for a late peer report that wait, the late one does not, and
// no rank's wait exceeds the call; a Native call, all inside MPI, reports none.
TEST_CASE("mpi timeline: peer_wait_us is the wait for a late peer; Native does not tell it") {
  const int rank = test::mpi_rank();
  const int last = test::mpi_size() - 1;
  constexpr auto late_by = 300ms;
  const test::TempDir out;  // this process's own
  gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
  comm.set_timeout(30s);
  comm.trace_to(out.path.string());
  std::vector<float> v(4099, 1.0f);
  gs::AllReduce<gs::Ring>{}(comm, std::span<float>(v));  // every rank in step first
  if (rank == last) std::this_thread::sleep_for(late_by);
  gs::AllReduce<gs::Ring>{}(comm, std::span<float>(v));
  gs::AllReduce<gs::Native>{}(comm, std::span<float>(v));
  const test::TraceFile f = test::read_trace(comm.write_trace());
  std::vector<const test::TraceLine*> calls;
  for (const test::TraceLine& e : f.events) {
    if (e.name == "AllReduce") calls.push_back(&e);
  }
  REQUIRE(calls.size() == 3);
  const test::TraceLine& late = *calls[1];
  const std::string wait = test::trace_field(late.line, "peer_wait_us");
  REQUIRE(!wait.empty());
  const double waited = std::strtod(wait.c_str(), nullptr);
  const double moving = late.dur - std::strtod(test::trace_field(late.line, "agree_us").c_str(), nullptr);
  const double late_us = std::chrono::duration<double, std::micro>(late_by).count();
  CAPTURE(waited);
  CAPTURE(moving);
  CHECK(waited >= 0);
  CHECK(waited <= moving + 1);
  // The late rank found its peers' messages waiting; they waited for it
  // (in the agreement or in the ring's receives: the two together).
  if (rank == last) {
    CHECK(waited < late_us / 2);
  } else {
    CHECK(waited + std::strtod(test::trace_field(late.line, "agree_us").c_str(), nullptr) >= late_us / 2);
  }
  CHECK(test::trace_field(calls[2]->line, "peer_wait_us").empty());
  CHECK(test::trace_field(calls[2]->line, "algorithm") == "native");
}

}  // namespace test_mpi_progress
