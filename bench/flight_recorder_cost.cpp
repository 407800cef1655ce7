// What the flight recorder adds to a call, against the cheapest call there is,
// in one run:
// - the recorder's per-call work (copy the call into the ring, one coarse
//   clock read) timed alone;
// - an 8-byte Native all-reduce on 2 Threads ranks with the recorder on and
//   with it off (GRADSYNC_FLIGHT_ENTRIES=0), in interleaved rounds: the
//   difference is what a call really pays, since the CPU runs the
//   recorder's few loads and stores beside the call's own waiting.
//
//   flight_recorder_cost [CALLS] [ROUNDS]   (default 2,000,000 and 15; the all-reduce runs CALLS / 10 a round)

#include <gradsync/collectives.hpp>
#include "perf/shared_launches.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string_view>
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

/// ns per 8-byte Native all-reduce at N = 2 in one round (each rank times
/// its own loop; the slower rank counts), with the recorder on or off.
double all_reduce_ns(std::size_t calls, bool recorder) {
  // Communicators read it when made, before the rank threads start.
  if (recorder) {
    unsetenv("GRADSYNC_FLIGHT_ENTRIES");
  } else {
    setenv("GRADSYNC_FLIGHT_ENTRIES", "0", 1);
  }
  std::vector<double> took(2);
  gs::run_threads(2, [&](gs::Communicator<gs::Threads>& comm) {
    std::vector<float> x(2, 1.0f);
    for (int w = 0; w < 1000; ++w) gs::AllReduce<gs::Native>{}(comm, std::span<float>(x));
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t k = 0; k < calls; ++k) gs::AllReduce<gs::Native>{}(comm, std::span<float>(x));
    took[static_cast<std::size_t>(comm.rank())] = seconds_since(t0);
  });
  return std::max(took[0], took[1]) * 1e9 / static_cast<double>(calls);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t calls = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 2'000'000;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 15;
  if (calls < 10 || rounds < 1) {
    std::fprintf(stderr, "usage: flight_recorder_cost [CALLS >= 10] [ROUNDS >= 1]\n");
    return 2;
  }
  const char* was = std::getenv("GRADSYNC_FLIGHT_ENTRIES");
  if (was != nullptr && std::string_view(was) == "0") {
    std::fprintf(stderr, "flight_recorder_cost: unset GRADSYNC_FLIGHT_ENTRIES (it switches the recorder itself)\n");
    return 2;
  }
  const double rec = recorder_ns(calls);
  // Rounds alternate, and which goes first alternates too, so that a drift
  // of the machine's speed falls on both alike.
  std::vector<double> on, off;
  for (int r = 0; r < rounds; ++r) {
    const bool first_on = r % 2 == 0;
    (first_on ? on : off).push_back(all_reduce_ns(calls / 10, first_on));
    (first_on ? off : on).push_back(all_reduce_ns(calls / 10, !first_on));
  }
  const double m_on = median(on), m_off = median(off);
  const double b_on = *std::min_element(on.begin(), on.end()), b_off = *std::min_element(off.begin(), off.end());
  std::printf("flight recorder alone, per call:                  %8.1f ns\n", rec);
  std::printf("8-byte Native all-reduce, N = 2, Threads, %2d rounds each, median (best):\n", rounds);
  std::printf("  recorder on  (256 entries):                     %8.1f ns (%.1f)\n", m_on, b_on);
  std::printf("  recorder off (GRADSYNC_FLIGHT_ENTRIES=0):       %8.1f ns (%.1f)\n", m_off, b_off);
  std::printf("  on against off:                                 %+8.2f %% (%+.2f %%)\n", 100.0 * (m_on - m_off) / m_off,
              100.0 * (b_on - b_off) / b_off);
  std::printf("the recorder alone as a share of the call:        %8.2f %%\n", 100.0 * rec / m_on);
  return 0;
}
