#pragma once
/// \file MemoryNeed: what a trainer holds per rank, persistent and transient, and the memory_budget check.

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <span>
#include <string>

#include "gradsync/core/error.hpp"

namespace gradsync {

/// Bytes one rank of a trainer holds, broken down. Persistent: kept between
/// steps (parameter and gradient shards, optimizer state). Transient: the
/// most held at once inside a step (gathered units, unsharded gradient
/// buffers while they are filled and reduced). Communication scratch inside
/// the algorithms, buffers (running statistics) and the model's own
/// activations are left out. With offload (ShardedTrainerOptions::offload)
/// the shards and optimizer state are `offloaded`, outside the persistent
/// and transient parts, and the budget covers the compute side only.
struct MemoryNeed {
  std::size_t params = 0;
  std::size_t grads = 0;
  std::size_t optimizer_state = 0;
  /// Gathered units held at once.
  std::size_t gathered = 0;
  /// Unsharded gradient buffers held at once (being filled, or in a
  /// reduction still in flight), or GradSync's bucket staging.
  std::size_t gradient_buffers = 0;
  /// Held in the offload space rather than on the compute side: parameter
  /// and gradient shards and the optimizer state (not in total()).
  std::size_t offloaded = 0;
  /// Held only while the trainer is constructed, beside the persistent
  /// part: the model's initial values in full before they are sharded (a
  /// model with `bind`: every parameter; with `init_unit`: one wrapped unit).
  /// Never held with the transient part, so total() counts the larger.
  std::size_t construction = 0;

  std::size_t persistent() const noexcept { return params + grads + optimizer_state; }
  std::size_t transient() const noexcept { return gathered + gradient_buffers; }
  std::size_t total() const noexcept { return persistent() + std::max(transient(), construction); }

  /// "272.0 MiB (persistent 128.0 MiB: ..., transient 144.0 MiB: ...)",
  /// then the construction's part if it decides the total, and what is
  /// offloaded besides, if anything.
  std::string describe() const {
    std::string s = mib(total()) + " (persistent " + mib(persistent()) + ": parameters " + mib(params) +
                    ", gradients " + mib(grads) + ", optimizer state " + mib(optimizer_state) + "; transient " +
                    mib(transient()) + ": gathered units " + mib(gathered) + ", gradient buffers " +
                    mib(gradient_buffers);
    if (construction > transient()) s += "; at construction, instead of the transient part, " + mib(construction);
    s += ")";
    if (offloaded != 0) s += " on the compute side, and " + mib(offloaded) + " offloaded";
    return s;
  }

  /// `bytes` in MiB with one decimal, and exactly.
  static std::string mib(std::size_t bytes) {
    char text[64];
    std::snprintf(text, sizeof text, "%.1f MiB = %zu B", static_cast<double>(bytes) / (1024.0 * 1024.0), bytes);
    return text;
  }
};

namespace detail {

/// What decides ShardedTrainer's transient bytes, besides its units' sizes.
struct ShardedMemoryShape {
  /// Not NoShard.
  bool sharded = true;
  /// ShardGradOp: forward's gathers are kept until the unit's backward.
  bool keeps_forward_gathers = false;
  /// FullShard or HybridShard with a forward or backward prefetch that the
  /// gather limit lets through: a second unit gathered beside the one in use.
  bool prefetch = false;
  /// AccumulationMode::NoSync: every unit's gradient buffer lives from the
  /// first micro-step's backward to the reducing step's.
  bool keeps_unsharded_grads = false;
  /// Shards and optimizer state in an offload space; each gradient buffer
  /// holds c more elements, the reduce-scatter's output before it is copied out.
  bool offload = false;
  std::size_t state_per_element = 0;
  std::size_t element_bytes = 4;
  /// ShardGradOp with param_dtype bfloat16, where keeping_bf16_pays: bytes
  /// per element of a gathered unit kept while the model does not hold it
  /// (2: its bfloat16 copy); 0: element_bytes.
  std::size_t kept_element_bytes = 0;
  /// A model computing in bfloat16 (compute_type): bytes per element of
  /// its gathered units and of the gradient it writes (2); 0: element_bytes,
  /// the model computes in the master type.
  std::size_t compute_element_bytes = 0;
  /// With compute_element_bytes: each gradient is reduced from the buffer
  /// the model wrote (reduce_dtype bfloat16), with no e-byte buffer.
  bool reduces_in_compute_type = false;
};

/// What ShardedTrainer holds per rank, from its wrapped units' sizes P_u,
/// the ranks a unit is sharded over (n) and `shape`. With c_u = ⌈P_u/n⌉
/// (padding included): persistent (2 + s)·e·Σc_u. A gathered unit is n·c_u
/// elements (G_u), and so is its gradient buffer (R_u, the padded unit, which
/// the reduce-scatter reads; its output is the gradient shard).
/// - FullShard, HybridShard: one unit gathered at a time, two with prefetch
///   (d = 1: the next unit's gather beside the one in use), and one
///   gradient buffer, since a unit's buffer is allocated only once the
///   previous unit's reduce-scatter has ended: (1 + d)·max G + max R.
/// - ShardGradOp: every unit stays gathered from its forward to its
///   backward, and one reduction may be in flight while the next unit's
///   gradient is filled: Σ G + 2·max R. With kept units in bfloat16 (k = 2
///   bytes an element against e), the gathered part is k·Σ G + e·max G:
///   every unit's bfloat16 copy, and the value_type copy of the one the
///   model holds.
/// - A model computing in bfloat16 (h = 2 bytes): its gathered units are
///   h·G_u each, with no e-byte copy, and it writes its gradient into an
///   h·G_u buffer, which is added into the e-byte one once the unit is
///   ready; the gathered part above is then in h bytes, and the gradient
///   buffers part gains h·max G (the unit being filled). Reduced in h
///   bytes too (reduces_in_compute_type; never with offload), the e-byte
///   buffers go: the gradient buffers part is h·max G under FullShard,
///   2h·max G under ShardGradOp (one reduction in flight while the next is
///   filled).
/// - NoSync accumulation: every unit's gradient buffer at once, Σ R, in
///   place of the above's gradient buffers. ShardGradOp then holds Σ G + Σ R
///   from the first micro-step's backward to the synced step's: it keeps
///   its gathered units between micro-steps too.
/// - NoShard: the unit is its own chunk, reduced in place: nothing.
/// - Offload: the persistent part, (2 + s)·e·Σc_u, is `offloaded` instead,
///   and a gradient buffer is (n + 1)·c_u (R_u above): the reduce-scatter
///   cannot write into its own input, and the shard it would write into is
///   offloaded. A gather copies its chunk into its own block of the
///   gathered unit and gathers in place, so it needs nothing more.
/// A model that holds one unit at a time is assumed. Left out, as
/// communication scratch: sharded accumulation's c-element sum per
/// reduction and bfloat16 mixed precision's packed copies (worker side).
inline MemoryNeed sharded_memory_need(std::span<const std::size_t> unit_sizes, std::size_t n,
                                      const ShardedMemoryShape& shape) {
  MemoryNeed need;
  std::size_t chunks = 0, gathered_max = 0, gathered_sum = 0;
  for (const std::size_t p : unit_sizes) {
    const std::size_t c = shape.sharded ? (p + n - 1) / n : p;
    chunks += c;
    if (!shape.sharded) continue;
    gathered_max = std::max(gathered_max, n * c);
    gathered_sum += n * c;
  }
  // A gradient buffer is the padded unit, as a gathered one is.
  std::size_t buffer_max = gathered_max, buffer_sum = gathered_sum;
  const std::size_t e = shape.element_bytes;
  if (shape.offload && shape.sharded) {
    buffer_max = gathered_max + gathered_max / n;
    buffer_sum = gathered_sum + chunks;
    need.offloaded = e * (2 + shape.state_per_element) * chunks;
  } else {
    need.params = e * chunks;
    need.grads = e * chunks;
    need.optimizer_state = e * shape.state_per_element * chunks;
  }
  if (shape.sharded) {
    const std::size_t k = shape.kept_element_bytes;
    const std::size_t h = shape.compute_element_bytes;
    if (h != 0) {
      need.gathered = h * (shape.keeps_forward_gathers ? gathered_sum : (shape.prefetch ? 2 : 1) * gathered_max);
    } else if (shape.keeps_forward_gathers && k != 0 && k < e) {
      need.gathered = k * gathered_sum + e * gathered_max;
    } else {
      need.gathered = e * (shape.keeps_forward_gathers ? gathered_sum : (shape.prefetch ? 2 : 1) * gathered_max);
    }
    if (h != 0 && shape.reduces_in_compute_type) {
      need.gradient_buffers = h * (shape.keeps_forward_gathers ? 2 : 1) * gathered_max;
    } else {
      need.gradient_buffers =
          e * (shape.keeps_unsharded_grads ? buffer_sum : (shape.keeps_forward_gathers ? 2 : 1) * buffer_max) +
          h * gathered_max;
    }
  }
  return need;
}

/// Whether ShardGradOp should keep its gathered units as their k-byte
/// (bfloat16) copies, the one in use also in e bytes, rather than in e
/// bytes alone: k·Σ G + e·max G < e·Σ G (see sharded_memory_need). Not
/// where one unit is most of the model, as in a three-layer MLP whose
/// middle layer is half of it.
inline bool keeping_bf16_pays(std::span<const std::size_t> unit_sizes, std::size_t n, std::size_t e, std::size_t k) {
  std::size_t gathered_max = 0, gathered_sum = 0;
  for (const std::size_t p : unit_sizes) {
    const std::size_t g = n * ((p + n - 1) / n);
    gathered_max = std::max(gathered_max, g);
    gathered_sum += g;
  }
  return k * gathered_sum + e * gathered_max < e * gathered_sum;
}

/// Throws InvalidArgument when `need` exceeds `budget` bytes (0: no budget).
/// Every rank computes the same need from the units they agreed on, so
/// every rank throws alike, before it allocates or communicates more.
inline void check_memory_budget(const std::string& where, const MemoryNeed& need, std::size_t budget,
                                const std::string& advice) {
  if (budget == 0 || need.total() <= budget) return;
  throw InvalidArgument(where + ": this configuration needs " + need.describe() +
                        " per rank, over the memory_budget of " + MemoryNeed::mib(budget) + ". " + advice);
}

}  // namespace detail

}  // namespace gradsync
