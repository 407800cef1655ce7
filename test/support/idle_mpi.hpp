#pragma once
// MPI calls for the tests' own synchronisation that wait without burning a
// core. Open MPI's blocking collectives poll, and oversubscribed they yield
// in a loop: ranks that wait for a test's slow or faulty rank then spend
// seconds of system CPU that the other processes on the machine need (in CI,
// the sanitizer builds compiling beside the tests). These post the
// non-blocking call and poll it with the library's own IdleBackoff.
// Like MPI_Barrier, they have no deadline: meson's test timeout bounds them.

#include <mpi.h>

#include "gradsync/backend/mpi/idle_backoff.hpp"

namespace test {

inline void idle_wait(MPI_Request& r) {
  const gradsync::detail::mpi::IdleBackoff backoff;
  for (int done = 0;;) {
    MPI_Test(&r, &done, MPI_STATUS_IGNORE);
    if (done) return;
    backoff.idle();
  }
}

/// MPI_Barrier on MPI_COMM_WORLD.
inline void idle_barrier() {
  MPI_Request r;
  MPI_Ibarrier(MPI_COMM_WORLD, &r);
  idle_wait(r);
}

/// The largest of every rank's `x` (MPI_Allreduce with MPI_MAX on MPI_COMM_WORLD).
inline int idle_max(int x) {
  int out = x;
  MPI_Request r;
  MPI_Iallreduce(&x, &out, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD, &r);
  idle_wait(r);
  return out;
}

}  // namespace test
