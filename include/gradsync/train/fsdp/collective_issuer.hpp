#pragma once
/// \file detail::fsdp::CollectiveIssuer: queues the collectives of one
/// wrapped unit on the progress worker (its gather; its reduce-scatter with
/// HybridShard's replica all-reduce, or NoShard's all-reduce), records them
/// in the step's trace and figures, and waits for them: an ask for its
/// gather, a new gradient buffer for older reductions, the step's end for
/// all. What each job does on the worker is collectives.hpp's; the order
/// is the order of the calls here, which follows the model's asks alone,
/// so every rank queues the same collectives in the same order.

#include <cstddef>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gradsync/collective/all_gather.hpp"
#include "gradsync/collective/progress_worker.hpp"
#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/collective.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/offload_space.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/request.hpp"
#include "gradsync/core/trace_recorder.hpp"
#include "gradsync/core/trace_scope.hpp"
#include "gradsync/train/common/compute_spans.hpp"
#include "gradsync/train/fsdp/collectives.hpp"
#include "gradsync/train/fsdp/hybrid_groups.hpp"
#include "gradsync/train/fsdp/trace_event.hpp"
#include "gradsync/train/fsdp/unit_group.hpp"
#include "gradsync/train/common/step_stats.hpp"

namespace gradsync::detail::fsdp {

/// One wrapped unit's gradient reduction, as the trainer asks for it.
template <class T>
struct Reduction {
  Options opts, replica_opts;
  /// The unit's elements, unpadded.
  std::size_t count = 0;
  /// Where the result lands: this rank's chunk of the gradient shard (the
  /// whole unit under NoShard, reduced in place there).
  std::span<T> home;
  /// reduce_dtype bfloat16 on the wire.
  bool bf16_wire = false;
  /// A bfloat16 model's gradient is reduced from its own buffer (reduces_bf16_grad).
  bool from_bf16 = false;
  /// Sharded accumulation after the first micro-step: add into `home`.
  bool add = false;
  /// Applied to the local gradient first (NoSync's 1/K).
  T scale = T(1);
  /// Offloaded, the result lands in the buffer's tail and is copied out to `home`.
  OffloadSpace* space = nullptr;
  /// Look for NaN and Inf in the result (the unit's `nonfinite` records one).
  bool check_finite = false;
};

/// The collectives of every wrapped unit, on the shard group's worker.
template <class T, class C, class Algo, class Comm>
class CollectiveIssuer {
  using Backend = typename CommunicatorTraits<Comm>::backend;
  using Group = UnitGroup<T, C>;
  static constexpr bool computes_bf16 = !std::is_same_v<C, T>;

 public:
  CollectiveIssuer(std::vector<Group>& units, HybridGroups<Comm>& comms, StepStats& step, bool sharded) noexcept
      : units_(units), comms_(comms), step_(step), sharded_(sharded) {}

  /// From here on the worker runs this trainer's collectives (after the
  /// construction's, which ran on the caller's thread).
  void start() { worker_ = ProgressWorker<Backend>::shared(comms_.shard()); }

  /// Queues `unit`'s gather of `home` (this rank's master chunk) into the
  /// buffers start_gather gave it, in bfloat16 on the wire with `bf16_wire`.
  void gather(Group& unit, const Options& opts, std::span<const T> home, bool bf16_wire, OffloadSpace* space) {
    const std::size_t elements = computes_bf16 ? unit.bf16.size() : unit.full.size();
    const std::size_t e = bf16_wire ? sizeof(bfloat16) : sizeof(T);
    trace.push_back({Collective::all_gather, unit.index(), gathered_units(units_), elements * e});
    count_sent(Collective::all_gather, elements, comms_.shard(), e);
    const std::span<bfloat16> kept(unit.bf16);
    const std::span<T> out(unit.full);
    const AllGather<Algo> all_gather{opts};
    // Offloaded, the chunk is copied in on the worker (behind, and so
    // overlapping, what the rank's thread does meanwhile).
    if (space) step_.offload_in_bytes += home.size_bytes();
    // The worker's time in the gather is gather_seconds; the caller's wait for it (wait_gathered) is exposed.
    unit.gathering = worker_->submit(
        "ShardedTrainer gather of " + unit.describe(),
        timed(&step_.gather_seconds, [all_gather, home, out, kept, bf16_wire, space, w = unit.index()](
                                         Communicator<Backend>& c) {
          const TraceScope span(trace_recorder(c), TraceKind::gather, w);
          gather_unit<computes_bf16>(c, all_gather, home, out, kept, bf16_wire, space);
        }));
  }

  /// Waits for `unit`'s gather, if one is queued (exposed communication).
  void wait_gathered(Group& unit) {
    if (unit.gathering.valid()) {
      const Stopwatch waiting(&step_.exposed_comm_seconds);
      const ComputeSpans::Wait gap(spans);
      unit.gathering.wait();
    }
    unit.gather_done();
  }

  /// Queues `unit`'s gradient reduction: NoShard's all-reduce of the unit
  /// in place, or the reduce-scatter of its buffer into this rank's chunk
  /// (HybridShard: and its sum across replicas, then one division).
  void reduce(Group& unit, const Reduction<T>& r) {
    const std::size_t e = r.bf16_wire ? sizeof(bfloat16) : sizeof(T);
    if (!sharded_) {
      trace.push_back({Collective::all_reduce, unit.index(), 0, r.count * e});
      count_sent(Collective::all_reduce, r.count, comms_.world(), e);
      const std::span<T> g = r.home;
      if (r.scale != T(1)) {
        for (T& x : g) x *= r.scale;
      }
      bool* const nonfinite = &unit.nonfinite;
      unit.start_reduction(worker_->submit(
          "ShardedTrainer all-reduce of " + unit.describe(),
          timed(&step_.reduce_seconds,
                [opts = r.opts, g, wire = r.bf16_wire, check = r.check_finite, nonfinite,
                 w = unit.index()](Communicator<Backend>& c) {
                  const TraceScope span(trace_recorder(c), TraceKind::all_reduce, w);
                  if (all_reduce_unit<Algo>(c, opts, g, wire, check)) *nonfinite = true;
                })));
      return;
    }
    const std::size_t chunk = r.home.size();
    const std::size_t padded = static_cast<std::size_t>(comms_.shard().size()) * chunk;
    trace.push_back({Collective::reduce_scatter, unit.index(), 0, padded * e});
    count_sent(Collective::reduce_scatter, padded, comms_.shard(), e);
    // Its gradient buffer is freed once this reduction is over (retire_reductions).
    in_reduction_.push_back(unit.index());
    const std::span<T> storage = r.from_bf16 ? std::span<T>() : std::span<T>(unit.grad).first(padded);
    const std::span<const bfloat16> bf16_in =
        r.from_bf16 ? std::span<const bfloat16>(unit.bf16_grad) : std::span<const bfloat16>();
    const std::span<T> mine = r.space ? std::span<T>(unit.grad).subspan(padded) : r.home;
    if (r.space) step_.offload_out_bytes += r.home.size_bytes();
    if (r.scale != T(1)) {
      // NoSync's step only, which folds into `grad` (never from_bf16).
      for (T& x : storage.first(r.count)) x *= r.scale;
    }
    Comm* replicas = comms_.replica();
    if (replicas) {
      trace.push_back({Collective::all_reduce, unit.index(), 0, chunk * e});
      count_sent(Collective::all_reduce, chunk, *replicas, e);
    }
    const auto divisor = static_cast<T>(comms_.world().size());
    bool* const nonfinite = &unit.nonfinite;
    unit.start_reduction(worker_->submit(
        std::string(replicas ? "ShardedTrainer reduce-scatter and replica all-reduce of "
                             : "ShardedTrainer reduce-scatter of ") +
            unit.describe(),
        timed(&step_.reduce_seconds, [r, storage, bf16_in, mine, replicas, divisor, nonfinite,
                                      w = unit.index()](Communicator<Backend>& c) {
          const TraceScope span(trace_recorder(c), TraceKind::reduce_scatter, w);
          bool found = false;
          if (r.bf16_wire) {
            found = reduce_unit<Algo, bfloat16>(c, r.opts, r.replica_opts, storage, bf16_in, r.count, mine, replicas,
                                                divisor, r.add, r.check_finite);
          } else {
            found = reduce_unit<Algo, T>(c, r.opts, r.replica_opts, storage, {}, r.count, mine, replicas, divisor,
                                         r.add, r.check_finite);
          }
          if (found) *nonfinite = true;
          if (r.space) {
            r.space->copy_out(r.home.data(), mine.data(), mine.size_bytes());
            r.space->wait();
          }
        })));
  }

  /// Frees the gradient buffers of finished reductions, oldest first,
  /// first waiting until at most `in_flight` are left running. A reduction
  /// that failed is freed too; drain() still rethrows its error.
  template <class Give>
  void retire_reductions(std::size_t in_flight, Give&& give) {
    std::size_t done = 0;
    for (; done < in_reduction_.size(); ++done) {
      Group& unit = units_[in_reduction_[done]];
      if (in_reduction_.size() - done > in_flight) {
        const Stopwatch waiting(&step_.exposed_comm_seconds);
        const ComputeSpans::Wait gap(spans);
        settle(unit.reduction);
      } else {
        bool over = true;
        try {
          over = unit.reduction.test();
        } catch (...) {
        }
        if (!over) break;
      }
      unit.retire(give);
    }
    in_reduction_.erase(in_reduction_.begin(), in_reduction_.begin() + static_cast<std::ptrdiff_t>(done));
  }

  /// Waits for every reduction and gather (a prefetch the model never
  /// used included); returns the first failure.
  std::exception_ptr drain() {
    std::exception_ptr first;
    for (Group& unit : units_) {
      for (Request* r : {&unit.gathering, &unit.reduction}) {
        try {
          if (r->valid()) r->wait();
        } catch (...) {
          if (!first) first = std::current_exception();
        }
        *r = Request();
      }
      unit.gather_done();
    }
    return first;
  }

  /// Lets whatever is in flight end, failed or not: its jobs use the units' buffers.
  void settle_all() noexcept {
    for (Group& unit : units_) {
      settle(unit.gathering);
      settle(unit.reduction);
    }
  }

  /// The step is over: no reduction holds a buffer any more.
  void forget_reductions() noexcept { in_reduction_.clear(); }

  /// The collectives of the last step, in the order this rank issued them.
  std::vector<ShardedTraceEvent> trace;
  /// The model's compute per unit on the timeline, with a gap where a wait here is.
  ComputeSpans spans;

 private:
  /// Adds what this rank sends in a Ring `collective` of `count` elements
  /// of `element_bytes` each on `c` to the step's figures.
  void count_sent(Collective collective, std::size_t count, const Comm& c, std::size_t element_bytes) noexcept {
    const std::size_t sent =
        ring_sent(collective, count, static_cast<std::size_t>(c.size()), static_cast<std::size_t>(c.rank()));
    step_.sent_elements += sent;
    step_.sent_bytes += sent * element_bytes;
  }

  std::vector<Group>& units_;
  HybridGroups<Comm>& comms_;
  StepStats& step_;
  bool sharded_;
  std::shared_ptr<ProgressWorker<Backend>> worker_;
  /// Wrapped units whose gradient buffer a reduction still holds, in submission order.
  std::vector<std::size_t> in_reduction_;
};

}  // namespace gradsync::detail::fsdp
