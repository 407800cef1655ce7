#pragma once
/// \file GradSync: averages gradients across ranks in buckets, overlapped with backward.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradsync/algorithm/tags.hpp"
#include "gradsync/collective/progress_worker.hpp"
#include "gradsync/core/backend.hpp"
#include "gradsync/core/backend_traits.hpp"
#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/float16.hpp"
#include "gradsync/core/label_scope.hpp"
#include "gradsync/core/request.hpp"
#include "gradsync/core/trace_recorder.hpp"
#include "gradsync/core/trace_scope.hpp"
#include "gradsync/core/types.hpp"
#include "gradsync/train/common/agreed_settings.hpp"
#include "gradsync/train/common/all_reduce_average.hpp"
#include "gradsync/train/common/finite_scan.hpp"
#include "gradsync/train/ddp/bucket_plan.hpp"
#include "gradsync/train/ddp/grad_sync_options.hpp"
#include "gradsync/train/ddp/no_sync_guard.hpp"
#include "gradsync/train/ddp/readiness_tracker.hpp"
#include "gradsync/train/common/reduce_scatter_average.hpp"
#include "gradsync/train/common/reduction_policy.hpp"
#include "gradsync/train/common/unit_agreement.hpp"

namespace gradsync {

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
/// Three parts, each its own type: a BucketPlan (which units go together:
/// reverse registration order, the first bucket up to
/// first_bucket_cap_bytes, the rest up to bucket_cap_bytes), a
/// ReadinessTracker (bucket k starts when its units are ready and buckets
/// 0..k−1 have started, so every rank issues the same collectives in the
/// same order), and a reduction policy (what one bucket's collective is).
/// GradSync itself owns the buckets' memory: a bucket whose units are
/// adjacent in memory is reduced in place when the policy allows; others,
/// and every bucket under bf16 compression, are packed into a per-bucket
/// buffer kept across steps, scaled on the way in.
///
/// With AllReduceAverage (the default) every rank ends with the whole mean;
/// with ReduceScatterAverage each rank's gradients hold the mean only on its
/// shard of each bucket (see ReduceScatterAverage::result) and are left as
/// they were elsewhere.
///
/// The buckets launched during backward run on the communicator's
/// ProgressWorker (ProgressWorker::shared: one per communicator, so its
/// other users' collectives and these keep one order); those still to start
/// when finish() finds nothing in flight run on the caller's thread. The
/// communicator belongs to GradSync between the first ready() and the end of
/// finish(), so do not call blocking collectives on it yourself in between
/// (idle() says when you may).
///
/// Packing, scaling and unused-unit zeroing are host loops over the
/// gradients, so the backend must work on host memory: a device-memory
/// backend (Nccl) is refused at compile time.
///
/// \tparam B          the backend of the communicator.
/// \tparam T          the gradient element type: float, double, or bfloat16/float16
///                    (16-bit gradients are scaled in float and rounded back once,
///                    then summed, rounding after each addition; AllReduce's Avg
///                    rounds the division of a bfloat16 sum by N once, while float16
///                    gradients are divided by N before the sum, whose range
///                    float16 would overflow).
/// \tparam Algo       the algorithm of every bucket's collective.
/// \tparam Reduction  the reduction policy (AllReduceAverage, ReduceScatterAverage).
template <Backend B, class T, class Algo = Auto, ReductionPolicy Reduction = AllReduceAverage<Algo>>
class GradSync {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || detail::is_half_storage_v<T>,
                "gradsync::GradSync: gradients must be float, double, bfloat16 or float16");
  static_assert(backend_traits<B>::host_memory,
                "gradsync::GradSync needs a backend whose memory space is host memory: it scales, packs and "
                "zeroes gradients with host loops, which would read device pointers on the host. On a "
                "device-memory backend (Nccl), reduce device buffers with AllReduce or ReduceScatter directly.");

 public:
  using value_type = T;
  using backend_type = B;
  using algorithm = Algo;
  using reduction_type = Reduction;
  /// What a gradient is multiplied by before the reduction: float for 16-bit
  /// gradients, which have no arithmetic of their own.
  using scale_type = std::conditional_t<detail::is_half_storage_v<T>, float, T>;

  /// `units[i]` is unit i's gradient; `names[i]` (optional) names it in errors.
  ///
  /// Takes the communicator's next trainer number (construction is
  /// collective, so every rank numbers its GradSyncs and trainers alike):
  /// every bucket's label carries it, so ranks that finish two GradSyncs of
  /// one communicator in another order fail at the first bucket instead of
  /// averaging one's gradients with the other's.
  GradSync(Communicator<B>& comm, std::vector<std::span<T>> units, GradSyncOptions options = {},
           std::vector<std::string> names = {})
      : GradSync(detail::LabelOrdinal{detail::TrainerOrdinalAccess::next(comm)}, comm, std::move(units), options,
                 std::move(names)) {}

  /// For a trainer that owns this GradSync: its buckets' labels carry the
  /// trainer's number, `ordinal.value`, which the trainer took.
  GradSync(detail::LabelOrdinal ordinal, Communicator<B>& comm, std::vector<std::span<T>> units,
           GradSyncOptions options = {}, std::vector<std::string> names = {})
      : comm_(comm), o_(without_label(options)), units_(std::move(units)), names_(std::move(names)),
        reduction_{o_.collective} {
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
    // Ranks that bucket or round differently would reduce unrelated ranges
    // or different values; say which option differs rather than "mismatched call".
    const std::string same = "Give every rank the same GradSyncOptions.";
    const std::vector<detail::AgreedValue> settings{
        detail::setting("GradSyncOptions::bucket_cap_bytes", o_.bucket_cap_bytes, same),
        detail::setting("GradSyncOptions::first_bucket_cap_bytes", o_.first_bucket_cap_bytes, same),
        {"GradSyncOptions::compression", o_.compression == Compression::bf16 ? "bf16" : "none", same},
        detail::flag("GradSyncOptions::find_unused_parameters", o_.find_unused_parameters, same),
        detail::flag("GradSyncOptions::collective.deterministic", o_.collective.deterministic, same),
        detail::setting("GradSyncOptions::collective.chunk_bytes", detail::chunk_bytes(o_.collective), same),
    };
    detail::check_units_agree(comm_, declared, "GradSync",
                              "Every rank must register the same gradient spans (sizes and names) in the same order.",
                              settings);
    plan_ = BucketPlan(std::span<const std::span<T>>(units_), o_.first_bucket_cap_bytes, o_.bucket_cap_bytes,
                       Reduction::in_place);
    labels_.emplace("sync", "bucket", bucket_names(), "optimizer lr");
    labels_->set_ordinal(ordinal.value);
    tracker_ = ReadinessTracker(plan_);
    allocate();
    worker_ = ProgressWorker<B>::shared(comm_);
    if (detail::TraceRecorder* t = detail::trace_recorder(comm_)) t->keep_names(&*labels_);
  }
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  /// Waits for what is in flight (without rethrowing) before the buffers go:
  /// the worker is shared, so it may outlive this GradSync.
  ~GradSync() {
    for (auto& b : buckets_) detail::settle(b.request);
    if (detail::TraceRecorder* t = detail::trace_recorder(comm_)) t->forget_names(&*labels_);
  }

  const std::vector<BucketInfo>& buckets() const noexcept { return plan_.buckets(); }
  const BucketPlan& plan() const noexcept { return plan_; }
  std::size_t units() const noexcept { return units_.size(); }
  const Reduction& reduction() const noexcept { return reduction_; }
  /// The communicator's progress worker, shared with its other users.
  ProgressWorker<B>& progress_worker() noexcept { return *worker_; }

  /// Marks unit `u`'s gradient final for this backward. Outside no_sync
  /// this may launch one or more buckets.
  void ready(std::size_t u) {
    if (u >= units_.size()) {
      throw InvalidArgument("gradsync: GradSync::ready on rank " + std::to_string(comm_.rank()) + ": unit " +
                            std::to_string(u) + " does not exist (" + std::to_string(units_.size()) + " units)");
    }
    tracker_.touch(u);
    if (!sync_) return;
    if (!tracker_.mark_ready(u)) {
      throw InvalidArgument("gradsync: GradSync::ready on rank " + std::to_string(comm_.rank()) + ": " + unit_name(u) +
                            " was marked ready twice in one backward");
    }
    if (o_.overlap) launch_ready(true);
  }

  /// Marks every unit not yet ready as ready (a rank with no data of its
  /// own that still takes part in the reduction, contributing what it holds).
  void mark_all_ready() {
    for (std::size_t u = 0; u < units_.size(); ++u) {
      tracker_.touch(u);
      if (sync_ && !tracker_.ready(u)) ready(u);
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
  ///
  /// Every call counts, under no_sync too, and each bucket's all-reduce
  /// carries the count ("sync 3": the third finish()): a rank that ends one
  /// backward more under no_sync than its peers before a synced one fails
  /// that sync on every rank, naming both counts, rather than averaging its
  /// gradient with theirs of another step. So where a rank calls finish()
  /// after a backward under no_sync, every rank must do so alike.
  ///
  /// Under find_unused_parameters a synced finish() needs at least one unit
  /// that got a gradient since the last sync (a ready(), or a gradient
  /// accumulated under no_sync): otherwise every unit would count as unused
  /// and be zeroed, and a second finish() after a backward's own would wipe
  /// the mean it left. Such a call throws InvalidArgument before anything
  /// moves, and does not count.
  void finish() {
    if (sync_ && o_.find_unused_parameters && !units_.empty() && !any_since_sync()) {
      throw InvalidArgument("gradsync: GradSync::finish on rank " + std::to_string(comm_.rank()) +
                            ": no unit got a gradient since the last synced finish() (no ready(), nothing "
                            "accumulated under no_sync); with find_unused_parameters every unit would be zeroed. "
                            "Call finish() once per backward");
    }
    // Buckets this finish() launches belong to the same backward as those
    // launched during it: the count moves on only as finish() leaves.
    // One that throws has counted its backward: abandon() does not again.
    struct CountOnLeave {
      std::uint64_t& n;
      bool& threw;
      int uncaught = std::uncaught_exceptions();
      ~CountOnLeave() {
        ++n;
        threw = std::uncaught_exceptions() > uncaught;
      }
    } count{finished_, finish_threw_};
    if (!sync_) return;
    std::string missing;
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (tracker_.ready(u)) continue;
      if (o_.find_unused_parameters) {
        // Never touched since the last sync: contributes zeros. Touched
        // under no_sync: contributes what it accumulated.
        if (!tracker_.touched(u)) std::fill(units_[u].begin(), units_[u].end(), T(0));
        tracker_.mark_ready(u);
      } else {
        missing += (missing.empty() ? "" : ", ") + unit_name(u);
      }
    }
    if (!missing.empty()) {
      // What is in flight uses our buffers and communicator: let it end,
      // then fail. The other ranks are waiting in this bucket's collective;
      // they learn of this error when it leaves the rank (run_threads
      // aborts the world) instead of waiting out their deadline.
      drain();
      tracker_.reset_backward();
      throw InvalidArgument("gradsync: GradSync on rank " + std::to_string(comm_.rank()) +
                            ": backward produced no gradient for " + missing +
                            ". Every unit must call ready() in every synced backward, one without parameters too; if "
                            "some units are unused on some steps, set GradSyncOptions::find_unused_parameters = true");
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
        while (!first && tracker_.next_startable()) launch(tracker_.take_next(), false, true);
      } catch (...) {
        first = std::current_exception();
      }
      inline_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    if (!first) launch_ready(false);
    std::exception_ptr drained = drain();
    if (!first) first = drained;
    stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    stats_.comm_seconds = worker_seconds_.load(std::memory_order_relaxed) + inline_seconds_;
    ++stats_.syncs;
    tracker_.reset_backward();
    tracker_.clear_touched();
    if (first) std::rethrow_exception(first);
  }

  /// After a backward that threw part-way: waits for the buckets it
  /// launched (their errors dropped: the caller has its own) and forgets
  /// it, so the next backward starts with no unit ready or touched. The
  /// gradients keep what they hold. It counts as a finish() (unless a
  /// finish() that threw counted this backward): ranks that all abandon a
  /// backward stay in step, while a rank that alone abandons one and goes
  /// on labels its next buckets apart from its peers' buckets of the
  /// backward it dropped, so that all fail there (and their communicator
  /// with them) instead of averaging one step's gradients with another's.
  void abandon() noexcept {
    drain();
    tracker_.reset_backward();
    tracker_.clear_touched();
    if (!std::exchange(finish_threw_, false)) ++finished_;
  }

  /// The learning rate this rank will step with after the next synced
  /// backward: its buckets carry it, so ranks whose rates differ fail that
  /// sync on every rank, naming both rates, instead of diverging. A trainer
  /// sets it before each step; unset, nothing is compared.
  void set_agreed_lr(double lr) noexcept { lr_bits_ = detail::bits_of(lr); }

  /// Who must see a NaN or an Inf that the check finds.
  enum class CheckScope {
    /// Every rank on its own: each reads all it holds of each reduced bucket.
    each_rank,
    /// The caller combines the ranks' findings (the least unit over ranks,
    /// as the trainers' agreement does). A bucket whose whole mean every
    /// rank holds is then read 1/N per rank, not whole on every rank.
    across_ranks,
  };

  /// From the next synced backward on, whether each bucket's reduced
  /// gradient is checked for NaN and Inf, in the loop that copies or
  /// scales it anyway. A bucket reduced in place in the gradients has no
  /// such loop at this layer (Avg's division is the algorithm's), so it is
  /// read once more, on the thread that reduced them, while it is warm:
  /// whole, or this rank's 1/N of it under CheckScope::across_ranks (where
  /// the reduction is AllReduceAverage, whose result is the same bits on
  /// every rank). Off at construction. Call it only while idle(): the
  /// progress worker reads it as it reduces.
  void set_check_finite(bool on, CheckScope scope = CheckScope::each_rank) noexcept {
    check_finite_ = on;
    check_scope_ = scope;
  }

  /// After a synced finish() with set_check_finite(true): the first unit (in
  /// registration order) whose reduced gradient on this rank holds a NaN or
  /// an Inf. Under AllReduceAverage and CheckScope::each_rank every rank
  /// holds the same mean and reads all of it, so every rank finds the same
  /// unit; under ReduceScatterAverage, or CheckScope::across_ranks, it
  /// finds only what its part holds.
  std::optional<std::size_t> first_nonfinite_unit() const noexcept {
    std::size_t first = no_unit;
    for (const Bucket& b : buckets_) first = std::min(first, b.first_nonfinite);
    if (first == no_unit) return std::nullopt;
    return first;
  }

  /// Disables synchronisation until the guard goes: backward then only
  /// accumulates locally, and the next synced backward reduces the sum.
  using NoSync = detail::NoSyncGuard<GradSync>;
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

  /// Turns synchronisation on or off between backwards (what no_sync() does).
  void set_sync(bool on) {
    if (tracker_.started() != 0) {
      throw InvalidArgument("gradsync: GradSync::set_sync on rank " + std::to_string(comm_.rank()) +
                            " in the middle of a synced backward; call finish() first");
    }
    sync_ = on;
    tracker_.reset_backward();
  }
  bool sync_enabled() const noexcept { return sync_; }

  /// Buckets launched in the current backward.
  std::size_t launched() const noexcept { return tracker_.started(); }
  /// Nothing in flight on the communicator's worker (from any of its
  /// users): the caller may use the communicator directly.
  bool idle() const { return worker_->in_flight() == 0; }

  const GradSyncStats& stats() const noexcept { return stats_; }
  /// Bytes of the buckets' own buffers (staging, bf16 packing); buckets
  /// reduced in place in the gradients hold none.
  std::size_t buffer_bytes() const noexcept {
    std::size_t bytes = 0;
    for (const Bucket& b : buckets_) bytes += b.staging.capacity() * sizeof(T) + b.packed.capacity() * sizeof(bfloat16);
    return bytes;
  }
  void reset_stats() {
    stats_ = {};
    worker_seconds_.store(0, std::memory_order_relaxed);
    inline_seconds_ = 0;
  }

 private:
  /// A bucket's memory: the units' own (in place), or `staging`, or `packed`
  /// (bf16), sized as the policy asks.
  struct Bucket {
    std::span<T> region;
    std::vector<T> staging;
    std::vector<bfloat16> packed;
    Request request;
    /// The first unit whose reduced gradient the last reduction found
    /// non-finite; written by the job, read once it has been waited for.
    std::size_t first_nonfinite = no_unit;
  };
  static constexpr std::size_t no_unit = static_cast<std::size_t>(-1);

  /// The options without a caller's label: each bucket labels its
  /// collective itself (detail::LabelScope, which a call's own label would
  /// override), so ranks that sync differently fail however they are called.
  static GradSyncOptions without_label(GradSyncOptions o) noexcept {
    o.collective.label = {};
    return o;
  }

  std::string unit_name(std::size_t u) const {
    return "unit " + std::to_string(u) + (names_.empty() ? std::string() : " ('" + names_[u] + "')");
  }

  /// Bucket k in words for labels: "units 'fc3' to 'fc2'", "unit 'fc1'" (by
  /// index without names).
  std::vector<std::string> bucket_names() const {
    std::vector<std::string> out;
    auto one = [&](std::size_t u) { return names_.empty() ? std::to_string(u) : "'" + names_[u] + "'"; };
    for (std::size_t k = 0; k < plan_.size(); ++k) {
      const BucketInfo& b = plan_[k];
      out.push_back(b.first_unit == b.last_unit ? "unit " + one(b.first_unit)
                                                : "units " + one(b.first_unit) + " to " + one(b.last_unit));
    }
    return out;
  }

  void allocate() {
    buckets_.resize(plan_.size());
    const int world = comm_.size();
    for (std::size_t k = 0; k < plan_.size(); ++k) {
      const BucketInfo& info = plan_[k];
      Bucket& b = buckets_[k];
      const std::size_t storage = Reduction::storage(info.count, world);
      if (o_.compression == Compression::bf16) {
        b.packed.resize(storage);
      } else if (info.in_place) {
        T* begin = nullptr;
        for (std::size_t u = info.first_unit; u <= info.last_unit && !begin; ++u) {
          if (!units_[u].empty()) begin = units_[u].data();
        }
        b.region = begin ? std::span<T>(begin, info.count) : std::span<T>();
      } else {
        b.staging.resize(storage);
      }
    }
  }

  /// Launches, in order, every bucket whose units are all ready.
  void launch_ready(bool early) {
    while (tracker_.next_startable()) launch(tracker_.take_next(), early);
  }

  /// Starts bucket k on the progress worker, or runs it here and now when
  /// `here` (the caller owns the communicator: nothing is in flight).
  void launch(std::size_t k, bool early, bool here = false) {
    ++stats_.buckets_launched;
    if (early) ++stats_.buckets_launched_early;
    const int world = comm_.size();
    const int divisor = avg_.divisor == 0 ? world : avg_.divisor;
    // Dividing by the world size is the policy's mean (Avg's last step);
    // any other divisor is folded into the local scale before a sum, and so
    // is every divisor of float16 gradients: their sum over the ranks passes
    // float16's largest value, 65504, long before the mean does (three ranks
    // at 30000 each), so they are divided first, as PyTorch DDP does.
    const bool mean = divisor == world && !std::is_same_v<T, float16>;
    const scale_type scale = static_cast<scale_type>(mean ? avg_.local_scale : avg_.local_scale / divisor);
    // What the bucket moves: its index, in the finish() that the ranks have
    // counted alike, and the learning rate that follows it.
    const CallLabel label = labels_->label(detail::LabelPhase::bucket, k, finished_ + 1, lr_bits_);
    buckets_[k].first_nonfinite = no_unit;
    if (here) return reduce_bucket(comm_, k, mean, scale, label);
    std::string what = "GradSync bucket " + std::to_string(k) + " (" + std::to_string(plan_[k].count) + " elements)";
    buckets_[k].request = worker_->submit(std::move(what), [this, k, mean, scale, label](Communicator<B>& c) {
      // The worker is shared, so its own busy time is not ours to report.
      const auto t0 = std::chrono::steady_clock::now();
      struct Clock {
        std::atomic<double>& sum;
        std::chrono::steady_clock::time_point t0;
        ~Clock() {
          sum.fetch_add(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                        std::memory_order_relaxed);
        }
      } clock{worker_seconds_, t0};
      reduce_bucket(c, k, mean, scale, label);
    });
  }

  /// Whether some unit was touched (ready, or accumulated under no_sync)
  /// since the last synced finish().
  bool any_since_sync() const noexcept {
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (tracker_.touched(u)) return true;
    }
    return false;
  }

  /// Runs on the progress worker, or on the owner's thread from finish().
  void reduce_bucket(Communicator<B>& c, std::size_t k, bool mean, scale_type scale, const CallLabel& label) {
    // The reduction policy's collectives carry the bucket's label.
    const detail::LabelScope<B> labelled(c, label);
    const detail::TraceScope span(detail::trace_recorder(c), detail::TraceKind::bucket, k);
    const BucketInfo& info = plan_[k];
    Bucket& b = buckets_[k];
    const ReducedPart part = Reduction::result(info.count, c.size(), c.rank());
    using Scan = detail::FiniteScan<T>;
    // Records the first unit whose reduced piece the copy or scan found non-finite.
    auto note = [&](std::size_t u, typename Scan::word seen) {
      if (check_finite_ && Scan::found(seen) && u < b.first_nonfinite) b.first_nonfinite = u;
    };
    if (o_.compression == Compression::bf16) {
      std::size_t at = 0;
      for_each_unit(info, [&](std::span<T> g) {
        for (std::size_t i = 0; i < g.size(); ++i) b.packed[at + i] = bfloat16(static_cast<float>(scaled(g[i], scale)));
        at += g.size();
      });
      reduction_.reduce(c, std::span<bfloat16>(b.packed), info.count, mean);
      for_each_in_part(info, part, [&](std::size_t u, std::span<T> g, std::size_t from) {
        typename Scan::word seen = Scan::start;
        for (std::size_t i = 0; i < g.size(); ++i) {
          g[i] = static_cast<T>(static_cast<float>(b.packed[from + i]));
          seen = Scan::fold(seen, g[i]);
        }
        note(u, seen);
      });
      return;
    }
    if (!info.in_place) {
      std::size_t at = 0;
      for_each_unit(info, [&](std::span<T> g) {
        for (std::size_t i = 0; i < g.size(); ++i) b.staging[at + i] = scaled(g[i], scale);
        at += g.size();
      });
      reduction_.reduce(c, std::span<T>(b.staging), info.count, mean);
      for_each_in_part(info, part, [&](std::size_t u, std::span<T> g, std::size_t from) {
        if (!check_finite_) {
          std::copy(b.staging.begin() + static_cast<std::ptrdiff_t>(from),
                    b.staging.begin() + static_cast<std::ptrdiff_t>(from + g.size()), g.begin());
          return;
        }
        typename Scan::word seen = Scan::start;
        for (std::size_t i = 0; i < g.size(); ++i) {
          g[i] = b.staging[from + i];
          seen = Scan::fold(seen, g[i]);
        }
        note(u, seen);
      });
      return;
    }
    if (scale != scale_type(1)) {
      for (T& x : b.region) x = scaled(x, scale);
    }
    reduction_.reduce(c, b.region, info.count, mean);
    // In place, the reduction's own last pass (Avg's division) is below
    // this layer: one read here, while the bucket is warm in cache; 1/N of
    // it when the caller combines the ranks' findings and every rank holds
    // the same whole mean.
    if (check_finite_) {
      ReducedPart read = part;
      if (check_scope_ == CheckScope::across_ranks && leaves_every_rank_the_mean) {
        const auto n = static_cast<std::size_t>(c.size()), r = static_cast<std::size_t>(c.rank());
        const std::size_t lo = part.count * r / n, hi = part.count * (r + 1) / n;
        read = {part.offset + lo, lo, hi - lo};
      }
      for_each_in_part(info, read, [&](std::size_t u, std::span<T> g, std::size_t) {
        if (Scan::any(g)) note(u, Scan::exponent);
      });
    }
  }

  /// x·s in T; a 16-bit x is widened to float and the product rounded once.
  static T scaled(T x, scale_type s) noexcept {
    if constexpr (detail::is_half_storage_v<T>) {
      return T(static_cast<float>(x) * s);
    } else {
      return x * s;
    }
  }

  template <class F>
  void for_each_unit(const BucketInfo& info, F&& f) {
    for (std::size_t u = info.first_unit; u <= info.last_unit; ++u) f(units_[u]);
  }

  /// Calls f(u, piece, at) for each piece of a unit u that lies in `part` of
  /// the bucket, `at` being where that piece's result is in the storage.
  template <class F>
  void for_each_in_part(const BucketInfo& info, const ReducedPart& part, F&& f) {
    const std::size_t lo = part.first, hi = part.first + part.count;
    std::size_t at = 0;
    for (std::size_t u = info.first_unit; u <= info.last_unit; ++u) {
      const std::size_t n = units_[u].size();
      const std::size_t from = std::max(at, lo), to = std::min(at + n, hi);
      if (from < to) f(u, units_[u].subspan(from - at, to - from), part.offset + (from - lo));
      at += n;
    }
  }

  /// Waits for every launched bucket; returns the first failure.
  std::exception_ptr drain() {
    std::exception_ptr first;
    for (Bucket& b : buckets_) {
      try {
        b.request.wait();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
      b.request = Request();
    }
    return first;
  }

  Communicator<B>& comm_;
  GradSyncOptions o_;
  std::vector<std::span<T>> units_;
  std::vector<std::string> names_;
  Reduction reduction_;
  BucketPlan plan_;
  ReadinessTracker tracker_;
  std::vector<Bucket> buckets_;
  bool sync_ = true;
  Averaging avg_{};
  GradSyncStats stats_{};
  std::optional<detail::StepLabels> labels_;  ///< made with the plan; never moves (the labels point at it)
  std::uint64_t lr_bits_ = 0;
  bool check_finite_ = false;
  /// Whether every rank ends a bucket's reduction holding the whole, same
  /// mean (AllReduceAverage's result), so that each may read a share of it.
  static constexpr bool leaves_every_rank_the_mean = std::is_same_v<Reduction, AllReduceAverage<Algo>>;
  CheckScope check_scope_ = CheckScope::each_rank;
  /// finish() calls, synced or not: the count the labels carry, which
  /// reset_stats() leaves alone, since ranks need not reset alike.
  std::uint64_t finished_ = 0;
  /// The last finish() left by an exception (see abandon).
  bool finish_threw_ = false;
  std::atomic<double> worker_seconds_{0};  ///< buckets run on the worker
  double inline_seconds_ = 0;              ///< buckets finish() ran on the caller's thread
  std::shared_ptr<ProgressWorker<B>> worker_;
};

}  // namespace gradsync
