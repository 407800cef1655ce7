// ddp_step: where a ReplicatedTrainer step goes — compute, gradient
// communication, and the part of it hidden behind backward — at N = 1, 2, 4
// ranks on the Threads backend, or on the mpirun world with --backend mpi.
//
//   ddp_step [--steps S] [--ranks 1,2,4] [--large-only|--small-only]
//            [--sizes 784,1024,1024,10] [--overlap on|off|both] [--no-flush-denormals]
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

// First: eigen_dense.hpp's pragma reaches the intrinsics header only if nothing included it before.
#include "../examples/eigen_mlp.hpp"

#include <gradsync/gradsync.hpp>
#ifdef GRADSYNC_HAVE_MPI
#include <gradsync/backend/mpi.hpp>
#endif

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
Row measure(Comm& comm, const std::vector<int>& sizes, int steps, bool overlap, bool flush_denormals) {
  // Before the trainer: its progress worker thread starts with this state.
  const gradsync::FlushDenormals flush(flush_denormals);
  constexpr int batch = 64;
  std::mt19937 rng(5 + comm.rank());
  std::normal_distribution<float> normal;
  std::vector<float> x(std::size_t(batch) * sizes[0]);
  std::vector<int> y(batch);
  for (float& v : x) v = normal(rng);
  for (int& v : y) v = static_cast<int>(rng() % static_cast<unsigned>(sizes.back()));
  gradsync::ReplicatedTrainerOptions o;
  o.sync.overlap = overlap;
  gradsync::ReplicatedTrainer trainer(comm, example::EigenMlp(sizes, 1), gradsync::Sgd<float>({.lr = 0.01}), o);
  const example::Batch b{x.data(), y.data(), batch};
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

void print_row(int n, bool overlap, const Row& r, double base) {
  const double sps = 64.0 * n / r.step;
  std::printf("%4d  %-7s %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f %9.2f %10.0f", n, overlap ? "on" : "off",
              1e3 * r.step, 1e3 * r.compute, 1e3 * r.comm, 1e3 * r.exposed, 1e3 * std::max(0.0, r.comm - r.exposed),
              1e3 * r.skew, 1e3 * r.flat, 1e3 * r.flat_cold, sps);
  if (n > 1 && r.flat > 0) {
    if (base > 0) std::printf("   weak-scaling eff %.0f%%,", 100 * sps / (n * base));
    std::printf(" comm/flat %.2f (net of skew %.2f; over flat cold %.2f)", r.comm / r.flat,
                std::max(0.0, r.comm - r.skew) / r.flat, std::max(0.0, r.comm - r.skew) / r.flat_cold);
  }
  std::printf("\n");
  std::fflush(stdout);
}

std::string describe(const std::vector<int>& sizes) {
  std::string name = "MLP ";
  std::size_t params = 0;
  for (std::size_t l = 0; l < sizes.size(); ++l) {
    name += (l ? "-" : "") + std::to_string(sizes[l]);
    if (l + 1 < sizes.size()) params += std::size_t(sizes[l] + 1) * std::size_t(sizes[l + 1]);
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, " (%.2fM params)", static_cast<double>(params) / 1e6);
  return name + buf;
}

std::vector<int> parse_list(const std::string& text, const char* option) {
  std::vector<int> out;
  std::stringstream ss(text);
  for (std::string t; std::getline(ss, t, ',');) {
    std::size_t used = 0;
    const int v = std::stoi(t, &used);
    if (used != t.size() || v < 1) throw std::invalid_argument(t);
    out.push_back(v);
  }
  if (out.empty()) throw std::invalid_argument(option);
  return out;
}

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "ddp_step: %s\n"
               "usage: ddp_step [--backend threads|mpi] [--steps S] [--ranks 1,2,4] [--large-only|--small-only]\n"
               "                [--sizes 784,1024,1024,10] [--overlap on|off|both] [--no-flush-denormals]\n",
               why.c_str());
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  Eigen::setNbThreads(1);
  int steps = 20;
  std::vector<int> ranks{1, 2, 4}, sizes;
  bool small = true, large = true, ranks_given = false, flush_denormals = true;
  std::vector<bool> overlaps{true, false};
  std::string backend = "threads";
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const bool has_value = i + 1 < argc;
    try {
      if (k == "--steps" && has_value) {
        steps = parse_list(argv[++i], "--steps").at(0);
      } else if (k == "--ranks" && has_value) {
        ranks = parse_list(argv[++i], "--ranks");
        ranks_given = true;
      } else if (k == "--sizes" && has_value) {
        sizes = parse_list(argv[++i], "--sizes");
        if (sizes.size() < 2) usage("--sizes needs at least an input and an output width");
      } else if (k == "--overlap" && has_value) {
        const std::string v = argv[++i];
        if (v == "on") overlaps = {true};
        else if (v == "off") overlaps = {false};
        else if (v == "both") overlaps = {true, false};
        else usage("--overlap takes on, off or both, not '" + v + "'");
      } else if (k == "--backend" && has_value) {
        backend = argv[++i];
      } else if (k == "--large-only") {
        small = false;
      } else if (k == "--small-only") {
        large = false;
      } else if (k == "--no-flush-denormals") {
        flush_denormals = false;
      } else {
        const bool takes_value = k == "--steps" || k == "--ranks" || k == "--sizes" || k == "--overlap" ||
                                 k == "--backend";
        usage(takes_value ? k + " needs a value" : "unknown option " + k);
      }
    } catch (const std::logic_error&) {
      usage("bad value for " + k + ": '" + argv[i] + "' (positive integers, comma-separated)");
    }
  }
  if (backend != "threads" && backend != "mpi") usage("unknown backend '" + backend + "' (threads or mpi)");
#ifndef GRADSYNC_HAVE_MPI
  if (backend == "mpi") {
    usage("--backend mpi: this ddp_step was built without MPI; install it (e.g. libopenmpi-dev) and reconfigure "
          "with meson option -Dmpi=enabled");
  }
#endif
  if (backend == "mpi" && ranks_given) {
    usage("--ranks is for threads; under --backend mpi the world size is mpirun's -np");
  }

  std::vector<std::vector<int>> models;
  if (!sizes.empty()) {
    models.push_back(sizes);
  } else {
    if (small) models.push_back({784, 1024, 1024, 10});
    if (large) models.push_back({784, 2048, 2048, 2048, 10});
  }
  auto header = [&](const std::vector<int>& m, int s) {
    std::printf("# %s, per-rank batch 64, SGD, %s, %d steps; ms per step (rank 0)\n", describe(m).c_str(),
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
          Row row;
          gradsync::run_threads(n, [&](gradsync::Communicator<gradsync::Threads>& comm) {
            const Row r = measure(comm, m, s, overlap, flush_denormals);
            if (comm.rank() == 0) row = r;
          });
          if (n == 1) base[overlap] = 64.0 / row.step;
          print_row(n, overlap, row, base[overlap]);
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
        const Row row = measure(comm, m, s, overlap, flush_denormals);
        if (comm.rank() == 0) print_row(comm.size(), overlap, row, 0);
      }
    }
#endif
  }
}
