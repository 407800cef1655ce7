// broadcast_perf: an nccl-tests style broadcast benchmark over the Threads
// backend, or, built with -DGRADSYNC_BENCH_MPI (broadcast_perf_mpi), over the
// Mpi backend under mpirun. Run with -h for the options; --root picks the
// root (nccl-tests' -r, which here is repeats).
//
// Conventions (nccl-tests, doc/PERFORMANCE.md): size = the buffer every rank
// ends with; algbw = size / time, busbw = algbw (factor 1: all of it leaves
// the root). Broadcast works on one buffer, so only the in-place columns are
// measured, and the footer's average is theirs.

#include "perf/driver.hpp"

#include <algorithm>
#include <cstddef>
#include <span>
#include <string_view>

namespace {

using bench::Shape;

/// Broadcast: every rank ends with the root's buffer.
struct BroadcastPerf : bench::PerfDefaults<gradsync::Collective::broadcast> {
  static constexpr bool rooted = true;
  static constexpr bool out_of_place = false;
  static constexpr std::string_view busbw_formula = "1 (all of it leaves the root)";
  static constexpr std::string_view usage_note =
      "  Sizes (-b, -e and the size column) are the buffer every rank ends with, as\n"
      "  nccl-tests counts them; count is its elements.\n";
  static constexpr std::string_view header_note =
      "# size = count x sizeof(type): the buffer every rank ends with, as nccl-tests counts it\n"
      "# out-of-place: not measured (Broadcast has one buffer); Avg bus bandwidth is in place\n";
  static constexpr std::string_view size_convention = "per-rank bytes (the buffer every rank ends with)";

  static double busbw_factor(int) { return 1.0; }
  static std::size_t send_count(std::size_t, int) { return 0; }

  template <class T, class>
  static void expect(const Shape& s, std::span<T> out) {
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = bench::from_int<T>(bench::input_value<gradsync::Sum>(s.root, i));
  }
  /// The root holds its data; every other rank holds values no input has.
  template <class T, class Op>
  static void fill_in_place(const Shape& s, std::span<T> buf, bool) {
    if (s.rank != s.root) {
      std::fill(buf.begin(), buf.end(), bench::unwritten<T>());
      return;
    }
    for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = input<T, Op>(s, i);
  }
  template <class Algo, class T, class>
  static void run(bench::Comm& comm, const Shape& s, std::span<const T>, std::span<T> buf, bool) {
    gradsync::Broadcast<Algo>{}(comm, buf, s.root);
  }
};

}  // namespace

int main(int argc, char** argv) { return bench::perf_main<BroadcastPerf>(argc, argv); }
