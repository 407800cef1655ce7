// nccl_all_reduce_perf: gradsync's AllReduce on GPUs, in nccl-tests' columns.
//
//   nccl_all_reduce_perf --backend nccl --algo all -b 8 -e 1G -f 2
//
// One rank per visible GPU (ncclCommInitAll, one thread per GPU). Columns
// as nccl-tests: size count type redop root, then time (us) algbw busbw
// (GB/s, 1 GB = 1e9 B, busbw = algbw * 2(N-1)/N) #wrong, out-of-place then
// in-place. Then two checks at 256 MiB: Native through gradsync against
// ncclAllReduce called directly, and the Thrust reduce kernel against
// cudaMemcpy device-to-device. A short table comes last.

#include <cuda_runtime.h>
#include <nccl.h>
#include <thrust/count.h>
#include <thrust/execution_policy.h>
#include <thrust/fill.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "gradsync/algorithm/native.hpp"
#include "gradsync/algorithm/recursive_halving_doubling.hpp"
#include "gradsync/algorithm/ring.hpp"
#include "gradsync/algorithm/tree.hpp"
#include "gradsync/backend/nccl.hpp"
#include "gradsync/collective/all_reduce.hpp"
#include "gradsync/core/endpoint_of.hpp"

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

template <class Algo>
void run_all_reduce(gradsync::Communicator<gradsync::Nccl>& comm, std::span<const float> in, std::span<float> out) {
  gradsync::AllReduce<Algo>{}(comm, in, out);
}

using Runner = void (*)(gradsync::Communicator<gradsync::Nccl>&, std::span<const float>, std::span<float>);

struct Row {
  double busbw_256m = 0;
  double busbw_max = 0;
  long wrong = 0;
};

void rank_main(gradsync::Communicator<gradsync::Nccl>& comm, const Args& args, std::map<std::string, Row>* rows) {
  const int p = comm.size();
  const bool lead = comm.rank() == 0;
  const cudaStream_t stream = gradsync::detail::endpoint_of(comm).stream();
  const std::size_t max_count = args.max_bytes / sizeof(float);
  float *in = nullptr, *out = nullptr;
  check_cuda(cudaMalloc(&in, max_count * sizeof(float)), "cudaMalloc");
  check_cuda(cudaMalloc(&out, max_count * sizeof(float)), "cudaMalloc");
  const std::vector<std::pair<std::string, Runner>> algos = {
      {"native", &run_all_reduce<gradsync::Native>},
      {"ring", &run_all_reduce<gradsync::Ring>},
      {"tree", &run_all_reduce<gradsync::Tree>},
      {"rhd", &run_all_reduce<gradsync::RecursiveHalvingDoubling>},
  };
  const float want = static_cast<float>(p * (p + 1) / 2);
  const double bus = p > 1 ? 2.0 * (p - 1) / p : 1.0;
  for (const auto& [name, run] : algos) {
    if (args.algo != "all" && args.algo != name) continue;
    if (lead) {
      std::printf("#\n# gradsync AllReduce<%s> over Nccl, %d rank(s), float, sum\n", name.c_str(), p);
      std::printf("#%11s %12s %8s %6s %6s  %9s %8s %8s %6s  %9s %8s %8s %6s\n", "size", "count", "type", "redop",
                  "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong");
      std::printf("#%11s %12s %8s %6s %6s  %9s %8s %8s %6s  %9s %8s %8s %6s\n", "(B)", "(elements)", "", "", "",
                  "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "");
    }
    Row& row = (*rows)[name];
    for (std::size_t bytes = args.min_bytes; bytes <= args.max_bytes;
         bytes = std::max(bytes + sizeof(float), static_cast<std::size_t>(static_cast<double>(bytes) * args.factor))) {
      const std::size_t n = bytes / sizeof(float);
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
      const double algbw[2] = {bytes / t[0] / 1e9, bytes / t[1] / 1e9};
      row.wrong += wrong[0] + wrong[1];
      row.busbw_max = algbw[0] * bus;
      if (bytes == (std::size_t{256} << 20)) row.busbw_256m = algbw[0] * bus;
      if (lead) {
        std::printf(" %11zu %12zu %8s %6s %6d  %9.2f %8.2f %8.2f %6ld  %9.2f %8.2f %8.2f %6ld\n", bytes, n, "float", "sum",
                    -1, t[0] * 1e6, algbw[0], algbw[0] * bus, wrong[0], t[1] * 1e6, algbw[1], algbw[1] * bus, wrong[1]);
        std::fflush(stdout);
      }
    }
  }
  if (args.compare && max_count >= (std::size_t{256} << 20) / sizeof(float)) {
    const std::size_t n = (std::size_t{256} << 20) / sizeof(float);
    const int iters = 20;
    comm.barrier();
    const double via = time_on(stream, iters, [&] { run_all_reduce<gradsync::Native>(comm, std::span<const float>(in, n), std::span<float>(out, n)); });
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
  cudaFree(in);
  cudaFree(out);
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) { std::fprintf(stderr, "%s needs a value\n", a.c_str()); std::exit(2); }
      return argv[++i];
    };
    if (a == "--backend") {
      const std::string b = next();
      if (b != "nccl") { std::fprintf(stderr, "nccl_all_reduce_perf runs --backend nccl only, got %s\n", b.c_str()); return 2; }
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
      std::fprintf(stderr, "usage: %s [--backend nccl] [--algo native|ring|tree|rhd|all] [-b 8] [-e 1G] [-f 2] [-w 3] [--no-compare]\n", argv[0]);
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device\n");
    return 77;
  }
  std::vector<int> ids(static_cast<std::size_t>(devices));
  for (int d = 0; d < devices; ++d) ids[static_cast<std::size_t>(d)] = d;
  auto comms = gradsync::nccl_communicators(ids);
  std::vector<std::map<std::string, Row>> rows(comms.size());
  std::vector<std::thread> threads;
  std::atomic<int> rc{0};
  for (std::size_t r = 0; r < comms.size(); ++r) {
    threads.emplace_back([&, r] {
      try {
        check_cuda(cudaSetDevice(ids[r]), "cudaSetDevice");
        rank_main(comms[r], args, &rows[r]);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %zu: %s\n", r, e.what());
        rc = 1;
      }
    });
  }
  for (auto& t : threads) t.join();
  std::printf("#\n# summary (%d GPU%s, float sum, busbw in GB/s)\n", devices, devices > 1 ? "s" : "");
  std::printf("# %-8s %14s %14s %8s\n", "algo", "busbw@256MiB", "busbw@max", "#wrong");
  for (const auto& [name, row] : rows[0]) {
    if (name[0] == '#') continue;
    std::printf("# %-8s %14.2f %14.2f %8ld\n", name.c_str(), row.busbw_256m, row.busbw_max, row.wrong);
    if (row.wrong) rc = 1;
  }
  if (rows[0].count("#overhead_pct")) {
    std::printf("# Native overhead vs ncclAllReduce @256MiB: %+.2f%%\n", rows[0]["#overhead_pct"].busbw_max);
    std::printf("# Thrust reduce vs cudaMemcpy @256MiB:      %.0f%%\n", rows[0]["#reduce_pct"].busbw_max);
  }
  return rc.load();
}
