#pragma once
// What the trainer examples (ddp_mlp, fsdp_mlp, libtorch_ddp) tell about a
// run, from rank 0: how the data and the batch are split over the ranks,
// a line per epoch, a progress line within an epoch when stdout is a
// terminal, and --metrics FILE's JSON lines for tools/plot-training. The
// standard library and POSIX only, so that every example shares it.

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>

#include <unistd.h>

namespace example {

/// How a data-parallel run splits its work: rank 0 prints it before training.
struct RunPlan {
  int ranks = 1;
  std::size_t train_samples = 0;     // the whole training set
  std::size_t samples_per_rank = 0;  // each rank's shard of an epoch (DistributedSampler)
  int batch = 1;                     // per rank
  /// The optimizer and its learning rate: how it was chosen and scaled.
  std::string optimizer;
};

inline void print_plan(const RunPlan& p) {
  const std::size_t effective = std::size_t(p.batch) * std::size_t(p.ranks);
  const std::size_t steps = (p.samples_per_rank + std::size_t(p.batch) - 1) / std::size_t(p.batch);
  std::printf("data parallel: %d ranks x %zu samples (DistributedSampler: each rank its own shard of the %zu, "
              "reshuffled every epoch)\n",
              p.ranks, p.samples_per_rank, p.train_samples);
  std::printf("batch %d per rank, %zu per step over the ranks (gradients averaged), %zu steps per epoch\n", p.batch,
              effective, steps);
  std::printf("%s\n", p.optimizer.c_str());
  std::fflush(stdout);
}

/// "SGD momentum 0.9, learning rate 0.03 at batch 64, scaled linearly to 0.12
/// at batch 256, reached by a linear warm-up over 0.5 epochs (118 steps)".
inline std::string linear_scaling(const char* optimizer, double base_lr, int base_batch, double lr,
                                  std::size_t effective, double warmup_epochs, std::size_t warmup_steps) {
  char s[320];
  int n = std::snprintf(s, sizeof s, "%s, learning rate %.3g at batch %d, scaled linearly to %.3g at batch %zu",
                        optimizer, base_lr, base_batch, lr, effective);
  if (warmup_steps > 0 && n > 0 && std::size_t(n) < sizeof s) {
    std::snprintf(s + n, sizeof s - std::size_t(n), ", reached by a linear warm-up over %g epochs (%zu steps)",
                  warmup_epochs, warmup_steps);
  }
  return s;
}

/// One epoch's figures, summed over the ranks.
struct EpochFigures {
  int epoch = 0;               // 1-based
  double loss = 0;             // mean over the epoch's steps
  double train_accuracy = 0;   // on the batches trained in the epoch, as the step's forward pass scored them
  double test_accuracy = 0;
  double samples = 0;          // trained in the epoch, all ranks
  double seconds = 0;          // the epoch's training steps
  std::string tail;            // the program's own figures
  /// Each rank's samples [first, last) of `of` that the line covers, where
  /// that is not the whole epoch (a resumed run's first, a stopped run's last).
  std::size_t first = 0, last = 0, of = 0;
};

/// An epoch's line, printed by rank 0; one that covers part of its epoch says which part.
inline void print_epoch(const EpochFigures& f) {
  char part[96] = "";
  if (f.first != 0 || f.last != f.of) {
    std::snprintf(part, sizeof part, "  (part of the epoch: samples %zu-%zu of %zu on each rank)", f.first + 1, f.last,
                  f.of);
  }
  std::printf("epoch %2d  loss %.4f  test acc %5.2f%%  train acc %5.2f%%  %7.0f samples/s  %5.2f s%s%s%s\n", f.epoch,
              f.loss, 100 * f.test_accuracy, 100 * f.train_accuracy, f.samples / f.seconds, f.seconds,
              f.tail.empty() ? "" : "  ", f.tail.c_str(), part);
  std::fflush(stdout);
}

/// A line that rewrites itself (carriage return) within an epoch, on rank 0
/// and only when stdout is a terminal: a log or a pipe gets the epoch lines
/// alone. Under mpirun stdout is a terminal that mpirun forwards, often into
/// a file, so there too only the epoch lines.
class Progress {
 public:
  explicit Progress(bool rank0) : on_(rank0 && isatty(fileno(stdout)) == 1 && !under_mpirun()) {}

  /// After a step: `done` of `total` samples of this rank's shard, the running mean loss (this rank's).
  static bool under_mpirun() {
    return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr;
  }

  void update(int epoch, std::size_t done, std::size_t total, double loss) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    // Four times a second: a terminal redrawn every step would cost the step time.
    if (shown_ && now - last_ < std::chrono::milliseconds(250)) return;
    last_ = now;
    shown_ = true;
    std::printf("\repoch %2d  %3.0f%%  %zu of %zu samples on each rank  loss %.4f (rank 0) ", epoch,
                100.0 * double(done) / double(total ? total : 1), done, total, loss);
    std::fflush(stdout);
  }
  /// Erases the line, before the epoch's own.
  void clear() {
    if (!on_ || !shown_) return;
    std::printf("\r\033[K");
    shown_ = false;
  }

 private:
  bool on_;
  bool shown_ = false;
  std::chrono::steady_clock::time_point last_{};
};

/// --metrics FILE: one JSON object per line, rank 0's, flushed as written so
/// that a run cut short keeps its lines. "kind" is "epoch" (after each epoch,
/// with test accuracy) or "step" (every --metrics-every steps: the figures
/// of those steps, across epoch ends, test_acc null). A resumed run keeps
/// the file's lines up to its checkpoint's step and goes on after them, so
/// the file tells one run, as if it had never stopped.
class MetricsFile {
 public:
  struct Line {
    const char* kind = "epoch";
    int epoch = 0;              // 1-based
    std::uint64_t step = 0;     // optimizer steps so far
    double samples_seen = 0;    // all ranks, since the run began
    double loss = 0, train_accuracy = 0;
    double test_accuracy = -1;  // < 0: not measured (null)
    double seconds = 0, samples_per_second = 0;
    /// An epoch line covering part of its epoch: each rank's samples
    /// [first, last) of `of` ("part": [first + 1, last, of]); of = 0: whole.
    std::size_t first = 0, last = 0, of = 0;
  };

  MetricsFile() = default;
  /// Opens `path` (nothing when empty) for a run of `ranks` x `batch` at
  /// learning rate `lr`; for a run resumed at optimizer step `resumed_at`,
  /// the file's lines of steps after it (a run that went on past its last
  /// checkpoint) go, the others stay.
  MetricsFile(const std::string& path, int ranks, int batch, double lr,
              std::optional<std::uint64_t> resumed_at = std::nullopt)
      : ranks_(ranks), batch_(batch), lr_(lr) {
    if (path.empty()) return;
    std::string kept;
    if (resumed_at) {
      std::ifstream in(path);
      for (std::string line; std::getline(in, line);) {
        // The stopped run's line for the part of an epoch it cut short goes
        // too: the resumed run ends that epoch and writes its line.
        const auto step = step_of(line);
        if (step && *step <= *resumed_at && !(*step == *resumed_at && cut_short(line))) kept += line + "\n";
      }
    }
    out_.open(path, std::ios::trunc);
    if (!out_) throw std::runtime_error("--metrics " + path + ": cannot open it for writing");
    out_ << kept << std::flush;
  }
  bool open() const { return out_.is_open(); }
  void set_lr(double lr) { lr_ = lr; }

  void write(const Line& l) {
    if (!open()) return;
    char s[512];
    std::snprintf(s, sizeof s,
                  "{\"kind\": \"%s\", \"epoch\": %d, \"step\": %llu, \"samples\": %.0f, \"loss\": %s, "
                  "\"train_acc\": %s, \"test_acc\": %s, \"seconds\": %.4f, \"samples_per_s\": %.1f, "
                  "\"ranks\": %d, \"batch\": %d, \"lr\": %.6g%s}\n",
                  l.kind, l.epoch, static_cast<unsigned long long>(l.step), l.samples_seen, number(l.loss).c_str(),
                  number(l.train_accuracy).c_str(), l.test_accuracy < 0 ? "null" : number(l.test_accuracy).c_str(),
                  l.seconds, l.samples_per_second, ranks_, batch_, lr_, part(l).c_str());
    out_ << s << std::flush;
  }

 private:
  /// Whether one of write()'s lines covers an epoch up to short of its end
  /// ("part": [first, last, of] with last < of).
  static bool cut_short(const std::string& line) {
    const std::string key = "\"part\": [";
    const auto at = line.find(key);
    if (at == std::string::npos) return false;
    unsigned long long first = 0, last = 0, of = 0;
    return std::sscanf(line.c_str() + at + key.size(), "%llu, %llu, %llu", &first, &last, &of) == 3 && last < of;
  }

  /// The "step" of one of write()'s lines; nothing for another line.
  static std::optional<std::uint64_t> step_of(const std::string& line) {
    const std::string key = "\"step\": ";
    const auto at = line.find(key);
    if (at == std::string::npos) return std::nullopt;
    char* end = nullptr;
    const unsigned long long v = std::strtoull(line.c_str() + at + key.size(), &end, 10);
    if (end == line.c_str() + at + key.size()) return std::nullopt;
    return v;
  }

  /// ', "part": [a, b, c]' for a line covering part of its epoch, else nothing.
  static std::string part(const Line& l) {
    if (l.of == 0 || (l.first == 0 && l.last == l.of)) return {};
    return ", \"part\": [" + std::to_string(l.first + 1) + ", " + std::to_string(l.last) + ", " +
           std::to_string(l.of) + "]";
  }

  /// JSON has no NaN or infinity: a diverged loss is null.
  static std::string number(double x) {
    if (!std::isfinite(x)) return "null";
    char s[32];
    std::snprintf(s, sizeof s, "%.6g", x);
    return s;
  }

  std::ofstream out_;
  int ranks_ = 1, batch_ = 1;
  double lr_ = 0;
};

}  // namespace example
