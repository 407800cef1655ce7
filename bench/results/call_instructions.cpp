// call_instructions: a fixed number of small all-reduces, for counting
// instructions per call under callgrind (the VM has no hardware counters).
// It uses only public spellings that 315de20 and today share, so the same
// file builds against either tree:
//   g++ -std=c++20 -O2 -g -I TREE/include call_instructions.cpp -o cc -pthread
//   mpicxx -std=c++20 -O2 -g -DCALL_COST_MPI -I TREE/include call_instructions.cpp -o cc_mpi
// Usage: cc ALGO FLOATS CALLS [RANKS [REPEATS]]   (ALGO: auto ring tree rhd native)
// Stats are zeroed when rank 0 starts its first loop and dumped when it ends
// (CALLGRIND_* client requests; plain runs ignore them): under MPI that is
// rank 0's process, on Threads every rank thread of the process meanwhile.
// call_instructions.sh builds it and reads the counts.
// Each of REPEATS loops of CALLS calls prints rank 0's time per call (us).
// CALL_COST_PIN=1 pins Threads rank r to core r (MPI: use --bind-to core).
#include <valgrind/callgrind.h>

#include <pthread.h>
#include <sched.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#ifdef CALL_COST_MPI
#include <mpi.h>

#include <gradsync/backend/mpi.hpp>
#endif
#include <gradsync/gradsync.hpp>

namespace {

int repeats = 1;

template <class Algo, class Comm>
void calls(Comm& comm, std::size_t floats, int n) {
  std::vector<float> buf(floats, 0.0f);
  std::span<float> s(buf);
  // Warm: scratch pools, Auto's memo, MPI's connections.
  for (int i = 0; i < 50; ++i) gradsync::AllReduce<Algo>{}(comm, s, gradsync::Sum{});
  for (int r = 0; r < repeats; ++r) {
    comm.barrier();
    if (r == 0 && comm.rank() == 0) CALLGRIND_ZERO_STATS;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) gradsync::AllReduce<Algo>{}(comm, s, gradsync::Sum{});
    const auto t1 = std::chrono::steady_clock::now();
    if (r == 0 && comm.rank() == 0) CALLGRIND_DUMP_STATS_AT("timed");
    if (comm.rank() == 0) std::printf("%.4f\n", std::chrono::duration<double, std::micro>(t1 - t0).count() / n);
  }
  comm.barrier();
}

template <class Comm>
void by_name(const std::string& algo, Comm& comm, std::size_t floats, int n) {
  if (algo == "auto") return calls<gradsync::Auto>(comm, floats, n);
  if (algo == "ring") return calls<gradsync::Ring>(comm, floats, n);
  if (algo == "tree") return calls<gradsync::Tree>(comm, floats, n);
  if (algo == "rhd") return calls<gradsync::RecursiveHalvingDoubling>(comm, floats, n);
  if (algo == "native") return calls<gradsync::Native>(comm, floats, n);
  std::fprintf(stderr, "unknown algorithm %s\n", algo.c_str());
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s ALGO FLOATS CALLS [RANKS]\n", argv[0]);
    return 2;
  }
  const std::string algo = argv[1];
  const auto floats = static_cast<std::size_t>(std::atol(argv[2]));
  const int n = std::atoi(argv[3]);
  if (argc > 5) repeats = std::atoi(argv[5]);
#ifdef CALL_COST_MPI
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  {
    gradsync::Communicator<gradsync::Mpi> comm(MPI_COMM_WORLD);
    by_name(algo, comm, floats, n);
  }
  MPI_Finalize();
#else
  const int ranks = argc > 4 ? std::atoi(argv[4]) : 2;
  const char* pin = std::getenv("CALL_COST_PIN");
  gradsync::run_threads(ranks, [&](gradsync::Communicator<gradsync::Threads>& comm) {
    if (pin && pin[0] == '1') {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(comm.rank(), &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    }
    by_name(algo, comm, floats, n);
  });
#endif
  return 0;
}
