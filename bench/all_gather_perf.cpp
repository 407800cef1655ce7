// all_gather_perf: an nccl-tests style all-gather benchmark over the Threads
// backend, or, built with -DGRADSYNC_BENCH_MPI (all_gather_perf_mpi), over the
// Mpi backend under mpirun. Run with -h for the options.
//
// Conventions (nccl-tests, doc/PERFORMANCE.md): size = the whole gathered
// array, N x the count elements each rank contributes; algbw = size / time,
// busbw = algbw * (N-1)/N. In place, each rank's input is its own block of
// the output.

#include "perf/driver.hpp"

#include <algorithm>
#include <cstddef>
#include <span>
#include <string_view>

namespace {

using bench::Shape;

/// All-gather: every rank ends with all ranks' blocks, block q from rank q.
struct AllGatherPerf : bench::PerfBlocks<gradsync::Collective::all_gather> {
  static constexpr std::string_view usage_note =
      "  Sizes (-b, -e and the size column) are the whole gathered array, N x the\n"
      "  bytes each rank contributes, as nccl-tests counts them; count is elements\n"
      "  per rank.\n";
  static constexpr std::string_view header_note =
      "# size = N x count x sizeof(type): the whole gathered array, as nccl-tests counts it; count = elements per rank\n";

  static std::size_t recv_count(std::size_t count, int n) { return count * static_cast<std::size_t>(n); }

  /// Rank q's block, hashed on its offset in the output, so that a block
  /// landing in the wrong place shows.
  template <class T>
  static T block_value(int q, std::size_t count, std::size_t i) {
    return bench::from_int<T>(bench::input_value<gradsync::Sum>(q, static_cast<std::size_t>(q) * count + i));
  }
  template <class T, class>
  static T input(const Shape& s, std::size_t i) {
    return block_value<T>(s.rank, s.count, i);
  }
  template <class T, class>
  static void expect(const Shape& s, std::span<T> out) {
    for (int q = 0; q < s.ranks; ++q)
      for (std::size_t i = 0; i < s.count; ++i) out[static_cast<std::size_t>(q) * s.count + i] = block_value<T>(q, s.count, i);
  }
  template <class T, class Op>
  static void fill_in_place(const Shape& s, std::span<T> buf, bool) {
    std::fill(buf.begin(), buf.end(), bench::unwritten<T>());
    const std::span<T> own = buf.subspan(static_cast<std::size_t>(s.rank) * s.count, s.count);
    for (std::size_t i = 0; i < own.size(); ++i) own[i] = input<T, Op>(s, i);
  }
  template <class Algo, class T, class>
  static void run(bench::Comm& comm, const Shape& s, std::span<const T> send, std::span<T> recv, bool in_place) {
    if (in_place) {
      const std::span<const T> own = recv.subspan(static_cast<std::size_t>(s.rank) * s.count, s.count);
      gradsync::AllGather<Algo>{}(comm, own, recv);
    } else {
      gradsync::AllGather<Algo>{}(comm, send, recv);
    }
  }
};

}  // namespace

int main(int argc, char** argv) { return bench::perf_main<AllGatherPerf>(argc, argv); }
