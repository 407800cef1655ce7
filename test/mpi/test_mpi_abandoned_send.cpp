// A rank whose call fails while a peer is held off (descheduled on a busy
// host, here stopped with SIGSTOP) must not return while that peer may still
// read what it sent: Open MPI moves a large message (vader's single-copy
// read, or TCP's rendezvous) only once the receiver's MPI runs, and reads the
// sender's buffer then. If the caller has freed or unmapped that buffer by
// then, the receiver's read fails and it asks the sender to push the data,
// which then copies from unmapped memory (a crash), or, where the memory was
// reused, the receiver gets someone else's data.
//
// Each trial: the faulty rank waits until the others are inside a large
// AllReduce (or not quite: the delay is drawn), stops its right neighbour,
// joins the call with a 1 ms deadline, and a thread of its own resumes the
// neighbour well after that call has failed. The faulty rank's buffer is its
// own mapping, unmapped as soon as the call throws, so a read of it after
// that fails loudly. Every rank must end its call with an error or the right
// sums; nothing may crash. Each trial prints its draws and the job's seed
// first; GRADSYNC_TEST_SEED=<seed> replays them.
#include <doctest/doctest.h>

#include <mpi.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <gradsync/backend/mpi.hpp>
#include <gradsync/collectives.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "../support/common.hpp"
#include "../support/idle_mpi.hpp"
#include "../support/world.hpp"

// Its own namespace: the Mpi suites compile this file in one translation
// unit with other test files (test/mpi/meson.build).
namespace test_mpi_abandoned_send {

namespace gs = gradsync;
using namespace std::chrono_literals;

namespace {

enum class Algo { ring, ring_deterministic, native_deterministic };

const char* name(Algo a) {
  constexpr const char* n[] = {"Ring", "Ring deterministic", "Native deterministic"};
  return n[static_cast<int>(a)];
}

float input(std::uint64_t salt, int r, std::size_t i) {
  return static_cast<float>(static_cast<std::int64_t>((i * 2654435761u + salt * static_cast<std::uint64_t>(r + 1)) % 201) - 100);
}

/// Floats in a mapping of their own, so that unmapping them is certain
/// (a freed vector may stay mapped in the heap).
class Mapped {
 public:
  explicit Mapped(std::size_t count) : count_(count) {
    void* p = mmap(nullptr, bytes(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(p != MAP_FAILED);
    data_ = static_cast<float*>(p);
  }
  Mapped(const Mapped&) = delete;
  Mapped& operator=(const Mapped&) = delete;
  ~Mapped() { unmap(); }
  void unmap() {
    if (data_) munmap(data_, bytes());
    data_ = nullptr;
  }
  std::span<float> span() const { return {data_, count_}; }

 private:
  std::size_t bytes() const { return count_ * sizeof(float); }
  float* data_ = nullptr;
  std::size_t count_;
};

void run(gs::Communicator<gs::Mpi>& comm, Algo algo, std::span<float> x) {
  switch (algo) {
    case Algo::ring: gs::AllReduce<gs::Ring>{}(comm, x); break;
    case Algo::ring_deterministic: gs::AllReduce<gs::Ring>{{.deterministic = true}}(comm, x); break;
    case Algo::native_deterministic: gs::AllReduce<gs::Native>{{.deterministic = true}}(comm, x); break;
  }
}

}  // namespace

TEST_CASE("a rank that abandons a large call never leaves a peer reading its freed buffer") {
  const std::uint64_t seed = test::test_seed();
  CAPTURE(seed);
  auto rng = test::rng_for("abandoned send");
  const int n = test::mpi_size();
  const int me = test::mpi_rank();
  if (n < 2) return;
  std::vector<int> pids(static_cast<std::size_t>(n));
  const int pid = static_cast<int>(getpid());
  MPI_Allgather(&pid, 1, MPI_INT, pids.data(), 1, MPI_INT, MPI_COMM_WORLD);
  for (int trial = 0; trial < 4; ++trial) {
    const int faulty = static_cast<int>(rng() % static_cast<std::uint64_t>(n));
    const int stopped = (faulty + 1) % n;
    const auto algo = static_cast<Algo>(rng() % 3);
    // 1 to 3 Mi floats: every message far above the eager limit.
    const std::size_t count = (std::size_t{1} << 20) * (1 + rng() % 3) + rng() % 1000;
    // Mostly long enough for the others to have posted their receives; now
    // and then so short that the neighbour stops on its way in.
    const auto delay = std::chrono::milliseconds(rng() % 4 == 0 ? rng() % 3 : 10 + rng() % 30);
    // Long enough that a call which let its sends go on a short timer would
    // have unmapped the buffer before the neighbour runs again.
    const auto stall = std::chrono::milliseconds(300 + rng() % 200);
    const bool by_messages = rng() % 2 == 0;
    const std::uint64_t salt = rng();
    const std::string line = "trial " + std::to_string(trial) + ": " + std::to_string(n) + " ranks, " + name(algo) +
                             ", " + std::to_string(count) + " floats, rank " + std::to_string(faulty) +
                             " fails and stops rank " + std::to_string(stopped) + " after " +
                             std::to_string(delay.count()) + " ms for " + std::to_string(stall.count()) + " ms" +
                             (by_messages ? ", agreement by messages" : "");
    CAPTURE(line);
    // Printed before the trial runs: a crash shows no CAPTURE.
    if (me == 0) {
      std::printf("seed %llu %s\n", static_cast<unsigned long long>(seed), line.c_str());
      std::fflush(stdout);
    }
    if (by_messages) {
      setenv("GRADSYNC_MPI_AGREEMENT", "messages", 1);
    } else {
      unsetenv("GRADSYNC_MPI_AGREEMENT");
    }
    std::string outcome;
    CAPTURE(outcome);
    bool threw = false;
    {
      gs::Communicator<gs::Mpi> comm(MPI_COMM_WORLD);
      comm.set_timeout(10s);
      Mapped x(count);
      for (std::size_t i = 0; i < count; ++i) x.span()[i] = input(salt, me, i);
      std::thread resume;
      test::idle_barrier();
      if (me == faulty) {
        std::this_thread::sleep_for(delay);
        kill(pids[static_cast<std::size_t>(stopped)], SIGSTOP);
        resume = std::thread([&] {
          std::this_thread::sleep_for(stall);
          kill(pids[static_cast<std::size_t>(stopped)], SIGCONT);
        });
        comm.set_timeout(1ms);
      }
      std::size_t wrong = 0;
      try {
        run(comm, algo, x.span());
        for (std::size_t i = 0; i < count; ++i) {
          float want = 0.0f;
          for (int r = 0; r < n; ++r) want += input(salt, r, i);
          wrong += x.span()[i] != want ? 1 : 0;
        }
      } catch (const std::exception& e) {
        threw = true;
        outcome = e.what();
      }
      // The caller lets go of its memory as soon as the call is over.
      x.unmap();
      if (resume.joinable()) resume.join();
      CHECK_MESSAGE(wrong == 0, "rank ", me, " returned normally with ", wrong, " of ", count, " sums wrong");
      if (me == faulty) CHECK_MESSAGE(threw, "rank ", me, " (1 ms deadline) returned normally");
      // MPI runs on every rank again while the communicator still lives: a
      // peer's late read, and the answer it asks for, happen here.
      test::idle_barrier();
    }
    test::idle_barrier();
  }
  unsetenv("GRADSYNC_MPI_AGREEMENT");
}

}  // namespace test_mpi_abandoned_send
