// nccl_all_reduce_perf: gradsync's AllReduce on GPUs, in nccl-tests' columns.
//
//   nccl_all_reduce_perf --backend nccl --algo all -b 8 -e 1G -f 2
//   nccl_all_reduce_perf --backend device-threads --ranks 2,4,8 --algo ring -b 8 -e 1G -f 2
//
// --backend nccl: one rank per visible GPU (ncclCommInitAll, one thread per
// GPU). --backend device-threads: each N of --ranks runs N ranks as threads
// on GPU 0 (the test backend DeviceThreads, test/nccl/device_threads.hpp):
// gradsync's own algorithms and reduce kernels on device memory, where one
// GPU cannot host two NCCL ranks. Those ranks share one GPU's memory, so
// their busbw is measured against cudaMemcpy device-to-device on that GPU,
// printed first, not against a link.
//
// Columns as nccl-tests: size count type redop root, then time (us) algbw
// busbw (GB/s, 1 GB = 1e9 B, busbw = algbw * 2(N-1)/N) #wrong, out-of-place
// then in-place; the time is the slowest rank's and #wrong counts every
// rank's elements. Under Nccl, two checks at 256 MiB follow: Native through
// gradsync against ncclAllReduce called directly, and the Thrust reduce
// kernel against cudaMemcpy device-to-device. A short table comes last.

#include <cuda_runtime.h>
#include <nccl.h>
#include <thrust/count.h>
#include <thrust/execution_policy.h>
#include <thrust/fill.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradsync/algorithm/native.hpp"
#include "gradsync/algorithm/recursive_halving_doubling.hpp"
#include "gradsync/algorithm/ring.hpp"
#include "gradsync/algorithm/tree.hpp"
#include "gradsync/backend/nccl.hpp"
#include "gradsync/collective/all_reduce.hpp"
#include "gradsync/core/endpoint_of.hpp"
#include "device_threads.hpp"
#include "int_list.hpp"

namespace {

using gradsync::detail::nccl::check_cuda;

std::size_t parse_size(const char* s) {
  char* end = nullptr;
  double v = std::strtod(s, &end);
  switch (end && *end ? *end : ' ') {
    case 'K': case 'k': v *= 1024; break;
    case 'M': case 'm': v *= 1024 * 1024; break;
    case 'G': case 'g': v *= 1024.0 * 1024 * 1024; break;
    default: break;
  }
  return static_cast<std::size_t>(v);
}

struct Args {
  std::string algo = "all";
  std::size_t min_bytes = 8, max_bytes = std::size_t{1} << 30;
  double factor = 2;
  int warmup = 3;
  bool compare = true;
  std::string backend = "nccl";
  std::vector<int> ranks = {2, 4, 8};  ///< device-threads only
};

struct IsWrong {
  float want;
  __host__ __device__ bool operator()(float x) const { return x != want; }
};

/// Seconds per call of `f` on `stream`, averaged over `iters`.
double time_on(cudaStream_t stream, int iters, const std::function<void()>& f) {
  cudaEvent_t a, b;
  check_cuda(cudaEventCreate(&a), "cudaEventCreate");
  check_cuda(cudaEventCreate(&b), "cudaEventCreate");
  check_cuda(cudaEventRecord(a, stream), "cudaEventRecord");
  for (int i = 0; i < iters; ++i) f();
  check_cuda(cudaEventRecord(b, stream), "cudaEventRecord");
  check_cuda(cudaEventSynchronize(b), "cudaEventSynchronize");
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / 1e3 / iters;
}

int iters_for(std::size_t bytes) { return static_cast<int>(std::clamp<std::size_t>((std::size_t{4} << 30) / std::max<std::size_t>(bytes, 1), 5, 200)); }

template <class B, class Algo>
void run_all_reduce(gradsync::Communicator<B>& comm, std::span<const float> in, std::span<float> out) {
  gradsync::AllReduce<Algo>{}(comm, in, out);
}

template <class B>
using Runner = void (*)(gradsync::Communicator<B>&, std::span<const float>, std::span<float>);

/// The stream a rank's calls run on: the Nccl endpoint's own, or, under
/// DeviceThreads, the calling thread's default stream.
template <class B>
cudaStream_t stream_of(gradsync::Communicator<B>& comm) {
  if constexpr (std::is_same_v<B, gradsync::Nccl>) {
    return gradsync::detail::endpoint_of(comm).stream();
  } else {
    return cudaStreamPerThread;
  }
}

/// The algorithms a backend runs: DeviceThreads has no Native.
template <class B>
std::vector<std::pair<std::string, Runner<B>>> algorithms() {
  std::vector<std::pair<std::string, Runner<B>>> a;
  if constexpr (std::is_same_v<B, gradsync::Nccl>) a.emplace_back("native", &run_all_reduce<B, gradsync::Native>);
  a.emplace_back("ring", &run_all_reduce<B, gradsync::Ring>);
  a.emplace_back("tree", &run_all_reduce<B, gradsync::Tree>);
  a.emplace_back("rhd", &run_all_reduce<B, gradsync::RecursiveHalvingDoubling>);
  return a;
}

/// cudaMemcpy device-to-device on the current GPU, bytes read + written per
/// second, at 256 MiB (or `max_bytes` if smaller): the bound ranks sharing
/// that GPU's memory move their bytes against.
double d2d_copy_gbps(std::size_t max_bytes) {
  const std::size_t bytes = std::min<std::size_t>(max_bytes, std::size_t{256} << 20);
  void *a = nullptr, *b = nullptr;
  check_cuda(cudaMalloc(&a, bytes), "cudaMalloc");
  check_cuda(cudaMalloc(&b, bytes), "cudaMalloc");
  check_cuda(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy");
  const double t = time_on(nullptr, 20, [&] {
    check_cuda(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, nullptr), "cudaMemcpyAsync");
  });
  cudaFree(a);
  cudaFree(b);
  return 2.0 * static_cast<double>(bytes) / t / 1e9;
}

struct Row {
  double busbw_256m = 0;
  double busbw_max = 0;
  long wrong = 0;
};

/// One size's figures of every rank (the ranks are threads of this
/// process), for rank 0 to combine: the slowest rank's time, as collective
/// benchmarks report it, and the wrong elements of all ranks.
struct RankFigures {
  double t[2] = {0, 0};
  long wrong[2] = {0, 0};
};

/// Under Nccl, at 256 MiB: Native through gradsync against ncclAllReduce
/// called directly, and the Thrust reduce kernel against cudaMemcpy.
void compare_with_nccl(gradsync::Communicator<gradsync::Nccl>& comm, float* in, float* out,
                       std::map<std::string, Row>* rows) {
  const bool lead = comm.rank() == 0;
  const cudaStream_t stream = stream_of(comm);
  const std::size_t n = (std::size_t{256} << 20) / sizeof(float);
  const int iters = 20;
  comm.barrier();
  const double via = time_on(stream, iters, [&] {
    run_all_reduce<gradsync::Nccl, gradsync::Native>(comm, std::span<const float>(in, n), std::span<float>(out, n));
  });
  comm.barrier();
  const double direct = time_on(stream, iters, [&] {
    check_cuda(cudaGetLastError(), "launch");
    gradsync::detail::nccl::check_nccl(
        ncclAllReduce(in, out, n, ncclFloat32, ncclSum, gradsync::detail::endpoint_of(comm).nccl_comm(), stream),
        "ncclAllReduce");
  });
  comm.barrier();
  const double reduce = time_on(stream, iters, [&] {
    gradsync::detail::endpoint_of(comm).local_reduce(out, in, n, gradsync::DataType::float32, gradsync::OpKind::sum);
  });
  const double copy = time_on(stream, iters, [&] {
    check_cuda(cudaMemcpyAsync(out, in, n * sizeof(float), cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
  });
  if (lead) {
    const double bytes = static_cast<double>(n * sizeof(float));
    std::printf("#\n# 256 MiB: Native via gradsync %.1f us, ncclAllReduce direct %.1f us: overhead %+.2f%% (target <= 2%%)\n",
                via * 1e6, direct * 1e6, (via / direct - 1) * 100);
    // The reduce moves 3 bytes per byte (read dst, read src, write dst), a copy 2.
    std::printf("# 256 MiB: Thrust reduce kernel %.0f GB/s moved, cudaMemcpy D2D %.0f GB/s moved: %.0f%% (target >= 80%%)\n",
                3 * bytes / reduce / 1e9, 2 * bytes / copy / 1e9, (3 * bytes / reduce) / (2 * bytes / copy) * 100);
    (*rows)["#overhead_pct"].busbw_max = (via / direct - 1) * 100;
    (*rows)["#reduce_pct"].busbw_max = (3 * bytes / reduce) / (2 * bytes / copy) * 100;
  }
}

template <class B>
void rank_main(gradsync::Communicator<B>& comm, const Args& args, std::map<std::string, Row>* rows,
               std::vector<RankFigures>& figures) {
  constexpr bool nccl = std::is_same_v<B, gradsync::Nccl>;
  const int p = comm.size();
  const bool lead = comm.rank() == 0;
  const cudaStream_t stream = stream_of(comm);
  const std::size_t max_count = args.max_bytes / sizeof(float);
  float *in = nullptr, *out = nullptr;
  check_cuda(cudaMalloc(&in, max_count * sizeof(float)), "cudaMalloc");
  check_cuda(cudaMalloc(&out, max_count * sizeof(float)), "cudaMalloc");
  const auto algos = algorithms<B>();
  const float want = static_cast<float>(p * (p + 1) / 2);
  const double bus = p > 1 ? 2.0 * (p - 1) / p : 1.0;
  for (const auto& [name, run] : algos) {
    if (args.algo != "all" && args.algo != name) continue;
    if (lead) {
      std::printf("#\n# gradsync AllReduce<%s> over %s, %d rank(s), float, sum\n", name.c_str(),
                  nccl ? "Nccl" : "DeviceThreads (one GPU)", p);
      std::printf("#%11s %12s %8s %6s %6s  %9s %8s %8s %6s  %9s %8s %8s %6s\n", "size", "count", "type", "redop",
                  "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong");
      std::printf("#%11s %12s %8s %6s %6s  %9s %8s %8s %6s  %9s %8s %8s %6s\n", "(B)", "(elements)", "", "", "",
                  "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "");
    }
    Row& row = (*rows)[name];
    for (std::size_t bytes = args.min_bytes; bytes <= args.max_bytes;
         bytes = std::max(bytes + sizeof(float), static_cast<std::size_t>(static_cast<double>(bytes) * args.factor))) {
      const std::size_t n = bytes / sizeof(float);
      // What moves: whole floats (a requested size need not be a multiple of 4).
      const std::size_t moved = n * sizeof(float);
      const int iters = iters_for(bytes);
      double t[2] = {0, 0};
      long wrong[2] = {0, 0};
      for (int inplace = 0; inplace < 2; ++inplace) {
        float* dst = inplace ? in : out;
        auto fill = [&] { thrust::fill(thrust::cuda::par.on(stream), in, in + n, static_cast<float>(comm.rank() + 1)); };
        fill();
        run(comm, std::span<const float>(in, n), std::span<float>(dst, n));
        wrong[inplace] = static_cast<long>(thrust::count_if(thrust::cuda::par.on(stream), dst, dst + n, IsWrong{want}));
        comm.barrier();
        for (int w = 0; w < args.warmup; ++w) run(comm, std::span<const float>(in, n), std::span<float>(dst, n));
        comm.barrier();
        t[inplace] = time_on(stream, iters, [&] { run(comm, std::span<const float>(in, n), std::span<float>(dst, n)); });
      }
      figures[static_cast<std::size_t>(comm.rank())] = {{t[0], t[1]}, {wrong[0], wrong[1]}};
      comm.barrier();
      if (lead) {
        for (const RankFigures& f : figures) {
          for (int k = 0; k < 2; ++k) {
            t[k] = std::max(t[k], f.t[k]);
            if (&f != &figures[0]) wrong[k] += f.wrong[k];
          }
        }
      }
      // Rank 0 has read every rank's figures before they are written again.
      comm.barrier();
      const double algbw[2] = {moved / t[0] / 1e9, moved / t[1] / 1e9};
      row.wrong += wrong[0] + wrong[1];
      row.busbw_max = algbw[0] * bus;
      if (bytes == (std::size_t{256} << 20)) row.busbw_256m = algbw[0] * bus;
      if (lead) {
        std::printf(" %11zu %12zu %8s %6s %6d  %9.2f %8.2f %8.2f %6ld  %9.2f %8.2f %8.2f %6ld\n", moved, n, "float", "sum",
                    -1, t[0] * 1e6, algbw[0], algbw[0] * bus, wrong[0], t[1] * 1e6, algbw[1], algbw[1] * bus, wrong[1]);
        std::fflush(stdout);
      }
    }
  }
  if constexpr (nccl) {
    if (args.compare && max_count >= (std::size_t{256} << 20) / sizeof(float)) compare_with_nccl(comm, in, out, rows);
  }
  cudaFree(in);
  cudaFree(out);
}

/// Prints the short table of one run and returns 1 if any result was wrong.
int summary(const std::string& what, const std::map<std::string, Row>& rows) {
  std::printf("#\n# summary (%s, float sum, busbw in GB/s)\n", what.c_str());
  std::printf("# %-8s %14s %14s %8s\n", "algo", "busbw@256MiB", "busbw@max", "#wrong");
  int rc = 0;
  for (const auto& [name, row] : rows) {
    if (name[0] == '#') continue;
    std::printf("# %-8s %14.2f %14.2f %8ld\n", name.c_str(), row.busbw_256m, row.busbw_max, row.wrong);
    if (row.wrong) rc = 1;
  }
  if (rows.count("#overhead_pct")) {
    std::printf("# Native overhead vs ncclAllReduce @256MiB: %+.2f%%\n", rows.at("#overhead_pct").busbw_max);
    std::printf("# Thrust reduce vs cudaMemcpy @256MiB:      %.0f%%\n", rows.at("#reduce_pct").busbw_max);
  }
  std::fflush(stdout);
  return rc;
}

/// One rank per visible GPU over NCCL.
int run_nccl(const Args& args, int devices) {
  std::vector<int> ids(static_cast<std::size_t>(devices));
  for (int d = 0; d < devices; ++d) ids[static_cast<std::size_t>(d)] = d;
  auto comms = gradsync::nccl_communicators(ids);
  std::vector<std::map<std::string, Row>> rows(comms.size());
  std::vector<RankFigures> figures(comms.size());
  std::vector<std::thread> threads;
  std::atomic<int> rc{0};
  for (std::size_t r = 0; r < comms.size(); ++r) {
    threads.emplace_back([&, r] {
      try {
        check_cuda(cudaSetDevice(ids[r]), "cudaSetDevice");
        rank_main(comms[r], args, &rows[r], figures);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %zu: %s\n", r, e.what());
        rc = 1;
      }
    });
  }
  for (auto& t : threads) t.join();
  const int wrong = summary(std::to_string(devices) + " GPU" + (devices > 1 ? "s" : "") + ", Nccl", rows[0]);
  return rc.load() | wrong;
}

/// Each N of --ranks as N threads on GPU 0, after the copy bound.
int run_on_one_gpu(const Args& args) {
  check_cuda(cudaSetDevice(0), "cudaSetDevice");
  const double bound = d2d_copy_gbps(args.max_bytes);
  std::printf("# cudaMemcpy device-to-device on GPU 0: %.0f GB/s read + written (the bound the ranks share)\n", bound);
  int rc = 0;
  for (const int n : args.ranks) {
    std::vector<std::map<std::string, Row>> rows(static_cast<std::size_t>(n));
    std::vector<RankFigures> figures(static_cast<std::size_t>(n));
    try {
      gradsync::run_device_threads(n, 0, std::chrono::seconds(120), [&](gradsync::Communicator<gradsync::DeviceThreads>& comm) {
        rank_main(comm, args, &rows[static_cast<std::size_t>(comm.rank())], figures);
      });
    } catch (const std::exception& e) {
      std::fprintf(stderr, "DeviceThreads at %d ranks: %s\n", n, e.what());
      rc = 1;
    }
    rc |= summary("DeviceThreads, " + std::to_string(n) + " ranks on GPU 0; D2D copy " +
                      std::to_string(static_cast<int>(bound)) + " GB/s",
                  rows[0]);
  }
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  const char* usage =
      "usage: %s [--backend nccl|device-threads] [--ranks 2,4,8] [--algo native|ring|tree|rhd|all] [-b 8] [-e 1G] "
      "[-f 2] [-w 3] [--no-compare]\n";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) { std::fprintf(stderr, "%s needs a value\n", a.c_str()); std::exit(2); }
      return argv[++i];
    };
    if (a == "--backend") {
      args.backend = next();
      if (args.backend != "nccl" && args.backend != "device-threads") {
        std::fprintf(stderr, "--backend is nccl or device-threads, got %s\n", args.backend.c_str());
        return 2;
      }
    } else if (a == "--ranks") {
      try {
        args.ranks = bench::parse_list(next(), "--ranks");
      } catch (const std::invalid_argument&) {
        args.ranks.clear();
      }
      if (args.ranks.empty() || *std::max_element(args.ranks.begin(), args.ranks.end()) > 64) {
        std::fprintf(stderr, "--ranks wants a list like 2,4,8 (1 to 64 each)\n");
        return 2;
      }
    } else if (a == "--algo" || a == "-a") {
      args.algo = next();
    } else if (a == "-b" || a == "--minbytes") {
      args.min_bytes = std::max<std::size_t>(parse_size(next()), sizeof(float));
    } else if (a == "-e" || a == "--maxbytes") {
      args.max_bytes = parse_size(next());
    } else if (a == "-f" || a == "--stepfactor") {
      args.factor = std::strtod(next(), nullptr);
    } else if (a == "-w" || a == "--warmup_iters") {
      args.warmup = std::atoi(next());
    } else if (a == "--no-compare") {
      args.compare = false;
    } else {
      std::fprintf(stderr, usage, argv[0]);
      return 2;
    }
  }
  if (args.factor <= 1 || args.max_bytes < args.min_bytes) {
    std::fprintf(stderr, "-f must be above 1 and -e at least -b\n");
    return 2;
  }
  if (args.backend == "device-threads" && args.algo == "native") {
    std::fprintf(stderr, "DeviceThreads has no Native all-reduce: --algo ring, tree, rhd or all\n");
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device\n");
    return 77;
  }
  return args.backend == "nccl" ? run_nccl(args, devices) : run_on_one_gpu(args);
}
