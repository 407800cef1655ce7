// A user-defined op is refused at compile time: the backends reduce by
// OpKind, so its own apply() would silently never run.
// expect: ReduceOp
#include <gradsync/gradsync.hpp>

#include <span>

#ifdef GRADSYNC_CONTROL
using Op = gradsync::Max;
#else
struct Op {
  static constexpr gradsync::OpKind kind = gradsync::OpKind::max;
  template <class T>
  static T apply(T a, T b) {
    return a > b ? a : b;
  }
};
#endif

void f(gradsync::Communicator<gradsync::Threads>& comm, std::span<float> x) { gradsync::AllReduce<>{}(comm, x, Op{}); }
