// What the flight recorder adds to a call, against the cheapest call there is:
// the recorder's per-call work (copy the call into the ring, two clock reads)
// timed alone, beside an 8-byte Native all-reduce on 2 Threads ranks (which
// pays it once per call), in one run.
//
//   flight_recorder_cost [CALLS]      (default 2,000,000; the all-reduce runs CALLS / 10)

#include <gradsync/gradsync.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <vector>

namespace gs = gradsync;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// ns per issue/start/end of one call, best of five rounds.
double recorder_ns(std::size_t calls) {
  gs::detail::FlightRecorder ring(gs::detail::flight_capacity());
  gs::detail::CallInfo call{};
  call.collective = gs::Collective::all_reduce;
  call.algorithm = "native";
  call.count = 2;
  double best = 1e9;
  for (int round = 0; round < 5; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t k = 0; k < calls; ++k) {
      call.seq = k + 1;
      auto& e = ring.issue(call);
      gs::detail::FlightRecorder::start(e);
      gs::detail::FlightRecorder::end(e, gs::detail::FlightState::completed);
    }
    best = std::min(best, seconds_since(t0) * 1e9 / static_cast<double>(calls));
  }
  return best;
}

/// ns per 8-byte Native all-reduce at N = 2, best of five rounds (each rank
/// times its own loop; the slower rank counts).
double all_reduce_ns(std::size_t calls) {
  double best = 1e9;
  for (int round = 0; round < 5; ++round) {
    std::vector<double> took(2);
    gs::run_threads(2, [&](gs::Communicator<gs::Threads>& comm) {
      std::vector<float> x(2, 1.0f);
      for (int w = 0; w < 1000; ++w) gs::AllReduce<gs::Native>{}(comm, std::span<float>(x));
      comm.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      for (std::size_t k = 0; k < calls; ++k) gs::AllReduce<gs::Native>{}(comm, std::span<float>(x));
      took[static_cast<std::size_t>(comm.rank())] = seconds_since(t0);
    });
    best = std::min(best, std::max(took[0], took[1]) * 1e9 / static_cast<double>(calls));
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t calls = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 2'000'000;
  if (calls < 10) {
    std::fprintf(stderr, "usage: flight_recorder_cost [CALLS >= 10]\n");
    return 2;
  }
  const double rec = recorder_ns(calls);
  const double ar = all_reduce_ns(calls / 10);
  std::printf("flight recorder, per call:                %8.1f ns\n", rec);
  std::printf("8-byte Native all-reduce, N = 2, Threads:  %8.1f ns (the recorder included)\n", ar);
  std::printf("the recorder's share of that call:         %8.2f %%\n", 100.0 * rec / ar);
  return 0;
}
