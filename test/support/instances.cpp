// The one instantiation of each collective's launch (see instances.hpp).
#include "instances.hpp"

#define GRADSYNC_TEST_INSTANTIATE_LAUNCH(C, A, B)                                           \
  template void gradsync::detail::launch<gradsync::Collective::C, gradsync::A, gradsync::B>( \
      gradsync::Communicator<gradsync::B>&, const gradsync::detail::Operands&, std::size_t);

// Built plainly for Threads (test_support), and with GRADSYNC_TEST_MPI for
// Mpi only (test_support_mpi, linked beside test_support).
#ifdef GRADSYNC_TEST_MPI
GRADSYNC_TEST_FOR_EACH_LAUNCH(GRADSYNC_TEST_INSTANTIATE_LAUNCH, Mpi)
#else
GRADSYNC_TEST_FOR_EACH_LAUNCH(GRADSYNC_TEST_INSTANTIATE_LAUNCH, Threads)
#endif
