#pragma once
// The epochs the trainer examples (ddp_mlp, fsdp_mlp) run, and how they
// resume them from a checkpoint: the same for either trainer, so that a
// resumed run continues at the very step, epoch and sample it stopped at.

// First: eigen_dense.hpp's pragma reaches the intrinsics header only if nothing included it before.
#include "eigen_mlp.hpp"

#include <gradsync/gradsync.hpp>
#include <gradsync/train/checkpoint/replicated_checkpoint.hpp>

#include "cli.hpp"
#include "dataset.hpp"
#include "report.hpp"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace example {

/// What `program`'s checkpoint records of its run, and a resume must match:
/// the data (`<program>.data`), the batch (`.batch`) and, where a checkpoint
/// is written or read, a CRC-32 of the training set (`.data_values`: a
/// directory may hold other files by the resume).
inline gradsync::checkpoint::Metadata run_to_match(const std::string& program, const DataChoice& data,
                                                   const Dataset& train, const RunArgs& args) {
  gradsync::checkpoint::Metadata same{{program + ".data", data.identity(args.seed)},
                                      {program + ".batch", std::to_string(args.batch)}};
  if (!args.save.empty() || !args.resume.empty()) same[program + ".data_values"] = content_checksum(train);
  return same;
}

/// Loads the checkpoint at `path` into `trainer` and `sampler`. Rank 0
/// prints where it resumed (naming the file as `shown`) and a note when the
/// checkpoint's run planned other --epochs (recorded under `epochs_key`):
/// the learning-rate schedule then differs. What `same` holds (the data,
/// the batch) must be what the checkpoint's run recorded under those keys,
/// or every rank throws: training on goes on from the state of another run.
template <class Trainer>
void resume(Trainer& trainer, gradsync::DistributedSampler& sampler, const std::string& path, const std::string& shown,
            const std::string& epochs_key, int epochs, const gradsync::checkpoint::Metadata& same = {}) {
  const auto t = std::chrono::steady_clock::now();
  const auto meta = gradsync::load_checkpoint(trainer, sampler, path);
  for (const auto& [key, value] : same) {
    // A checkpoint that records no such key predates it: accepted.
    if (const auto it = meta.find(key); it != meta.end() && it->second != value) {
      throw std::runtime_error("--resume " + path + ": the checkpoint's run had " + key + " = '" + it->second +
                               "', this one '" + value + "'; resume with the same data and --batch");
    }
  }
  if (trainer.communicator().rank() != 0) return;
  std::printf("resumed from %s in %.2f s: step %zu, epoch %llu, sample %zu of %zu on each rank\n", shown.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count(), trainer.step_count(),
              static_cast<unsigned long long>(sampler.epoch() + 1), sampler.position(), sampler.num_samples());
  if (const auto it = meta.find(epochs_key); it != meta.end() && it->second != std::to_string(epochs)) {
    std::printf("note: the checkpoint's run planned --epochs %s, this one %d: the learning-rate schedule differs\n",
                it->second.c_str(), epochs);
  }
}

/// What an example does around the steps of an epoch besides training.
struct EpochHooks {
  /// Called as each epoch starts.
  std::function<void()> start = [] {};
  /// Called after each step.
  std::function<void()> after_step = [] {};
  /// This rank's communication seconds in the epoch so far: {all of it, exposed}.
  std::function<std::pair<double, double>()> comm_seconds;
  /// Called as each epoch ends, after its line: e.g. a checkpoint.
  std::function<void()> end = [] {};
};

/// Why a resumed run has no step left to take, or "" when it has one: its
/// checkpoint is at the end of epoch `epochs` or past it, or at `max_steps`
/// (0: none) or past it. `first_epoch` is the 0-based epoch it would start in.
inline std::string nothing_left(const gradsync::DistributedSampler& sampler, int first_epoch, int epochs,
                                std::size_t steps, std::uint64_t max_steps) {
  if (first_epoch >= epochs) {
    const std::uint64_t at = sampler.epoch() + 1;
    return "the checkpoint is at epoch " + std::to_string(at) +
           (at == std::uint64_t(epochs) ? " of " : ", past --epochs ") + std::to_string(epochs);
  }
  if (max_steps && steps >= max_steps) {
    return "the checkpoint is at step " + std::to_string(steps) + (steps == max_steps ? ", " : ", past ") +
           "--max-steps " + std::to_string(max_steps);
  }
  return "";
}

/// Trains from where `sampler` stands to the end of epoch `args.epochs` and
/// returns the last epoch's test accuracy (the same on every rank). A
/// resumed run starts in the epoch it stopped in, at the sample after the
/// last one it took; `max_steps` (0: none) stops the run mid-epoch, counting
/// the steps a resumed run took before. Each epoch's learning rate decays by
/// a cosine from `lr`; at its end rank 0 prints the epoch's line, with the
/// figures summed over all ranks (test accuracy: rank r scores its
/// contiguous share of `test`; train accuracy: the epoch's batches as their
/// steps' forward passes scored them, before each update), and writes
/// --metrics lines. A run resumed where nothing is left to train says so
/// and returns its model's test accuracy.
template <class Comm, class Trainer>
double train_epochs(Comm& comm, Trainer& trainer, gradsync::DistributedSampler& sampler, const Dataset& train,
                    const Dataset& test, const RunArgs& args, double lr, std::uint64_t max_steps,
                    const EpochHooks& hooks) {
  // Aligned as Eigen vectorizes best, and alike in every run: with another
  // alignment Eigen sums in another order, and a resumed run would drift
  // from an uninterrupted one in the last bits.
  std::vector<float, Eigen::aligned_allocator<float>> xb(std::size_t(args.batch) * train.dim);
  std::vector<int> yb(args.batch);
  const auto n = static_cast<std::size_t>(comm.size()), rank = static_cast<std::size_t>(comm.rank());
  const std::size_t test_begin = test.size() * rank / n, test_end = test.size() * (rank + 1) / n;
  bool stopped = false;
  const int first_epoch = static_cast<int>(sampler.epoch()) + (sampler.position() == sampler.num_samples() ? 1 : 0);
  if (const std::string why = nothing_left(sampler, first_epoch, args.epochs, trainer.step_count(), max_steps);
      !why.empty()) {
    if (rank == 0) {
      std::printf("nothing to train: %s\n", why.c_str());
      std::fflush(stdout);
    }
    // Held by --max-steps before the last epoch's end: still a run cut short.
    if (first_epoch < args.epochs) halted_by_max_steps = true;
    std::vector<double> correct{double(count_correct(trainer, test, test_begin, test_end))};
    gradsync::AllReduce<>{}(comm, std::span<double>(correct), gradsync::Sum{});
    return correct[0] / double(test.size());
  }
  Progress progress(rank == 0);
  MetricsFile metrics(rank == 0 ? args.metrics : "", comm.size(), args.batch, lr,
                      args.resume.empty() ? std::nullopt : std::optional<std::uint64_t>(trainer.step_count()));
  // Every rank takes part in a step line's sums, so every rank counts the steps.
  const std::uint64_t every = args.metrics.empty() ? 0 : args.metrics_every;
  // Counted from the run's first step: a resumed run goes on with the warm-up where it was.
  const std::size_t warmup_steps = args.warmup_steps(sampler.num_samples());
  double accuracy = 0;
  // Since the last step line, across epoch ends: loss, steps, right,
  // samples, and the seconds of the steps (evaluations left out).
  std::vector<double> window(4, 0.0);
  double window_seconds = 0;
  for (int epoch = first_epoch; epoch < args.epochs && !stopped; ++epoch) {
    sampler.set_epoch(epoch);
    const double epoch_lr = lr * 0.5 * (1 + std::cos(3.141592653589793 * epoch / args.epochs));
    trainer.optimizer().set_lr(epoch_lr);
    metrics.set_lr(epoch_lr);
    const auto idx = sampler.indices();
    hooks.start();
    const auto t0 = std::chrono::steady_clock::now();
    double loss_sum = 0;
    std::int64_t steps = 0, right = 0;
    auto window_start = t0;
    const std::size_t first_sample = sampler.position();
    for (std::size_t at = first_sample; at < idx.size(); at += args.batch) {
      const int b = static_cast<int>(std::min<std::size_t>(args.batch, idx.size() - at));
      fill_batch(train, idx, at, b, xb.data(), yb.data());
      if (warmup_steps && trainer.step_count() <= warmup_steps) {
        const double step_lr = epoch_lr * warmed(trainer.step_count(), warmup_steps);
        trainer.optimizer().set_lr(step_lr);
        metrics.set_lr(step_lr);
      }
      const double loss = trainer.step(Batch{xb.data(), yb.data(), b});
      const int ok = trainer.model().last_correct();
      loss_sum += loss;
      right += ok;
      hooks.after_step();
      sampler.advance(std::size_t(b));
      ++steps;
      progress.update(epoch + 1, sampler.position(), sampler.num_samples(), loss_sum / double(steps));
      if (every) {
        window[0] += loss, window[1] += 1, window[2] += ok, window[3] += b;
        if (trainer.step_count() % every == 0) {
          gradsync::AllReduce<>{}(comm, std::span<double>(window), gradsync::Sum{});
          const auto now = std::chrono::steady_clock::now();
          const double s = window_seconds + std::chrono::duration<double>(now - window_start).count();
          metrics.write({.kind = "step", .epoch = epoch + 1, .step = trainer.step_count(),
                         .samples_seen = double(std::size_t(epoch) * sampler.num_samples() + sampler.position()) *
                                         double(n),
                         .loss = window[0] / window[1], .train_accuracy = window[2] / window[3],
                         .seconds = s, .samples_per_second = window[3] / s});
          std::fill(window.begin(), window.end(), 0.0);
          window_seconds = 0;
          window_start = now;
        }
      }
      if (max_steps && trainer.step_count() >= max_steps) {
        stopped = true;
        // Cut short, unless that step was the run's last anyway.
        if (epoch + 1 < args.epochs || sampler.position() < sampler.num_samples()) halted_by_max_steps = true;
        break;
      }
    }
    const auto t1 = std::chrono::steady_clock::now();
    const double seconds = std::chrono::duration<double>(t1 - t0).count();
    window_seconds += std::chrono::duration<double>(t1 - window_start).count();
    const std::int64_t correct = count_correct(trainer, test, test_begin, test_end);
    const auto [comm_seconds, exposed] = hooks.comm_seconds();
    const double trained = double(sampler.position() - first_sample);
    std::vector<double> sums{loss_sum, double(steps), double(correct), comm_seconds, exposed, double(right), trained};
    gradsync::AllReduce<>{}(comm, std::span<double>(sums), gradsync::Sum{});
    accuracy = sums[2] / double(test.size());
    if (rank == 0) {
      char tail[96];
      std::snprintf(tail, sizeof tail, "comm %.2f s/rank (exposed %.2f s)", sums[3] / double(n), sums[4] / double(n));
      const EpochFigures f{.epoch = epoch + 1, .loss = sums[0] / sums[1],
                           .train_accuracy = sums[6] > 0 ? sums[5] / sums[6] : 0, .test_accuracy = accuracy,
                           .samples = sums[6], .seconds = seconds, .tail = tail, .first = first_sample,
                           .last = sampler.position(), .of = sampler.num_samples()};
      progress.clear();
      print_epoch(f);
      metrics.write({.kind = "epoch", .epoch = f.epoch, .step = trainer.step_count(),
                     .samples_seen = double(std::size_t(epoch) * sampler.num_samples() + sampler.position()) * double(n),
                     .loss = f.loss, .train_accuracy = f.train_accuracy, .test_accuracy = accuracy,
                     .seconds = seconds, .samples_per_second = f.samples / seconds, .first = f.first,
                     .last = f.last, .of = f.of});
    }
    hooks.end();
  }
  return accuracy;
}

}  // namespace example
