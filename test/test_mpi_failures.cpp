// Deadlines and faults on the Mpi backend, run under mpirun with 2..4 ranks.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <gradsync/backend/mpi.hpp>
#include <gradsync/gradsync.hpp>

#include <chrono>
#include <span>
#include <string>
#include <thread>
#include <vector>

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
  MPI_Barrier(MPI_COMM_WORLD);
  return what;
}

}  // namespace

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
  }
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
  MPI_Comm_compare(comm.endpoint().mpi_comm(), MPI_COMM_WORLD, &result);
  CHECK(result == MPI_CONGRUENT);
  CHECK(comm.local_rank() >= 0);
  CHECK(comm.local_rank() < comm.endpoint().local_size());
}

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int rc = 0;
  if (size < 2) {
    std::printf("SKIP: the fault tests need at least 2 ranks\n");
    rc = 77;
  } else {
    doctest::Context ctx(argc, argv);
    rc = ctx.run();
  }
  // Any failing rank fails the run.
  int worst = rc;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
