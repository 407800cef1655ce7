// A backend whose Capabilities leave split false cannot split, and says so
// in one sentence instead of a missing member of its endpoint.
// expect: cannot split a communicator
#include <gradsync/gradsync.hpp>

struct NoSplit {
  using Endpoint = gradsync::detail::threads::Endpoint;
#ifdef GRADSYNC_CONTROL
  static constexpr gradsync::Capabilities capabilities{.split = true};
#endif
};

void f(gradsync::Communicator<NoSplit>& comm) { (void)comm.split(0, 0); }
