// reduce_scatter_perf: an nccl-tests style reduce-scatter benchmark over the
// Threads backend, or, built with -DGRADSYNC_BENCH_MPI (reduce_scatter_perf_mpi),
// over the Mpi backend under mpirun. Run with -h for the options.
//
// Conventions (nccl-tests, doc/PERFORMANCE.md): size = the whole array, N x
// the count elements each rank ends with; algbw = size / time, busbw = algbw
// * (N-1)/N. ReduceScatter needs separate in and out buffers, so the in-place
// columns are not measured.

#include "perf/driver.hpp"

#include <cstddef>
#include <span>
#include <string_view>

namespace {

using bench::Shape;

/// Reduce-scatter: rank r ends with block r of op over all ranks' N-block
/// inputs.
struct ReduceScatterPerf : bench::PerfBlocks<gradsync::Collective::reduce_scatter> {
  static constexpr bool reduces = true;
  static constexpr bool in_place = false;
  static constexpr std::string_view usage_note =
      "  Sizes (-b, -e and the size column) are the whole array, N x the bytes each\n"
      "  rank ends with, as nccl-tests counts them; count is elements per rank.\n";
  static constexpr std::string_view header_note =
      "# size = N x count x sizeof(type): the whole array, as nccl-tests counts it; count = elements per rank\n"
      "# in-place: not measured (ReduceScatter needs separate in and out buffers)\n";

  static std::size_t send_count(std::size_t count, int n) { return count * static_cast<std::size_t>(n); }

  template <class T, class Op>
  static void expect(const Shape& s, std::span<T> out) {
    bench::fill_expected<T, Op>(s.ranks, static_cast<std::size_t>(s.rank) * s.count, out);
  }
  template <class Algo, class T, class Op>
  static void run(bench::Comm& comm, const Shape&, std::span<const T> send, std::span<T> recv, bool) {
    gradsync::ReduceScatter<Algo>{}(comm, send, recv, Op{});
  }
};

}  // namespace

int main(int argc, char** argv) { return bench::perf_main<ReduceScatterPerf>(argc, argv); }
