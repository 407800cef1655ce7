// fsdp_step: a step of every ShardedTrainer strategy against ReplicatedTrainer
// on the same model, in one run: where the time goes, what each rank sends,
// and what it holds against the memory formula. N = 1, 2, 4 ranks on the
// Threads backend, or the mpirun world with --backend mpi.
//
//   fsdp_step [--steps S] [--ranks 1,2,4] [--large-only|--small-only] [--sizes 784,1024,1024,10]
//             [--param-dtype fp32|bf16] [--compute-dtype fp32|bf16] [--reduce-dtype fp32|bf16]
//             [--on-nonfinite throw_error,ignore,...]
//   mpirun -np 4 fsdp_step --backend mpi [...]     (built with MPI)
//
// Models: the MLP 784-1024-1024-10 (1.86M parameters) and 784-2048-2048-2048-10
// (10.0M), or the one --sizes gives; per-rank batch 64, Adam; every
// collective is Ring, so "sent" is exactly what Ring sends.
// Columns (rank 0, mean over S steps after 2 warm-up steps; ms):
//   step      wall time of trainer.step();  xDDP: over ReplicatedTrainer's at this N
//   gather    the progress worker's time in unit all-gathers
//   compute   forward + backward, less the time spent waiting for collectives
//   reduce    the worker's time in gradient reduce-scatters / all-reduces
//   optim     the optimizer step
//   exposed   the rank's thread waiting for collectives; hidden: (gather + reduce) - exposed
//   sent      MB sent per rank per step (all ranks' mean), and the formula's figure:
//             FullShard (N-1)(3Σc - c_root), ShardGradOp 2(N-1)Σc, DDP and NoShard
//             2(N-1)/N·Ψ elements of 4 bytes, c = ⌈P/N⌉ per unit (padding counted)
//   peak      MiB per rank: persistent + the most transient bytes held at once (rank 0),
//             against docs/FSDP.md's formula: DDP (8+S)Ψ, FullShard (8+S)Σc + 4U + 4U,
//             ShardGradOp (8+S)Σc + 4Ψ + 4U (S = 8 for Adam, U the largest unit);
//             with --param-dtype bf16 (gathers in bfloat16, and ShardGradOp keeps
//             its units in it where that holds less) ShardGradOp's is
//             (8+S)Σc + min(2Ψ + 4U, 4Ψ) + 4U: the bfloat16 copies and the unit in
//             use in fp32, or the fp32 units as before; and the gradient buffer.
//             With bfloat16 copies the peak can move to where a second gradient
//             buffer is held (one reduction in flight), up to 4U over this.
//             With --compute-dtype bf16 (the model, BasicEigenMlp<bfloat16>, sees
//             bfloat16 parameters and writes bfloat16 gradients; its arithmetic is
//             float's, one layer widened at a time): DDP and NoShard (8+S)Ψ + 4Ψ (the
//             bfloat16 copies), FullShard (8+S)Σc + 2U + 4U + 2U (the unit, its fp32
//             gradient buffer, the bfloat16 gradient), ShardGradOp (8+S)Σc + 2Ψ + 8U + 2U.
//             With --reduce-dtype bf16 too (reduced from the model's bfloat16 gradient,
//             no fp32 buffer): FullShard (8+S)Σc + 2U + 2U, ShardGradOp (8+S)Σc + 2Ψ + 4U.
//             --reduce-dtype bf16 alone (an fp32 model) reduces in bfloat16 without
//             changing what is held, beyond the worker's packed copies.
// --on-nonfinite times each listed on_nonfinite (both trainers' option) in
// turn, in the order given (repeat them to interleave), and ends each row
// with it; the default is throw_error.
// Exits 1 if any run's bytes differ from the formula (timings are never checked).

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
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using gradsync::ShardingStrategy;

enum class Kind { ddp, no_shard, shard_grad_op, full_shard, hybrid_shard };

const char* name(Kind k) {
  switch (k) {
    case Kind::ddp: return "DDP";
    case Kind::no_shard: return "NoShard";
    case Kind::shard_grad_op: return "ShardGradOp";
    case Kind::full_shard: return "FullShard";
    case Kind::hybrid_shard: return "Hybrid2x";
  }
  return "?";
}

struct Row {
  double step = 0, gather = 0, compute = 0, reduce = 0, optimizer = 0, exposed = 0;
  double sent_all = 0;  ///< elements, all ranks, per step
  std::size_t peak = 0;
};

/// Unit sizes of the MLP: out·in + out per layer.
std::vector<std::size_t> unit_sizes(const std::vector<int>& sizes) {
  std::vector<std::size_t> u;
  for (std::size_t l = 0; l + 1 < sizes.size(); ++l) u.push_back(std::size_t(sizes[l + 1]) * std::size_t(sizes[l] + 1));
  return u;
}

/// Elements all ranks send per step by the formula (Ring's schedule).
double sent_formula(Kind k, const std::vector<std::size_t>& units, std::size_t n) {
  std::size_t psi = 0;
  for (const std::size_t p : units) psi += p;
  auto chunks = [&](std::size_t ranks) {
    std::size_t c = 0;
    for (const std::size_t p : units) c += (p + ranks - 1) / ranks;
    return c;
  };
  auto root = [&](std::size_t ranks) { return (units.back() + ranks - 1) / ranks; };
  switch (k) {
    case Kind::ddp:
    case Kind::no_shard: return 2.0 * double(n - 1) * double(psi);
    case Kind::shard_grad_op: return double(n) * 2.0 * double(n - 1) * double(chunks(n));
    case Kind::full_shard: return double(n) * double(n - 1) * double(3 * chunks(n) - root(n));
    case Kind::hybrid_shard: {
      // Groups of 2: FullShard in the pair, then each shard all-reduced across n/2 replicas.
      const std::size_t r = n / 2;
      return double(n) * double(3 * chunks(2) - root(2)) + 2.0 * 2.0 * double(r - 1) * double(chunks(2));
    }
  }
  return 0;
}

/// What a run sets: param_dtype and reduce_dtype bfloat16, a model computing in bfloat16.
struct Precision {
  bool params = false, reduce = false, compute = false;
};

/// docs/FSDP.md's memory per rank, Adam (S = 8 bytes per element), U the largest unit.
double memory_formula(Kind k, const std::vector<std::size_t>& units, std::size_t n, const Precision& p) {
  const bool bf16 = p.params, bf16_compute = p.compute;
  std::size_t psi = 0, u_max = 0, c = 0;
  const std::size_t s = k == Kind::hybrid_shard ? 2 : n;
  for (const std::size_t u : units) {
    psi += u;
    u_max = std::max(u_max, u);
    c += (u + s - 1) / s;
  }
  if (bf16_compute) {
    switch (k) {
      case Kind::ddp:
      case Kind::no_shard: return 20.0 * double(psi);
      case Kind::shard_grad_op:
        return 16.0 * double(c) + 2.0 * double(psi) + (p.reduce && n > 1 ? 4.0 : 10.0) * double(u_max);
      case Kind::full_shard:
      case Kind::hybrid_shard: return 16.0 * double(c) + (p.reduce && n > 1 ? 4.0 : 8.0) * double(u_max);
    }
  }
  switch (k) {
    case Kind::ddp:
    case Kind::no_shard: return 16.0 * double(psi);
    case Kind::shard_grad_op: {
      // bfloat16 copies are kept only where they hold less than fp32 ones (detail::keeping_bf16_pays).
      const double fp32 = 4.0 * double(psi), kept = 2.0 * double(psi) + 4.0 * double(u_max);
      return 16.0 * double(c) + (bf16 ? std::min(kept, fp32) : fp32) + 4.0 * double(u_max);
    }
    case Kind::full_shard:
    case Kind::hybrid_shard: return 16.0 * double(c) + 8.0 * double(u_max);
  }
  return 0;
}

template <class Comm, class Trainer>
Row run(Comm& comm, Trainer& trainer, const example::Batch& b, int steps) {
  for (int i = 0; i < 2; ++i) trainer.step(b);
  if constexpr (requires { trainer.reset_peak_transient(); }) trainer.reset_peak_transient();
  comm.barrier();
  Row row;
  double sent = 0;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    trainer.step(b);
    row.step += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const gradsync::StepStats s = trainer.last_step();
    row.gather += s.gather_seconds;
    row.compute += s.compute_seconds;
    row.reduce += s.reduce_seconds;
    row.optimizer += s.optimizer_seconds;
    row.exposed += s.exposed_comm_seconds;
    sent += double(s.sent_elements);
  }
  for (double* x : {&row.step, &row.gather, &row.compute, &row.reduce, &row.optimizer, &row.exposed}) *x /= steps;
  sent /= steps;
  gradsync::AllReduce<gradsync::Ring>{}(comm, std::span<double>(&sent, 1), gradsync::Sum{});
  row.sent_all = sent;
  row.peak = trainer.persistent_bytes() + trainer.peak_transient_bytes();
  return row;
}

/// One kind on `comm`'s ranks, with model type Model; the row is rank 0's.
template <class Model, class Comm>
Row measure_model(Comm& comm, Kind kind, const std::vector<int>& sizes, int steps, const Precision& p,
                  gradsync::OnNonfinite on_nonfinite) {
  const gradsync::FlushDenormals flush(true);
  const bench::RandomBatch data(sizes, comm.rank());
  const example::Batch b = data.batch();
  const gradsync::Adam<float> adam({.lr = 1e-3});
  if (kind == Kind::ddp) {
    gradsync::ReplicatedTrainerOptions r;
    r.on_nonfinite = on_nonfinite;
    gradsync::ReplicatedTrainer<Model, gradsync::Adam<float>, Comm, gradsync::Ring> trainer(comm, Model(sizes, 1),
                                                                                            adam, r);
    return run(comm, trainer, b, steps);
  }
  gradsync::ShardedTrainerOptions o;
  o.on_nonfinite = on_nonfinite;
  o.strategy = kind == Kind::no_shard        ? ShardingStrategy::NoShard
               : kind == Kind::shard_grad_op ? ShardingStrategy::ShardGradOp
               : kind == Kind::full_shard    ? ShardingStrategy::FullShard
                                             : ShardingStrategy::HybridShard;
  if (kind == Kind::hybrid_shard) o.shard_size = 2;
  if (p.params) o.param_dtype = gradsync::DataType::bfloat16;
  if (p.reduce) o.reduce_dtype = gradsync::DataType::bfloat16;
  gradsync::ShardedTrainer<Model, gradsync::Adam<float>, Comm, gradsync::Ring> trainer(comm, Model(sizes, 1), adam, o);
  return run(comm, trainer, b, steps);
}

template <class Comm>
Row measure(Comm& comm, Kind kind, const std::vector<int>& sizes, int steps, const Precision& p,
            gradsync::OnNonfinite on_nonfinite) {
  if (p.compute) {
    return measure_model<example::BasicEigenMlp<gradsync::bfloat16>>(comm, kind, sizes, steps, p, on_nonfinite);
  }
  return measure_model<example::EigenMlp>(comm, kind, sizes, steps, p, on_nonfinite);
}

/// Prints a row, ending with `policy` (the on_nonfinite it ran under) unless
/// null; returns false if its bytes differ from the formula.
bool print_row(int n, Kind kind, const Row& r, double ddp_step, const std::vector<std::size_t>& units,
               const Precision& p, const char* policy) {
  const auto ranks = static_cast<std::size_t>(n);
  const double formula = sent_formula(kind, units, ranks);
  const bool exact = r.sent_all == formula;
  const double mem = memory_formula(kind, units, ranks, p);
  const double mb = 4.0 / double(n) / 1e6;
  std::printf("%3d  %-11s %8.2f %5.2f %8.2f %8.2f %8.2f %7.2f %8.2f %8.2f %8.2f %8.2f%s %8.1f %8.1f %5.3f", n,
              name(kind), 1e3 * r.step, ddp_step > 0 ? r.step / ddp_step : 1.0, 1e3 * r.gather, 1e3 * r.compute,
              1e3 * r.reduce, 1e3 * r.optimizer, 1e3 * r.exposed,
              1e3 * std::max(0.0, r.gather + r.reduce - r.exposed), r.sent_all * mb, formula * mb, exact ? " " : "!",
              double(r.peak) / 1048576.0, mem / 1048576.0, double(r.peak) / mem);
  if (policy != nullptr) std::printf("  %s", policy);
  std::printf("\n");
  std::fflush(stdout);
  return exact;
}

constexpr const char* usage_text =
    "usage: fsdp_step [--backend threads|mpi] [--steps S] [--ranks 1,2,4] [--large-only|--small-only]\n"
    "                 [--sizes 784,1024,1024,10] [--param-dtype fp32|bf16] [--compute-dtype fp32|bf16]\n"
    "                 [--reduce-dtype fp32|bf16] [--on-nonfinite throw_error|skip_step|ignore[,...]]\n";

std::vector<Kind> kinds_for(int n) {
  std::vector<Kind> k{Kind::ddp, Kind::no_shard, Kind::shard_grad_op, Kind::full_shard};
  if (n >= 4 && n % 2 == 0) k.push_back(Kind::hybrid_shard);
  return k;
}

void header(const std::vector<int>& m, const char* backend, int steps, const Precision& p) {
  auto type = [](bool is_bf16) { return is_bf16 ? "bfloat16" : "fp32"; };
  std::printf(
      "# %s, per-rank batch 64, Adam, Ring, %s, param_dtype %s, reduce_dtype %s, compute %s, %d steps; ms per step "
      "(rank 0)\n",
      bench::describe(m).c_str(), backend, type(p.params), type(p.reduce), type(p.compute), steps);
  // The sent columns count elements (as StepStats does) at 4 bytes.
  if (p.params || p.reduce) std::printf("# sent: elements x 4 B; those in bfloat16 collectives move 2 B each\n");
  std::printf("#  N trainer         step   xDDP   gather  compute   reduce   optim  exposed   hidden  sent MB  "
              "formula  peakMiB  formula  ratio\n");
}

}  // namespace

int main(int argc, char** argv) {
  Eigen::setNbThreads(1);
  Precision precision;
  const bench::StepOptions opt = bench::parse_step_options(
      argc, argv, "fsdp_step", usage_text, 10, [&](const std::string& key, const char* value, bool& consumed) {
        bool* flag = key == "--param-dtype"     ? &precision.params
                     : key == "--reduce-dtype"  ? &precision.reduce
                     : key == "--compute-dtype" ? &precision.compute
                                                : nullptr;
        if (flag == nullptr) return false;
        const std::string v = value ? value : "";
        if (v != "fp32" && v != "bf16") bench::usage("fsdp_step", usage_text, key + " takes fp32 or bf16");
        *flag = v == "bf16";
        consumed = true;
        return true;
      });
  // A model computing in bfloat16 is gathered in it.
  if (precision.compute) precision.params = true;
  const int steps = opt.steps;
  const std::string& backend = opt.backend;
  const std::vector<std::vector<int>> models = opt.models();
  // The large model is measured over fewer steps: each is ~5x the small one's.
  auto steps_for = [&](const std::vector<int>& m) { return m.size() > 4 ? std::max(3, steps / 3) : steps; };
  bool all_exact = true;
  auto policy_name = [&](gradsync::OnNonfinite p) { return opt.on_nonfinite_given ? gradsync::name(p) : nullptr; };

  if (backend == "threads") {
    for (const auto& m : models) {
      const int s = steps_for(m);
      header(m, "Threads", s, precision);
      for (const int n : opt.ranks) {
        for (const gradsync::OnNonfinite policy : opt.on_nonfinite) {
          double ddp = 0;
          for (const Kind kind : kinds_for(n)) {
            Row row;
            gradsync::run_threads(n, [&](gradsync::Communicator<gradsync::Threads>& comm) {
              const Row r = measure(comm, kind, m, s, precision, policy);
              if (comm.rank() == 0) row = r;
            });
            if (kind == Kind::ddp) ddp = row.step;
            all_exact = print_row(n, kind, row, ddp, unit_sizes(m), precision, policy_name(policy)) && all_exact;
          }
        }
      }
    }
  } else {
#ifdef GRADSYNC_HAVE_MPI
    gradsync::Communicator<gradsync::Mpi> comm(MPI_COMM_WORLD);
    for (const auto& m : models) {
      const int s = steps_for(m);
      if (comm.rank() == 0) header(m, "Mpi", s, precision);
      for (const gradsync::OnNonfinite policy : opt.on_nonfinite) {
        double ddp = 0;
        for (const Kind kind : kinds_for(comm.size())) {
          const Row row = measure(comm, kind, m, s, precision, policy);
          if (kind == Kind::ddp) ddp = row.step;
          if (comm.rank() == 0) {
            all_exact =
                print_row(comm.size(), kind, row, ddp, unit_sizes(m), precision, policy_name(policy)) && all_exact;
          }
        }
      }
    }
    int bad = all_exact ? 0 : 1;
    gradsync::AllReduce<>{}(comm, std::span<int>(&bad, 1), gradsync::Max{});
    all_exact = bad == 0;
#endif
  }
  if (!all_exact) {
    std::fprintf(stderr, "fsdp_step: bytes sent differ from the formula where marked '!'\n");
    return 1;
  }
}
