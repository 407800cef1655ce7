// flight_faults: ranks make a fixed list of collectives under a short
// deadline, and one rank misbehaves at one call; every failing rank writes
// its flight record (GRADSYNC_FLIGHT_DIR). flight_test.py then checks what
// tools/flight-analyze says of the records.
//
//   test_core --helper flight_faults FAULT RANK CALL DEADLINE_MS N   (Threads: N ranks as threads)
//   mpirun -np N test_mpi --helper flight_faults FAULT RANK CALL DEADLINE_MS
//
// (A helper of both binaries, support/helper_main.hpp; test_mpi compiles it
// with GRADSYNC_TEST_MPI.)
//
// FAULT, done by rank RANK at call number CALL (from 1):
//   skip       it leaves that call out: it waits past the deadline, then makes the next call
//   different  it calls another collective in its place
//   sleep      it sleeps past the deadline, then makes the call
//   kill       it dies by SIGKILL (Mpi only: on Threads it would take every rank along)
//   signal     it stays away from that call until every other rank's record is in
//              GRADSYNC_FLIGHT_DIR (written on the dump signal that flight_test.py
//              sends while they wait in it), then makes it
//
// Each rank prints "READY <rank>" once its communicator is made (a dump
// signal's handler is installed then) and "END <rank> <Class|ok>" as it
// stops; the signal fault's rank prints "AWAY <rank>" as it stays away.

#include <gradsync/collectives.hpp>
#ifdef GRADSYNC_TEST_MPI
#include <gradsync/backend/mpi.hpp>
#endif

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "../support/helper_main.hpp"

namespace flight_faults {

namespace gs = gradsync;

namespace {

constexpr int calls = 12;

struct Fault {
  std::string kind;
  int rank = 0;
  int call = 0;
  std::chrono::milliseconds deadline{0};
};

/// Call k of the list: a rotation of three collectives, so that a rank that
/// leaves one out or swaps one makes a call unlike its peers'.
template <class Comm>
void make_call(Comm& comm, int k, std::vector<float>& x, std::vector<float>& all) {
  switch (k % 3) {
    case 0: gs::AllReduce<gs::Ring>{}(comm, std::span<float>(x), gs::Sum{}); break;
    case 1: gs::AllGather<gs::Ring>{}(comm, std::span<const float>(x), std::span<float>(all)); break;
    default: gs::Broadcast<gs::Ring>{}(comm, std::span<float>(x), k % comm.size()); break;
  }
}

/// Until every rank but `me` of `n` has a record in GRADSYNC_FLIGHT_DIR, or 60 s.
void await_others_records(int me, int n) {
  const char* dir = std::getenv("GRADSYNC_FLIGHT_DIR");
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (int r = 0; r < n && dir != nullptr && std::chrono::steady_clock::now() < until;) {
    const auto file = std::filesystem::path(dir) / ("gradsync-flight-world-rank" + std::to_string(r) + ".json");
    if (r == me || std::filesystem::exists(file)) {
      ++r;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
}

template <class Comm>
void run_rank(Comm& comm, const Fault& f) {
  std::printf("READY %d\n", comm.rank());
  std::fflush(stdout);
  comm.set_timeout(f.deadline);
  std::vector<float> x(1000, 1.0f), all(x.size() * static_cast<std::size_t>(comm.size()));
  const char* end = "ok";
  try {
    for (int k = 1; k <= calls; ++k) {
      int what = k;
      if (comm.rank() == f.rank && k == f.call) {
        if (f.kind == "kill") {
          std::fflush(stdout);
          kill(getpid(), SIGKILL);
        }
        if (f.kind == "skip" || f.kind == "sleep") std::this_thread::sleep_for(2 * f.deadline);
        if (f.kind == "signal") {
          std::printf("AWAY %d\n", comm.rank());
          std::fflush(stdout);
          await_others_records(comm.rank(), comm.size());
        }
        if (f.kind == "skip" || f.kind == "different") what = k + 1;
      }
      make_call(comm, what, x, all);
    }
  } catch (const gs::Timeout&) {
    end = "Timeout";
  } catch (const gs::Aborted&) {
    end = "Aborted";
  } catch (const gs::InvalidArgument&) {
    end = "InvalidArgument";
  } catch (const gs::Error&) {
    end = "Error";
  }
  std::printf("END %d %s\n", comm.rank(), end);
  std::fflush(stdout);
}

}  // namespace

int helper_main(int argc, char** argv) {
#ifdef GRADSYNC_TEST_MPI
  const int args = 5;
#else
  const int args = 6;
#endif
  if (argc != args) {
    std::fprintf(stderr, "usage: flight_faults skip|different|sleep|kill|signal RANK CALL DEADLINE_MS%s\n",
                 args == 6 ? " N" : "");
    return 2;
  }
  const Fault f{argv[1], std::atoi(argv[2]), std::atoi(argv[3]), std::chrono::milliseconds(std::atoi(argv[4]))};
#ifdef GRADSYNC_TEST_MPI
  gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
  run_rank(comm, f);
  // A dead peer would keep MPI_Finalize waiting: leave without it.
  std::_Exit(0);
#else
  gs::run_threads(std::atoi(argv[5]), [&](gs::Communicator<gs::Threads>& comm) { run_rank(comm, f); });
  return 0;
#endif
}

GRADSYNC_TEST_HELPER("flight_faults", helper_main);

}  // namespace flight_faults
