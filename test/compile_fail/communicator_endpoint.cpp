// The public Communicator hands out no implementation type: its endpoint is
// reached only through detail::endpoint_of, by gradsync's own code.
// expect: no member named
#include <gradsync/core/endpoint_of.hpp>
#include <gradsync/gradsync.hpp>

void f(gradsync::Communicator<gradsync::Threads>& comm) {
#ifdef GRADSYNC_CONTROL
  (void)gradsync::detail::endpoint_of(comm).rank();
#else
  (void)comm.endpoint().rank();
#endif
}
