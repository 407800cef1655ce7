#pragma once
/// \file detail::fsdp::clip_grad_norm: ShardedTrainer's gradient clipping,
/// where each rank holds only its shard of the gradient. The arithmetic (a
/// partial of order p, the norm from the combined partials, the scale) is
/// train/optim/clip_grad_norm.hpp's, shared with ReplicatedTrainer; what is
/// here is which groups combine the partials, which only the sharded layout
/// decides.

#include <array>
#include <cmath>
#include <span>

#include "gradsync/collective/all_reduce.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/train/fsdp/hybrid_groups.hpp"
#include "gradsync/train/optim/clip_grad_norm.hpp"

namespace gradsync::detail::fsdp {

/// The global norm of order p of the gradient whose shard on this rank is
/// `grads`, the same on every rank, and `grads` scaled by max_norm /
/// (norm + 1e-6) when the norm is larger. `sharded`: the strategy shards
/// (not NoShard, where every rank holds the whole gradient). `opts` carry
/// the label that names max_norm and p, so ranks that clip differently fail
/// here together. Collective over the world.
template <class Algo, class T, class Comm>
double clip_grad_norm(HybridGroups<Comm>& comms, bool sharded, std::span<T> grads, double max_norm, double p,
                      const Options& opts) {
  double partial = norm_partial(std::span<const T>(grads), p);
  const AllReduce<Algo> all_reduce{opts};
  // HybridShard: the agreement on max_norm and p over all ranks comes
  // first, so that a rank which clips while its peers do not meets them on
  // the world, not in a shard group they never call in.
  if (sharded) comms.template enter<Algo>(opts);
  // Replicas hold the same shards: the shard group's partials are the whole.
  if (sharded && comms.shard().size() > 1) {
    if (std::isinf(p)) {
      std::array<double, 2> pair = inf_partial_for_max(partial);
      all_reduce(comms.shard(), std::span<double>(pair), Max{});
      partial = combined_inf_partial(pair);
    } else {
      all_reduce(comms.shard(), std::span<double>(&partial, 1), Sum{});
    }
  }
  // NoShard: every rank holds the whole gradient, so one 8-byte Max of
  // equal values over all ranks is the agreement on max_norm and p: ranks
  // that clip differently would step apart silently.
  if (!sharded && comms.world().size() > 1) {
    all_reduce(comms.world(), std::span<double>(&partial, 1), Max{});
  }
  const double total = norm_total(partial, p);
  clip_to(grads, total, max_norm);
  return total;
}

}  // namespace gradsync::detail::fsdp
