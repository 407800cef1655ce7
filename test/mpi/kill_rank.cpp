// kill_rank: 3 ranks all-reduce in a loop under a short deadline, and rank 2
// kills itself (SIGKILL) mid-loop. Run by kill_rank.py under
// `mpirun --enable-recovery`, which checks what the survivors say and when.
//
//   mpirun --enable-recovery -np 3 test_mpi --helper kill_rank throw|abort DEADLINE_S [ring|native [FLOATS SEED]]
//
// (A helper of test_mpi: support/helper_main.hpp.)
//
// native: the loop's all-reduce is Native, MPI's own; under abort the ranks
// hand MPI their own buffer (no copy), which is safe only because a failed
// call ends the job instead of returning.
//
// FLOATS: large messages (Open MPI's rendezvous, whose sends a failed call
// keeps until no peer can read them). Each rank all-reduces FLOATS to
// 2 FLOATS floats, and rank 2 dies from a thread of its own a drawn time into
// the loop, so most likely inside a call it has joined, its sends and
// receives matched. SEED draws both.
//
// Lines it prints (wall-clock times, so the script can compare processes):
//   KILL <t>                          rank 2, just before it dies
//   SURVIVOR <rank> <t> <Class> <what> a survivor, once its call has failed

#include <gradsync/backend/mpi.hpp>
#include <gradsync/collectives.hpp>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "../support/helper_main.hpp"

namespace kill_rank {

namespace gs = gradsync;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

void die() {
  std::printf("KILL %.3f\n", now());
  std::fflush(stdout);
  kill(getpid(), SIGKILL);
}

void survived(int rank, const char* kind, const char* what) {
  std::printf("SURVIVOR %d %.3f %s %s\n", rank, now(), kind, what);
  std::fflush(stdout);
  // MPI_Finalize would wait for the dead rank: leave without it.
  std::_Exit(0);
}

}  // namespace

int helper_main(int argc, char** argv) {
  if (argc != 3 && argc != 4 && argc != 6) {
    std::fprintf(stderr,
                 "usage: mpirun --enable-recovery -np 3 kill_rank throw|abort DEADLINE_S [ring|native [FLOATS SEED]]\n");
    return 2;
  }
  const std::string policy = argv[1];
  const double deadline = std::atof(argv[2]);
  const bool native = argc >= 4 && std::string(argv[3]) == "native";
  const bool large = argc == 6;
  gs::MpiOptions options;
  options.failure_policy = policy == "abort" ? gs::MpiFailurePolicy::abort_job : gs::MpiFailurePolicy::throw_error;
  gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD, options);
  comm.set_timeout(std::chrono::duration<double>(deadline));
  std::size_t count = 256;
  if (large) {
    const std::size_t floats = std::strtoull(argv[4], nullptr, 0);
    std::mt19937_64 rng(std::strtoull(argv[5], nullptr, 0));
    count = floats + rng() % floats;
    // Past the first calls (the communicator's setup is over), within the
    // first few large ones.
    const auto after = std::chrono::milliseconds(20 + rng() % 200);
    if (comm.rank() == 0) {
      std::printf("LARGE %zu floats, rank 2 dies after %lld ms\n", count, static_cast<long long>(after.count()));
      std::fflush(stdout);
    }
    if (comm.rank() == 2) {
      std::thread([after] {
        std::this_thread::sleep_for(after);
        die();
      }).detach();
    }
  }
  std::vector<float> x(count, 1.0f);
  for (int i = 0;; ++i) {
    if (!large && i == 200 && comm.rank() == 2) die();
    try {
      if (native) {
        gs::AllReduce<gs::Native>{}(comm, std::span<float>(x), gs::Max{});
      } else {
        gs::AllReduce<gs::Ring>{}(comm, std::span<float>(x), gs::Max{});
      }
    } catch (const gs::Timeout& e) {
      survived(comm.rank(), "Timeout", e.what());
    } catch (const gs::Aborted& e) {
      survived(comm.rank(), "Aborted", e.what());
    } catch (const gs::Error& e) {
      survived(comm.rank(), "Error", e.what());
    }
  }
}

GRADSYNC_TEST_HELPER("kill_rank", helper_main);

}  // namespace kill_rank
