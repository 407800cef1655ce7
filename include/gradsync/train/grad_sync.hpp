#pragma once
/// \file GradSync: averages gradients across ranks in buckets, overlapped with backward.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradsync/algorithm/tags.hpp"
#include "gradsync/collective/all_reduce.hpp"
#include "gradsync/collective/progress_worker.hpp"
#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/request.hpp"
#include "gradsync/train/unit_agreement.hpp"

namespace gradsync {

/// How gradients travel.
enum class Compression : std::uint8_t {
  /// As they are.
  none,
  /// Cast to bfloat16, all-reduce, take the mean, cast back: half the bytes,
  /// about three significant digits (PyTorch's bf16_compress_hook).
  bf16,
};

/// Options of GradSync, with PyTorch DDP's defaults.
struct GradSyncOptions {
  /// Largest bucket, in bytes of gradient (PyTorch: bucket_cap_mb = 25).
  std::size_t bucket_cap_bytes = std::size_t{25} << 20;
  /// The first bucket (the last layers) is small, so communication starts
  /// as early as possible in backward.
  std::size_t first_bucket_cap_bytes = std::size_t{1} << 20;
  Compression compression = Compression::none;
  /// A unit that got no ready() in a synced backward contributes zeros
  /// (unless it accumulated a gradient under no_sync). Off: finish() throws
  /// an error naming the unit.
  bool find_unused_parameters = false;
  /// Launch each bucket as soon as its gradients are ready. Off: launch all
  /// of them in finish(), for measuring what overlap buys.
  bool overlap = true;
  /// Passed to every bucket's AllReduce; `deterministic` makes the averaged
  /// gradients bitwise independent of the bucket sizes.
  Options collective{};
};

/// How the next synced backward is averaged. By default every rank's
/// gradient counts once and the result is the mean over all ranks.
struct Averaging {
  /// Applied to this rank's gradient before the reduction: 1/K after K
  /// accumulated micro-steps.
  double local_scale = 1.0;
  /// The reduced sum is divided by this; 0 means the world size. A join
  /// (uneven inputs) divides by the number of ranks that still had data.
  int divisor = 0;
};

/// What GradSync measured, summed since construction or reset_stats().
struct GradSyncStats {
  std::size_t syncs = 0;
  /// Buckets that started before finish(), i.e. overlapped with backward.
  std::size_t buckets_launched_early = 0;
  std::size_t buckets_launched = 0;
  /// Time spent in bucket collectives (pack, reduce, unpack), on the progress
  /// worker or, for the buckets finish() runs itself, on the caller's thread.
  double comm_seconds = 0;
  /// Time finish() blocked waiting for them: the communication backward did not hide.
  double wait_seconds = 0;
};

/// One bucket of the plan: units [first_unit, last_unit] (indices in the
/// order they were registered), reduced together.
struct BucketInfo {
  std::size_t first_unit = 0;
  std::size_t last_unit = 0;
  std::size_t count = 0;
  /// The units are adjacent in memory, so the bucket is reduced in place.
  bool in_place = false;
};

/// Averages gradients across the ranks of a communicator, in buckets that
/// start while backward is still running: a lower layer that a trainer with
/// its own loop can use alone.
///
/// Register the gradient spans once, in forward (parameter) order; each one
/// is a "unit" that becomes ready as a whole. Construction is collective: it
/// checks that every rank registered the same sizes and names in the same
/// order, and otherwise throws InvalidArgument on every rank, naming the
/// first unit and rank that differ. Then per step:
///
///     model.backward(/* calls sync.ready(u) as each unit's gradient is final */);
///     sync.finish();            // every rank now holds the mean gradient
///     optimizer.step(...);
///
/// Buckets are filled in reverse registration order (backward produces the
/// last layers first), the first up to first_bucket_cap_bytes, the rest up
/// to bucket_cap_bytes; a unit larger than the cap gets a bucket of its own.
/// Bucket k is launched when all its units are ready and buckets 0..k−1 are
/// launched, so every rank issues the same collectives in the same order
/// whatever order its units become ready in.
///
/// Averaging is an AllReduce with Avg (sum, then one division by N done by
/// whichever rank owns each block, so all ranks receive the same bits).
/// A bucket whose units are adjacent in memory is reduced in place; others
/// are packed into a per-bucket buffer kept across steps.
///
/// The buckets launched during backward run on a ProgressWorker thread;
/// those still to start when finish() finds nothing in flight run on the
/// caller's thread. The communicator belongs to GradSync between the first
/// ready() and the end of finish(), so do not call collectives on it
/// yourself in between (idle() says when you may).
///
/// \tparam B     the backend of the communicator.
/// \tparam T     the gradient element type (float or double).
/// \tparam Algo  the AllReduce algorithm for every bucket.
template <Backend B, class T, class Algo = Auto>
class GradSync {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "gradsync::GradSync: gradients must be float or double");

 public:
  using value_type = T;

  /// `units[i]` is unit i's gradient; `names[i]` (optional) names it in errors.
  GradSync(Communicator<B>& comm, std::vector<std::span<T>> units, GradSyncOptions options = {},
           std::vector<std::string> names = {})
      : comm_(comm), o_(options), units_(std::move(units)), names_(std::move(names)) {
    if (o_.bucket_cap_bytes == 0 || o_.first_bucket_cap_bytes == 0) {
      throw InvalidArgument("gradsync: GradSync expects positive bucket caps, got bucket_cap_bytes = " +
                            std::to_string(o_.bucket_cap_bytes) +
                            " and first_bucket_cap_bytes = " + std::to_string(o_.first_bucket_cap_bytes));
    }
    if (!names_.empty() && names_.size() != units_.size()) {
      throw InvalidArgument("gradsync: GradSync expects one name per unit, got " + std::to_string(names_.size()) +
                            " names for " + std::to_string(units_.size()) + " units");
    }
    // Equal totals split differently would reduce without complaint, each
    // rank's unit i averaged with another rank's unrelated gradients.
    std::vector<std::string> declared;
    for (std::size_t u = 0; u < units_.size(); ++u) {
      declared.push_back(detail::describe_unit(names_.empty() ? std::string_view() : names_[u], units_[u].size()));
    }
    detail::check_units_agree(comm_, declared, "GradSync",
                              "Every rank must register the same gradient spans (sizes and names) in the same order.");
    plan();
    ready_.assign(units_.size(), 0);
    touched_.assign(units_.size(), 0);
    worker_ = std::make_unique<ProgressWorker<B>>(comm_);
  }
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  /// Waits for what is in flight (without rethrowing) before the buffers go.
  ~GradSync() {
    for (auto& b : buckets_) {
      try {
        b.request.wait();
      } catch (...) {
        // Already reported, or about to be, by whoever called finish().
      }
    }
  }

  const std::vector<BucketInfo>& buckets() const noexcept { return info_; }
  std::size_t units() const noexcept { return units_.size(); }

  /// Marks unit `u`'s gradient final for this backward. Outside no_sync
  /// this may launch one or more buckets.
  void ready(std::size_t u) {
    if (u >= units_.size()) {
      throw InvalidArgument("gradsync: GradSync::ready on rank " + std::to_string(comm_.rank()) + ": unit " +
                            std::to_string(u) + " does not exist (" + std::to_string(units_.size()) + " units)");
    }
    touched_[u] = 1;
    if (!sync_) return;
    if (ready_[u]) {
      throw InvalidArgument("gradsync: GradSync::ready on rank " + std::to_string(comm_.rank()) + ": " + unit_name(u) +
                            " was marked ready twice in one backward");
    }
    ready_[u] = 1;
    --buckets_[bucket_of_[u]].pending;
    if (o_.overlap) launch_ready(true);
  }

  /// Marks every unit not yet ready as ready (a rank with no data of its
  /// own that still takes part in the reduction, contributing what it holds).
  void mark_all_ready() {
    for (std::size_t u = 0; u < units_.size(); ++u) {
      touched_[u] = 1;
      if (sync_ && !ready_[u]) ready(u);
    }
  }

  /// How the next synced backward is averaged; stays until changed.
  void set_averaging(Averaging a) {
    if (a.divisor < 0 || a.divisor > comm_.size()) {
      throw InvalidArgument("gradsync: GradSync::set_averaging expects a divisor in [0, " +
                            std::to_string(comm_.size()) + "], got " + std::to_string(a.divisor));
    }
    avg_ = a;
  }

  /// Completes the synced backward: handles units that got no gradient,
  /// launches what is left, and waits for every bucket. On return each
  /// rank's gradients hold the average. Under no_sync it only ends the
  /// backward, without communicating.
  void finish() {
    if (!sync_) return;
    std::string missing;
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (ready_[u]) continue;
      if (o_.find_unused_parameters) {
        // Never touched since the last sync: contributes zeros. Touched
        // under no_sync: contributes what it accumulated.
        if (!touched_[u]) std::fill(units_[u].begin(), units_[u].end(), T(0));
        ready_[u] = 1;
        --buckets_[bucket_of_[u]].pending;
      } else {
        missing += (missing.empty() ? "" : ", ") + unit_name(u);
      }
    }
    if (!missing.empty()) {
      // What is in flight uses our buffers and communicator: let it end,
      // then fail. The other ranks are waiting in this bucket's AllReduce;
      // they learn of this error when it leaves the rank (run_threads
      // aborts the world) instead of waiting out their deadline.
      drain();
      reset_backward();
      throw InvalidArgument("gradsync: GradSync on rank " + std::to_string(comm_.rank()) +
                            ": backward produced no gradient for " + missing +
                            ". Every unit must call ready() in every synced backward; if some units are unused on "
                            "some steps, set GradSyncOptions::find_unused_parameters = true");
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::exception_ptr first;
    if (idle()) {
      // Nothing in flight, so the communicator is this thread's again: the
      // buckets left run here, on the thread that would only wait for them.
      // Handing them to the worker would add its wake-up (tens of
      // microseconds, milliseconds on a crowded machine) to every step's
      // critical path, which was most of the gap to one flat all-reduce.
      // What ran early is done: if any of it failed, run nothing more, as
      // the worker would not.
      first = drain();
      try {
        while (!first && next_ < buckets_.size() && buckets_[next_].pending == 0) launch(next_++, false, true);
      } catch (...) {
        first = std::current_exception();
      }
      inline_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    if (!first) launch_ready(false);
    std::exception_ptr drained = drain();
    if (!first) first = drained;
    stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    stats_.comm_seconds = worker_->busy_seconds() - busy_at_reset_ + inline_seconds_;
    ++stats_.syncs;
    reset_backward();
    std::fill(touched_.begin(), touched_.end(), 0);
    if (first) std::rethrow_exception(first);
  }

  /// Disables synchronisation until the guard goes: backward then only
  /// accumulates locally, and the next synced backward reduces the sum.
  class NoSync {
   public:
    explicit NoSync(GradSync& s) : s_(s), was_(s.sync_) { s_.set_sync(false); }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    ~NoSync() { s_.set_sync(was_); }

   private:
    GradSync& s_;
    bool was_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

  /// Turns synchronisation on or off between backwards (what no_sync() does).
  void set_sync(bool on) {
    if (launched_ != 0) {
      throw InvalidArgument("gradsync: GradSync::set_sync on rank " + std::to_string(comm_.rank()) +
                            " in the middle of a synced backward; call finish() first");
    }
    sync_ = on;
    reset_backward();
  }
  bool sync_enabled() const noexcept { return sync_; }

  /// Buckets launched in the current backward.
  std::size_t launched() const noexcept { return launched_; }
  /// Nothing in flight: the caller may use the communicator directly.
  bool idle() const { return worker_->in_flight() == 0; }

  const GradSyncStats& stats() const noexcept { return stats_; }
  void reset_stats() {
    stats_ = {};
    busy_at_reset_ = worker_->busy_seconds();
    inline_seconds_ = 0;
  }

 private:
  struct Bucket {
    std::size_t lo = 0, hi = 0;  // unit indices, inclusive
    std::size_t count = 0;
    std::span<T> region;         // when in place
    std::vector<T> staging;      // when not
    std::vector<bfloat16> packed;
    std::size_t pending = 0;
    Request request;
  };

  std::string unit_name(std::size_t u) const {
    return "unit " + std::to_string(u) + (names_.empty() ? std::string() : " ('" + names_[u] + "')");
  }

  void plan() {
    const std::size_t n = units_.size();
    bucket_of_.assign(n, 0);
    std::size_t cap = o_.first_bucket_cap_bytes;
    for (std::size_t i = n; i-- > 0;) {
      const std::size_t bytes = units_[i].size_bytes();
      const bool full = !buckets_.empty() && buckets_.back().pending > 0 &&
                        buckets_.back().count * sizeof(T) + bytes > cap;
      if (buckets_.empty() || full) {
        if (!buckets_.empty()) cap = o_.bucket_cap_bytes;
        buckets_.emplace_back();
        buckets_.back().hi = i;
      }
      Bucket& b = buckets_.back();
      b.lo = i;
      b.count += units_[i].size();
      ++b.pending;
      bucket_of_[i] = buckets_.size() - 1;
    }
    for (Bucket& b : buckets_) {
      // Adjacent in memory, in registration order; empty units may point anywhere.
      bool adjacent = true;
      T* begin = nullptr;
      T* end = nullptr;
      for (std::size_t u = b.lo; u <= b.hi; ++u) {
        if (units_[u].empty()) continue;
        if (!begin) begin = units_[u].data();
        if (end && units_[u].data() != end) adjacent = false;
        end = units_[u].data() + units_[u].size();
      }
      if (adjacent) {
        b.region = begin ? std::span<T>(begin, b.count) : std::span<T>();
      } else {
        b.staging.resize(b.count);
      }
      if (o_.compression == Compression::bf16) b.packed.resize(b.count);
      info_.push_back(BucketInfo{b.lo, b.hi, b.count, adjacent});
      pending_init_.push_back(b.pending);
    }
  }

  void reset_backward() {
    std::fill(ready_.begin(), ready_.end(), 0);
    for (std::size_t k = 0; k < buckets_.size(); ++k) buckets_[k].pending = pending_init_[k];
    next_ = 0;
    launched_ = 0;
  }

  /// Launches, in order, every bucket whose units are all ready.
  void launch_ready(bool early) {
    while (next_ < buckets_.size() && buckets_[next_].pending == 0) launch(next_++, early);
  }

  /// Starts bucket k on the progress worker, or runs it here and now when
  /// `here` (the caller owns the communicator: nothing is in flight).
  void launch(std::size_t k, bool early, bool here = false) {
    Bucket& b = buckets_[k];
    ++launched_;
    ++stats_.buckets_launched;
    if (early) ++stats_.buckets_launched_early;
    const int world = comm_.size();
    const int divisor = avg_.divisor == 0 ? world : avg_.divisor;
    // Dividing by the world size is Avg's own last step; any other divisor
    // is folded into the local scale before a Sum.
    const bool use_avg = divisor == world;
    const double scale = use_avg ? avg_.local_scale : avg_.local_scale / divisor;
    const Compression compression = o_.compression;
    const Options options = o_.collective;
    if (here) return reduce_bucket(comm_, b, use_avg, static_cast<T>(scale), compression, options);
    std::string label = "GradSync bucket " + std::to_string(k) + " (" + std::to_string(b.count) + " elements)";
    b.request = worker_->submit(std::move(label), [this, &b, use_avg, scale, compression, options](Communicator<B>& c) {
      reduce_bucket(c, b, use_avg, static_cast<T>(scale), compression, options);
    });
  }

  /// Runs on the progress worker, or on the owner's thread from finish().
  void reduce_bucket(Communicator<B>& c, Bucket& b, bool use_avg, T scale, Compression compression,
                     const Options& options) {
    const AllReduce<Algo> all_reduce{options};
    auto reduce = [&](auto span) {
      if (use_avg) {
        all_reduce(c, span, Avg{});
      } else {
        all_reduce(c, span, Sum{});
      }
    };
    if (compression == Compression::bf16) {
      std::size_t at = 0;
      for_each_unit(b, [&](std::span<T> g) {
        for (std::size_t i = 0; i < g.size(); ++i) b.packed[at + i] = bfloat16(static_cast<float>(g[i] * scale));
        at += g.size();
      });
      reduce(std::span<bfloat16>(b.packed));
      at = 0;
      for_each_unit(b, [&](std::span<T> g) {
        for (std::size_t i = 0; i < g.size(); ++i) g[i] = static_cast<T>(static_cast<float>(b.packed[at + i]));
        at += g.size();
      });
      return;
    }
    if (!b.staging.empty()) {
      std::size_t at = 0;
      for_each_unit(b, [&](std::span<T> g) {
        for (std::size_t i = 0; i < g.size(); ++i) b.staging[at + i] = g[i] * scale;
        at += g.size();
      });
      reduce(std::span<T>(b.staging));
      at = 0;
      for_each_unit(b, [&](std::span<T> g) {
        std::copy(b.staging.begin() + static_cast<std::ptrdiff_t>(at),
                  b.staging.begin() + static_cast<std::ptrdiff_t>(at + g.size()), g.begin());
        at += g.size();
      });
      return;
    }
    if (scale != T(1)) {
      for (T& x : b.region) x *= scale;
    }
    // One rank's mean is its own gradient: skip Avg's pass over the bucket.
    if (use_avg && c.size() == 1) return;
    reduce(b.region);
  }

  template <class F>
  void for_each_unit(const Bucket& b, F&& f) {
    for (std::size_t u = b.lo; u <= b.hi; ++u) f(units_[u]);
  }

  /// Waits for every launched bucket; returns the first failure.
  std::exception_ptr drain() {
    std::exception_ptr first;
    for (std::size_t k = 0; k < buckets_.size(); ++k) {
      try {
        buckets_[k].request.wait();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
      buckets_[k].request = Request();
    }
    return first;
  }

  Communicator<B>& comm_;
  GradSyncOptions o_;
  std::vector<std::span<T>> units_;
  std::vector<std::string> names_;
  std::vector<Bucket> buckets_;
  std::vector<BucketInfo> info_;
  std::vector<std::size_t> bucket_of_;
  std::vector<std::size_t> pending_init_;
  std::vector<unsigned char> ready_;
  std::vector<unsigned char> touched_;
  std::size_t next_ = 0;
  std::size_t launched_ = 0;
  bool sync_ = true;
  Averaging avg_{};
  GradSyncStats stats_{};
  double busy_at_reset_ = 0;
  double inline_seconds_ = 0;  ///< buckets finish() ran on the caller's thread
  std::unique_ptr<ProgressWorker<B>> worker_;  // last: destroyed first, while the buckets still exist
};

}  // namespace gradsync
