#pragma once
// What the example programs (and bench/'s step tools) share around their
// training code: reading options, the threads-or-mpirun choice and the
// program's last line. Built with GRADSYNC_HAVE_MPI, it reaches the Mpi
// backend too; otherwise --backend mpi is refused with how to get it.

#include <gradsync/collectives.hpp>
#ifdef GRADSYNC_HAVE_MPI
#include <gradsync/backend/mpi.hpp>
#endif

#include "parse_number.hpp"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>

namespace example {

/// Walks argv one option at a time; every bad value throws, naming its option.
class ArgReader {
 public:
  ArgReader(int argc, char** argv) : argc_(argc), argv_(argv) {}

  /// Moves to the next option; false past the last.
  bool next() {
    if (++i_ >= argc_) return false;
    key_ = argv_[i_];
    return true;
  }
  const std::string& key() const { return key_; }

  /// The option's value; an empty one (`--resume "$DIR"` with DIR unset)
  /// is refused, not read as the option left out.
  std::string value() {
    if (i_ + 1 >= argc_) throw std::runtime_error(key_ + " needs a value");
    std::string v = argv_[++i_];
    if (v.empty()) throw std::runtime_error(key_ + " needs a value, got an empty one");
    return v;
  }
  /// A whole non-negative number (digits first: stoull would skip spaces
  /// and take " -5" as 2^64 - 5).
  std::uint64_t count() {
    const std::string v = value();
    const std::optional<std::uint64_t> n = parse_whole<std::uint64_t>(v);
    if (!n || !std::isdigit(static_cast<unsigned char>(v[0]))) bad(v);
    return *n;
  }
  /// A count small enough for an int: at most 2^20, refused above.
  int small() {
    const std::uint64_t n = count();
    if (n > (1u << 20)) throw std::runtime_error(key_ + " " + std::to_string(n) + " is more than 1048576");
    return static_cast<int>(n);
  }
  /// A finite number: no option means anything by nan or inf (a NaN
  /// --warmup passed the sign check and held the learning rate near 0).
  double real() {
    const std::string v = value();
    const std::optional<double> x = parse_whole<double>(v);
    if (!x || !std::isfinite(*x)) bad(v);
    return *x;
  }
  double non_negative() {
    const double x = real();
    if (x < 0) throw std::runtime_error(key_ + " must not be negative");
    return x;
  }

 private:
  [[noreturn]] void bad(const std::string& v) const {
    throw std::runtime_error("bad value for " + key_ + ": '" + v + "'");
  }

  int argc_;
  char** argv_;
  int i_ = 0;
  std::string key_;
};

/// A number as --help shows a default: the shortest form (0.05, 2024).
inline std::string shown(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

/// Where `r`'s current option asks for the usage (--help, -h), `print()`
/// writes it to stdout and the program ends with status 0.
template <class Print>
void exit_on_help(const ArgReader& r, Print print) {
  if (r.key() != "--help" && r.key() != "-h") return;
  print();
  std::fflush(stdout);
  std::exit(0);
}

/// The options every example takes; each program sets its own defaults.
struct RunArgs {
  std::string backend = "threads";
  int ranks = 4, epochs = 1, batch = 64, hidden = 128;
  bool ranks_given = false;
  double lr = 0.05, target = 0;
  // Epochs (a fraction is fine) over which the learning rate rises linearly
  // from near 0 to its scaled value (Goyal et al.'s warm-up): large scaled
  // rates diverge in the first steps, where the gradients are largest.
  double warmup = 0;
  std::size_t train_samples = 0, test_samples = 0;
  std::uint64_t seed = 1;
  // --seed seeds the built-in data always; given, it also seeds the initial
  // weights and the sampler's shuffle, which otherwise stay fixed (100 + rank
  // and 7) so that the default runs keep their documented figures.
  bool seed_given = false;
  std::uint64_t weights_seed(int rank) const { return (seed_given ? seed * 1000 : 100) + std::uint64_t(rank); }
  std::uint64_t shuffle_seed() const { return seed_given ? seed : 7; }
  // The data: --data DIR (--mnist DIR, its older name) or --dataset NAME;
  // neither: Fashion-MNIST where installed (examples/data_source.hpp).
  std::string data{}, dataset{};
  /// A program's defaults for IDX data, where they differ from the built-in
  /// data's (0: the same); --lr, --warmup and --target override them.
  struct IdxDefaults {
    double lr = 0, warmup = 0, target = 0;
  };
  IdxDefaults idx{};
  bool lr_given = false, warmup_given = false, target_given = false;

  // --metrics FILE: rank 0's JSON lines, one per epoch, and one per
  // --metrics-every steps (0: none) (examples/report.hpp).
  std::string metrics{};
  std::uint64_t metrics_every = 0;

  // Checkpoints: the directory to save to (each program says when) and the
  // one to resume from; empty: none.
  std::string save{}, resume{};

  static constexpr const char* names = "--backend --ranks --epochs --batch --hidden --lr --target --train-samples "
                                       "--test-samples --seed --data --mnist --dataset --metrics --metrics-every --warmup "
                                       "--save --resume";

  /// Takes `r`'s current option if every example has it: where and how it
  /// trains and its checkpoints (--backend --ranks --epochs --batch --lr
  /// --seed --save --resume). libtorch_fsdp, which has no MLP and no image
  /// data, takes only these of `names`.
  bool read_run(ArgReader& r) {
    const std::string& k = r.key();
    if (k == "--backend") backend = r.value();
    else if (k == "--ranks") ranks = r.small(), ranks_given = true;
    else if (k == "--epochs") epochs = r.small();
    else if (k == "--batch") batch = r.small();
    else if (k == "--lr") lr = r.non_negative(), lr_given = true;
    else if (k == "--seed") seed = r.count(), seed_given = true;
    else if (k == "--save") save = r.value();
    else if (k == "--resume") resume = r.value();
    else return false;
    return true;
  }

  /// --help's lines for read_run's options but --seed, with this program's defaults.
  std::string run_help() const {
    return "  --backend threads|mpi  ranks as threads of this process, or one per process under mpirun (" + backend +
           ")\n"
           "  --ranks N              ranks under --backend threads (" + std::to_string(ranks) + ")\n"
           "  --epochs N             passes over the training data (" + std::to_string(epochs) + ")\n"
           "  --batch B              samples per rank in a step (" + std::to_string(batch) + ")\n"
           "  --lr X                 learning rate (" + shown(lr) +
           (idx.lr > 0 ? "; " + shown(idx.lr) + " on IDX data" : "") + ")\n"
           "  --save DIR             write a checkpoint to DIR\n"
           "  --resume DIR           continue from the checkpoint in DIR\n";
  }

  /// --help's lines for read()'s other options (the MLP examples').
  std::string data_help() const {
    return "  --seed S               seeds the built-in data and, given, the initial weights and the shuffle (" +
           std::to_string(seed) + ")\n"
           "  --hidden H             width of each hidden layer (" + std::to_string(hidden) + ")\n"
           "  --warmup E             epochs over which the learning rate rises linearly to its value (" +
           shown(warmup) + (idx.warmup > 0 ? "; " + shown(idx.warmup) + " on IDX data" : "") + ")\n"
           "  --target A             test accuracy to reach, a fraction; below it the run exits 1 (" + shown(target) +
           (idx.target > 0 ? "; " + shown(idx.target) + " on IDX data" : "") + ")\n"
           "  --train-samples N      training samples to use, 0 for all (" + std::to_string(train_samples) + ")\n"
           "  --test-samples N       test samples to use, 0 for all (" + std::to_string(test_samples) + ")\n"
           "  --data DIR             MNIST-layout IDX files, plain or .gz (--mnist DIR: the same)\n"
           "  --dataset NAME         fashion-mnist or synthetic (default: Fashion-MNIST where installed)\n"
           "  --metrics FILE         rank 0's figures as JSON lines, one per epoch\n"
           "  --metrics-every N      and one every N steps (" + std::to_string(metrics_every) + ": none)\n";
  }

  /// Takes `r`'s current option if it is one of `names`.
  bool read(ArgReader& r) {
    if (read_run(r)) return true;
    const std::string& k = r.key();
    if (k == "--hidden") hidden = r.small();
    else if (k == "--target") target = r.non_negative(), target_given = true;
    else if (k == "--train-samples") train_samples = r.count();
    else if (k == "--test-samples") test_samples = r.count();
    else if (k == "--data" || k == "--mnist") data = r.value();
    else if (k == "--dataset") dataset = r.value();
    else if (k == "--metrics") metrics = r.value();
    else if (k == "--metrics-every") metrics_every = r.count();
    else if (k == "--warmup") warmup = r.non_negative(), warmup_given = true;
    else return false;
    return true;
  }

  /// Reads every option: these, then `extra(r)` for the program's own
  /// (false: not one of `extra_names`, which `extra_help` explains for
  /// --help); then checks them.
  template <class Extra>
  void parse(int argc, char** argv, const char* program, const std::string& extra_names, Extra extra,
             const std::string& extra_help = "") {
    for (ArgReader r(argc, argv); r.next();) {
      exit_on_help(r, [&] {
        std::printf("usage: %s [options]\n%s%s%s", program, run_help().c_str(), data_help().c_str(),
                    extra_help.c_str());
      });
      if (read(r) || extra(r)) continue;
      throw std::runtime_error("unknown option " + r.key() + " (expected " + names + extra_names + ")");
    }
    check(program);
  }

  /// The steps --warmup spans, for a shard of `samples_per_rank` per epoch.
  std::size_t warmup_steps(std::size_t samples_per_rank) const {
    const std::size_t per_epoch = (samples_per_rank + std::size_t(batch) - 1) / std::size_t(batch);
    return static_cast<std::size_t>(std::ceil(warmup * double(per_epoch)));
  }

  /// Takes the defaults for IDX data (`synthetic` false) where no option set them.
  void defaults_for(bool synthetic) {
    if (synthetic) return;
    if (!lr_given && idx.lr > 0) lr = idx.lr;
    if (!warmup_given && idx.warmup > 0) warmup = idx.warmup;
    if (!target_given && idx.target > 0) target = idx.target;
  }

  /// Positive sizes, and --backend threads (--ranks of them) or mpi (one rank
  /// per mpirun process), checked before any data is built.
  void check(const char* program) const {
    if (ranks < 1 || epochs < 1 || batch < 1 || hidden < 1) {
      throw std::runtime_error("--ranks, --epochs, --batch and --hidden must be at least 1");
    }
    if (target > 1) {
      throw std::runtime_error("--target " + std::to_string(target) + ": a test accuracy is a fraction in [0, 1] "
                               "(0.88 for 88%)");
    }
    if (backend != "threads" && backend != "mpi") {
      throw std::runtime_error("unknown backend '" + backend + "' (expected threads or mpi)");
    }
    if (backend == "mpi" && ranks_given) {
      throw std::runtime_error("--ranks is for the threads backend; under --backend mpi the world size is mpirun's -np");
    }
#ifndef GRADSYNC_HAVE_MPI
    if (backend == "mpi") {
      throw std::runtime_error(std::string("--backend mpi: this ") + program +
                               " was built without MPI; install it (e.g. libopenmpi-dev) and reconfigure with meson "
                               "option -Dmpi=enabled");
    }
#else
    (void)program;
#endif
  }
};

/// The warm-up's share of the learning rate at step `step` (from 0) of a
/// run warming up over `steps`: rising linearly, 1 from step `steps` on.
inline double warmed(std::size_t step, std::size_t steps) {
  return step >= steps ? 1.0 : double(step + 1) / double(steps + 1);
}

/// Set by a run that --max-steps stopped before its last epoch ended: its
/// accuracy is that of a run cut short, not one that missed its target.
inline std::atomic<bool> halted_by_max_steps{false};

/// What a training run ends with: rank 0's accuracy, whether this process
/// prints, and whether --max-steps stopped it before its end.
struct Outcome {
  double accuracy = 0;
  bool printer = true;
  bool halted = false;
};

/// Runs `train(comm)` (returning the test accuracy) on `ranks` threads, or on
/// the mpirun world under --backend mpi; MPI starts only then, so a threads
/// run needs no mpirun.
template <class Train>
Outcome run_on_backend(const std::string& backend, int ranks, Train train) {
  Outcome out;
  if (backend == "threads") {
    gradsync::run_threads(ranks, [&](gradsync::Communicator<gradsync::Threads>& comm) {
      const double a = train(comm);
      if (comm.rank() == 0) out.accuracy = a;
    });
  } else {
#ifdef GRADSYNC_HAVE_MPI
    gradsync::Communicator<gradsync::Mpi> comm(MPI_COMM_WORLD);
    out.printer = comm.rank() == 0;
    out.accuracy = train(comm);
#endif
  }
  out.halted = halted_by_max_steps.load();
  return out;
}

/// The last line, and the exit code: 0 when the target was reached, or
/// when --max-steps stopped the run before its end (--resume goes on).
inline int finish(const Outcome& o, double target, const std::string& tail = "") {
  if (o.halted) {
    if (o.printer) {
      std::printf("stopped by --max-steps: test accuracy %.2f%% so far (target %.0f%% at the end)%s\n",
                  100 * o.accuracy, 100 * target, tail.c_str());
    }
    return 0;
  }
  const bool ok = o.accuracy >= target;
  if (o.printer) {
    std::printf("%s: test accuracy %.2f%% (target %.0f%%)%s\n", ok ? "reached" : "MISSED", 100 * o.accuracy,
                100 * target, tail.c_str());
  }
  return ok ? 0 : 1;
}

/// What main returns after an exception (a bad option, a file it cannot
/// read): one line on stderr, "program: what went wrong", and exit code 2,
/// which the tests tell apart from 1 (target missed).
inline int exit_error(const char* program, const char* what) {
  std::fprintf(stderr, "%s: %s\n", program, what);
  return 2;
}

/// Refuses (every rank alike) more ranks than training samples, and a batch
/// larger than a rank's share of them: the linear-scaling rule would scale
/// the learning rate for a batch that no step takes.
inline void check_share(std::size_t per_rank, std::size_t samples, int ranks, int batch) {
  if (std::size_t(ranks) > samples) {
    throw std::runtime_error(std::to_string(ranks) + " ranks for " + std::to_string(samples) +
                             " training samples: use at most one rank per sample");
  }
  if (std::size_t(batch) > per_rank) {
    throw std::runtime_error("--batch " + std::to_string(batch) + " is more than each rank's " +
                             std::to_string(per_rank) + " training samples");
  }
}

}  // namespace example
