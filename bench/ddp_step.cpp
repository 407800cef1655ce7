// ddp_step: where a ReplicatedTrainer step goes — compute, gradient
// communication, and the part of it hidden behind backward — at N = 1, 2, 4
// ranks on the Threads backend, or on the mpirun world with --backend mpi.
//
//   ddp_step [--steps S] [--ranks 1,2,4] [--large-only|--small-only]
//            [--sizes 784,1024,1024,10] [--overlap on|off|both] [--no-flush-denormals]
//            [--on-nonfinite throw_error,ignore,...]
//   mpirun -np 4 ddp_step --backend mpi [...]     (built with MPI)
//
// Models: the peer measurement's MLP 784-1024-1024-10 (1.86M parameters)
// and an MLP 784-2048-2048-2048-10 (10.0M), or the one --sizes gives;
// per-rank batch 64, plain SGD. Under mpi the world size is mpirun's -np:
// one row per model and overlap setting.
// Columns (ms per step, rank 0, mean over S steps after warm-up):
//   step      wall time of trainer.step()
//   compute   forward + backward on the rank's thread
//   comm      the progress worker's time in bucket all-reduces
//   exposed   time step() waited for communication after backward
//   hidden    comm - exposed: communication overlapped with backward
//   skew      how long after rank 0's backward the slowest rank's ended: the
//             part of comm spent waiting for a peer to reach the collective
//             (load imbalance, not communication). From steady_clock stamps
//             gathered after the run, so ranks must share a host's clock.
//   flat      one AllReduce of all gradients alone, same algorithm (Auto),
//             back to back (the gradients stay in cache)
//   flat cold the same, each call after streaming 64 MiB through the caches
//             as a step's compute does
// comm/flat is printed raw and net of skew ((comm - skew) / flat): the latter
// is what bucketing costs over one flat all-reduce.
// "overlap off" launches every bucket after backward, for comparison.
// Each rank flushes subnormal floats to zero (gradsync::FlushDenormals), as
// ddp_mlp does, unless --no-flush-denormals.
// --on-nonfinite times each listed ReplicatedTrainerOptions::on_nonfinite in
// turn, in the order given (repeat them to interleave: throw_error,ignore,
// throw_error,ignore), and ends each row with it; the default is throw_error.

// First: eigen_dense.hpp's pragma reaches the intrinsics header only if nothing included it before.
#include "step_bench.hpp"

#include <gradsync/gradsync.hpp>
#ifdef GRADSYNC_HAVE_MPI
#include <gradsync/backend/mpi.hpp>
#endif
#include "perf/shared_launches.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

struct Row {
  double step = 0, compute = 0, comm = 0, exposed = 0, skew = 0, flat = 0, flat_cold = 0;
};

/// One measurement on `comm`'s ranks; the row is rank 0's.
template <class Comm>
Row measure(Comm& comm, const std::vector<int>& sizes, int steps, bool overlap, bool flush_denormals,
            gradsync::OnNonfinite on_nonfinite) {
  // Before the trainer: its progress worker thread starts with this state.
  const gradsync::FlushDenormals flush(flush_denormals);
  const bench::RandomBatch data(sizes, comm.rank());
  gradsync::ReplicatedTrainerOptions o;
  o.sync.overlap = overlap;
  o.on_nonfinite = on_nonfinite;
  gradsync::ReplicatedTrainer trainer(comm, example::EigenMlp(sizes, 1), gradsync::Sgd<float>({.lr = 0.01}), o);
  const example::Batch b = data.batch();
  for (int i = 0; i < 3; ++i) trainer.step(b);
  comm.barrier();
  trainer.reset_stats();
  // When each step's backward ended on this rank: its start plus its forward+backward.
  std::vector<double> backward_end(static_cast<std::size_t>(steps));
  auto seconds = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(t.time_since_epoch()).count();
  };
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) {
    const double start = seconds(std::chrono::steady_clock::now());
    const double compute0 = trainer.stats().compute_seconds;
    trainer.step(b);
    backward_end[static_cast<std::size_t>(i)] = start + (trainer.stats().compute_seconds - compute0);
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::vector<double> all_ends(backward_end.size() * static_cast<std::size_t>(comm.size()));
  gradsync::AllGather<>{}(comm, std::span<const double>(backward_end), std::span<double>(all_ends));
  double skew = 0;
  for (std::size_t i = 0; i < backward_end.size(); ++i) {
    double last = backward_end[i];
    for (int r = 0; r < comm.size(); ++r) last = std::max(last, all_ends[static_cast<std::size_t>(r) * backward_end.size() + i]);
    skew += last - backward_end[i];
  }
  // One flat all-reduce of every gradient, alone.
  auto grads = trainer.gradients();
  gradsync::AllReduce<> all_reduce;
  all_reduce(comm, grads, gradsync::Avg{});
  comm.barrier();
  const auto t1 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) all_reduce(comm, grads, gradsync::Avg{});
  const double flat = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  // The same, each call after this rank has streamed 64 MiB through its
  // caches, as a training step does between two syncs: the loop above keeps
  // the gradients cache-resident, which no step does.
  std::vector<float> sweep(std::size_t{16} << 20);
  double flat_cold = 0;
  for (int i = 0; i < steps; ++i) {
    for (float& v : sweep) v += 1.0f;
    comm.barrier();
    const auto t2 = std::chrono::steady_clock::now();
    all_reduce(comm, grads, gradsync::Avg{});
    flat_cold += std::chrono::duration<double>(std::chrono::steady_clock::now() - t2).count();
  }
  const auto& s = trainer.stats();
  return {wall / steps, s.compute_seconds / steps, s.comm_seconds / steps, s.exposed_comm_seconds / steps,
          skew / steps, flat / steps, flat_cold / steps};
}

/// `policy`: the row's on_nonfinite, printed last; null prints nothing.
void print_row(int n, bool overlap, const Row& r, double base, const char* policy) {
  const double sps = 64.0 * n / r.step;
  std::printf("%4d  %-7s %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f %9.2f %10.0f", n, overlap ? "on" : "off",
              1e3 * r.step, 1e3 * r.compute, 1e3 * r.comm, 1e3 * r.exposed, 1e3 * std::max(0.0, r.comm - r.exposed),
              1e3 * r.skew, 1e3 * r.flat, 1e3 * r.flat_cold, sps);
  if (n > 1 && r.flat > 0) {
    if (base > 0) std::printf("   weak-scaling eff %.0f%%,", 100 * sps / (n * base));
    std::printf(" comm/flat %.2f (net of skew %.2f; over flat cold %.2f)", r.comm / r.flat,
                std::max(0.0, r.comm - r.skew) / r.flat, std::max(0.0, r.comm - r.skew) / r.flat_cold);
  }
  if (policy != nullptr) std::printf("  on_nonfinite %s", policy);
  std::printf("\n");
  std::fflush(stdout);
}

constexpr const char* usage_text =
    "usage: ddp_step [--backend threads|mpi] [--steps S] [--ranks 1,2,4] [--large-only|--small-only]\n"
    "                [--sizes 784,1024,1024,10] [--overlap on|off|both] [--no-flush-denormals]\n"
    "                [--on-nonfinite throw_error|skip_step|ignore[,...]]\n";

}  // namespace

int main(int argc, char** argv) {
  Eigen::setNbThreads(1);
  bool flush_denormals = true;
  std::vector<bool> overlaps{true, false};
  const bench::StepOptions opt = bench::parse_step_options(
      argc, argv, "ddp_step", usage_text, 20, [&](const std::string& k, const char* value, bool& consumed) {
        if (k == "--no-flush-denormals") return (flush_denormals = false, true);
        if (k != "--overlap") return false;
        if (value == nullptr) bench::usage("ddp_step", usage_text, "--overlap needs a value");
        const std::string v = value;
        if (v == "on") overlaps = {true};
        else if (v == "off") overlaps = {false};
        else if (v == "both") overlaps = {true, false};
        else bench::usage("ddp_step", usage_text, "--overlap takes on, off or both, not '" + v + "'");
        consumed = true;
        return true;
      });
  const int steps = opt.steps;
  const std::string& backend = opt.backend;
  const std::vector<int>& ranks = opt.ranks;
  const std::vector<std::vector<int>> models = opt.models();
  auto policy_name = [&](gradsync::OnNonfinite p) { return opt.on_nonfinite_given ? gradsync::name(p) : nullptr; };
  auto header = [&](const std::vector<int>& m, int s) {
    std::printf("# %s, per-rank batch 64, SGD, %s, %d steps; ms per step (rank 0)\n", bench::describe(m).c_str(),
                backend == "mpi" ? "Mpi" : "Threads", s);
    std::printf("#  N  overlap     step  compute     comm  exposed   hidden     skew     flat flat cold  samples/s\n");
  };
  // The large model is measured over fewer steps: each is ~5x the small one's.
  auto steps_for = [&](const std::vector<int>& m) { return m.size() > 4 ? std::max(3, steps / 4) : steps; };

  if (backend == "threads") {
    for (const auto& m : models) {
      const int s = steps_for(m);
      header(m, s);
      // Samples/s of the one-rank row with the same overlap setting.
      double base[2] = {0, 0};
      for (int n : ranks) {
        for (bool overlap : overlaps) {
          for (const gradsync::OnNonfinite policy : opt.on_nonfinite) {
            Row row;
            gradsync::run_threads(n, [&](gradsync::Communicator<gradsync::Threads>& comm) {
              const Row r = measure(comm, m, s, overlap, flush_denormals, policy);
              if (comm.rank() == 0) row = r;
            });
            if (n == 1) base[overlap] = 64.0 / row.step;
            print_row(n, overlap, row, base[overlap], policy_name(policy));
          }
        }
      }
    }
  } else {
#ifdef GRADSYNC_HAVE_MPI
    // MPI starts here, only for this backend: the threads runs need no mpirun.
    gradsync::Communicator<gradsync::Mpi> comm(MPI_COMM_WORLD);
    for (const auto& m : models) {
      const int s = steps_for(m);
      if (comm.rank() == 0) header(m, s);
      for (bool overlap : overlaps) {
        for (const gradsync::OnNonfinite policy : opt.on_nonfinite) {
          const Row row = measure(comm, m, s, overlap, flush_denormals, policy);
          if (comm.rank() == 0) print_row(comm.size(), overlap, row, 0, policy_name(policy));
        }
      }
    }
#endif
  }
}
