#pragma once
/// \file detail::fsdp::ShardedState: what a sharded trainer's rank keeps
/// between steps (its master and gradient shards, wherever they live, the
/// replicated buffers, NoShard's views) and how construction builds it:
/// lay out the wrapped units, describe them in a ShardPlan, let the model
/// write its initial values, broadcast rank 0's and keep this rank's
/// chunks; and, between steps, gather what it keeps back into whole units.
/// Apart from the step's code because none of it runs in a step.

#include <algorithm>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradsync/collective/all_gather.hpp"
#include "gradsync/collective/broadcast.hpp"
#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/offload_space.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/train/fsdp/buffer_pool.hpp"
#include "gradsync/train/fsdp/flat_shard.hpp"
#include "gradsync/train/fsdp/offloaded.hpp"
#include "gradsync/train/fsdp/options.hpp"
#include "gradsync/train/fsdp/sharding_strategy.hpp"
#include "gradsync/train/common/bfloat16_copies.hpp"
#include "gradsync/train/common/model.hpp"
#include "gradsync/train/common/unit_agreement.hpp"
#include "gradsync/train/fsdp/shard_plan.hpp"

namespace gradsync::detail::fsdp {

/// A rank's persistent state, T the master type, C the model's compute type.
template <class T, class C>
struct ShardedState {
  static constexpr bool computes_bf16 = !std::is_same_v<C, T>;

  explicit ShardedState(const std::vector<UnitSpec>& units) noexcept : specs(units) {}
  ShardedState(const ShardedState&) = delete;
  ShardedState& operator=(const ShardedState&) = delete;

  const std::vector<UnitSpec>& specs;
  /// Where every wrapped unit lies, in the unit and in the flat shard.
  FlatShard flat;
  ShardPlan plan;
  /// Offload: where the shards (and a bindable optimizer's state) live, else null.
  std::shared_ptr<OffloadSpace> space;
  /// The master and gradient shards on the compute side (empty when offloaded),
  /// and the buffers, replicated: 64-byte aligned, as ReplicatedTrainer's, so
  /// vectorized math sums in one order whatever else the process allocated.
  Storage<T> shard_params, shard_grads, buffers;
  /// Where model unit u's buffers start in `buffers`.
  std::vector<std::size_t> buffer_offsets;
  /// Offload: the master and gradient shards and the optimizer's state, lent to it by bind_state.
  Offloaded<T> off_params, off_grads, off_state;
  /// NoShard with a bfloat16 model: the copies its steps see (else empty).
  std::vector<bfloat16> bf16_params, bf16_grads;
  /// NoShard: each model unit's view, over the shard itself or those copies.
  std::vector<UnitView<C>> resident_views;
  /// What construction held beside the persistent part (construction_bytes()).
  std::size_t construction_bytes = 0;

  /// The master parameter shard and the gradient shard, wherever they live.
  std::span<T> master() noexcept { return space ? off_params.span() : std::span<T>(shard_params); }
  std::span<const T> master() const noexcept {
    return space ? off_params.span() : std::span<const T>(shard_params);
  }
  std::span<T> grad_shard() noexcept { return space ? off_grads.span() : std::span<T>(shard_grads); }
  /// Zeroes this rank's padding (`shard_rank` in its group) after the
  /// optimizer stepped it: its gradient is zero, which moves nothing under
  /// SGD, but Adam with eps 0 makes it 0/0, and gathers, norms and
  /// checkpoints take the padding for zeros.
  void zero_padding(std::size_t shard_rank) {
    if (!flat.sharded) return;
    const std::span<T> m = master();
    for (std::size_t w = 0; w < flat.chunks.size(); ++w) {
      const std::size_t owned = flat.owned_range(w, shard_rank).second;
      std::fill(m.begin() + static_cast<std::ptrdiff_t>(flat.offsets[w] + owned),
                m.begin() + static_cast<std::ptrdiff_t>(flat.offsets[w] + flat.chunks[w]), T(0));
    }
  }

  /// This rank's chunk of wrapped unit w, padding included.
  std::span<const T> chunk(std::size_t w) const { return master().subspan(flat.offsets.at(w), flat.chunks.at(w)); }

  /// Groups the model units into wrapped units (o.wrap) over `shards` ranks
  /// (of `replicas` copies), describes them in the plan, and allocates the
  /// shards; offloaded, in the space, with the optimizer's state lent from
  /// it too when it can take it (`bind_state`), so that none of it stays on
  /// the compute side.
  template <class Opt>
  void lay_out(const ShardedTrainerOptions& o, std::size_t shards, std::size_t replicas, Opt& opt,
               std::size_t state_per_element) {
    flat = FlatShard::make(o.wrap.group(specs), specs, shards, o.strategy != ShardingStrategy::NoShard);
    space = o.offload;
    const std::size_t at = flat.shard_elements;
    if (space) {
      off_params = Offloaded<T>(space, at);
      off_grads = Offloaded<T>(space, at);
      if constexpr (requires(std::span<T> s, std::size_t n) { opt.bind_state(s, n); }) {
        if (state_per_element * at != 0) off_state = Offloaded<T>(space, state_per_element * at);
        opt.bind_state(off_state.span(), at);
      }
    } else {
      shard_params.assign(at, T(0));
      shard_grads.assign(at, T(0));
    }
    make_plan(o, shards, replicas, state_per_element);
  }

  /// Each wrapped unit's name, quoted, as its collectives' labels put it in words.
  std::vector<std::string> label_names() const {
    std::vector<std::string> names;
    for (const ShardPlan::Unit& unit : plan.units) names.push_back("'" + unit.name + "'");
    return names;
  }

  /// A custom wrapping predicate may look at more than the units: every
  /// rank must have grouped them alike. Collective over `world`.
  template <class Comm>
  void check_plan_agrees(Comm& world) const {
    std::vector<std::string> groups;
    for (const ShardPlan::Unit& unit : plan.units) {
      groups.push_back("'" + unit.name + "' (model units " + std::to_string(unit.model_units.front()) + " to " +
                       std::to_string(unit.model_units.back()) + ")");
    }
    check_units_agree(world, groups, "ShardedTrainer wrapping plan",
                      "The custom WrapPolicy predicate must group the units alike on every rank: check what it "
                      "depends on besides its arguments (rank, configuration).");
  }

  /// Views of model unit `layer` over `params` and `grads` (as many, or
  /// none), and its buffers (master-type views only: a bfloat16 model has none).
  template <class E>
  UnitView<E> make_view(std::size_t layer, std::span<E> params, std::type_identity_t<std::span<E>> grads) {
    UnitView<E> v = param_views(specs[layer], params, grads);
    if constexpr (std::is_same_v<E, T>) {
      add_buffer_views(v, specs[layer], std::span<T>(buffers).subspan(buffer_offsets[layer]));
    }
    return v;
  }

  /// The model writes its initial values, rank 0's are broadcast over
  /// `world`, and this rank (`shard_rank` of its group) keeps its chunks.
  /// Where they are written decides construction's memory (construction_need):
  /// - NoShard: the shard is every unit whole, in order, so the model
  ///   writes into it and it is broadcast in place;
  /// - a model with init_unit: one wrapped unit at a time, into one buffer
  ///   of the largest wrapped unit, broadcast, then its chunk kept;
  /// - a model with bind only: every parameter at once, then the same.
  template <class Algo, class M, class Comm>
  void initialise(M& model, Comm& world, const Options& collective, std::size_t shard_rank) {
    std::size_t nb = 0;
    for (const UnitSpec& s : specs) {
      buffer_offsets.push_back(nb);
      for (const TensorSpec& t : s.buffers) nb += t.count();
    }
    buffers.assign(nb, T(0));
    const Broadcast<Algo> broadcast{collective};
    if (!flat.sharded) {
      resident(model);
      broadcast(world, std::span<T>(shard_params), 0);
    } else if constexpr (ModelInitsUnits<M>) {
      // Rank 0 decides every value, so every rank broadcasts unit by unit alike.
      std::vector<T> unit(std::ranges::max(flat.sizes));
      construction_bytes = unit.size() * sizeof(T);
      for (std::size_t w = 0; w < flat.groups.size(); ++w) {
        const std::span<T> full = std::span<T>(unit).first(flat.sizes[w]);
        for (std::size_t m = flat.first_member(w); m <= flat.last_member(w); ++m) {
          model.init_unit(m, make_view(m, full.subspan(flat.member_offset[m], flat.model_sizes[m]), {}));
        }
        if (full.empty()) continue;
        broadcast(world, full, 0);
        keep_owned(w, full, shard_rank);
      }
    } else {
      std::vector<T> params(flat.total, T(0));
      construction_bytes = params.size() * sizeof(T);
      std::vector<UnitView<T>> views;
      // A wrapped unit's members are consecutive, so it is one range of `params`.
      std::size_t at = 0;
      for (std::size_t m = 0; m < specs.size(); ++m) {
        views.push_back(make_view(m, std::span<T>(params).subspan(at, flat.model_sizes[m]), {}));
        at += flat.model_sizes[m];
      }
      model.bind(std::span<const UnitView<T>>(views));
      broadcast(world, std::span<T>(params), 0);
      at = 0;
      for (std::size_t w = 0; w < flat.groups.size(); ++w) {
        keep_owned(w, std::span<const T>(params).subspan(at, flat.sizes[w]), shard_rank);
        at += flat.sizes[w];
      }
    }
    if (!buffers.empty()) broadcast(world, std::span<T>(buffers), 0);
  }

  /// NoShard with a bfloat16 model: its copy of the parameters, rounded
  /// from the shard (which the optimizer, a checkpoint's load or the user
  /// may have changed); `zero_grads`: a step's, whose gradients start at 0.
  void round_copies(bool zero_grads) {
    if constexpr (computes_bf16) {
      if (flat.sharded) return;
      round_into(std::span<const T>(shard_params), std::span<bfloat16>(bf16_params));
      if (zero_grads) std::ranges::fill(bf16_grads, bfloat16(0.0f));
    }
  }

  /// One wrapped unit's `chunk` (c elements of a shard-shaped buffer)
  /// gathered over `group` into `full` (its size · c, padding last);
  /// NoShard, where the chunk is the whole unit: copied. Collective over the group.
  template <class Algo, class Comm>
  void gather_chunk(Comm& group, std::span<const T> chunk, std::span<T> full, const Options& opts) const {
    if (!flat.sharded) {
      std::ranges::copy(chunk, full.begin());
      return;
    }
    AllGather<Algo>{opts}(group, chunk, full);
  }

  /// Every wrapped unit's parameters, unpadded, in order, gathered over
  /// `group` (the shard group); `opts_of(w)` labels unit w's gather.
  /// Collective over the group.
  template <class Algo, class Comm, class Labeller>
  std::vector<T> gather_all(Comm& group, Labeller&& opts_of) const {
    std::vector<T> all;
    all.reserve(flat.total);
    const auto shards = static_cast<std::size_t>(flat.sharded ? group.size() : 1);
    for (std::size_t w = 0; w < flat.groups.size(); ++w) {
      const std::size_t c = flat.chunks[w];
      std::vector<T> full(c * shards);
      std::span<const T> in = chunk(w);
      if (space) {
        // The offloaded chunk crosses by copy, into its own block: gathered in place.
        const std::span<T> own = std::span<T>(full).subspan(static_cast<std::size_t>(group.rank()) * c, c);
        space->copy_in(own.data(), in.data(), own.size_bytes());
        space->wait();
        in = own;
      }
      gather_chunk<Algo>(group, in, std::span<T>(full), opts_of(w));
      all.insert(all.end(), full.begin(), full.begin() + static_cast<std::ptrdiff_t>(flat.sizes[w]));
    }
    return all;
  }

 private:
  /// The ShardPlan of the layout: each wrapped unit's model units, sizes and bytes.
  void make_plan(const ShardedTrainerOptions& o, std::size_t shards, std::size_t replicas,
                 std::size_t state_per_element) {
    plan.policy = o.wrap.describe();
    plan.strategy = name(o.strategy);
    plan.shards = static_cast<int>(shards);
    plan.replicas = static_cast<int>(replicas);
    plan.element_bytes = sizeof(T);
    plan.state_per_element = state_per_element;
    for (std::size_t w = 0; w < flat.groups.size(); ++w) {
      ShardPlan::Unit unit;
      const auto [first, last] = flat.groups[w];
      unit.name = first == last ? specs[first].name : specs[first].name + ".." + specs[last].name;
      for (std::size_t m = first; m <= last; ++m) unit.model_units.push_back(m);
      unit.params = flat.sizes[w];
      unit.shard = flat.chunks[w];
      unit.padding = flat.sharded ? shards * flat.chunks[w] - flat.sizes[w] : 0;
      unit.bytes_per_rank = (2 + state_per_element) * sizeof(T) * flat.chunks[w];
      unit.gathered_bytes = flat.sharded ? shards * flat.chunks[w] * sizeof(C) : 0;
      plan.units.push_back(std::move(unit));
    }
  }


  /// NoShard: the model sees the shard in place, in steps too (check_offload
  /// refuses NoShard with offload); a bfloat16 model sees copies of it
  /// (every unit whole), as under ReplicatedTrainer. It writes its initial values.
  template <class M>
  void resident(M& model) {
    std::vector<UnitView<T>> views;
    resident_views.resize(specs.size());
    for (std::size_t m = 0; m < specs.size(); ++m) {
      const std::size_t from = flat.offsets[flat.member_of[m]] + flat.member_offset[m];
      views.push_back(make_view(m, std::span<T>(shard_params).subspan(from, flat.model_sizes[m]),
                                std::span<T>(shard_grads).subspan(from, flat.model_sizes[m])));
      if constexpr (!computes_bf16) resident_views[m] = views.back();
    }
    if constexpr (computes_bf16) {
      bf16_params.assign(shard_params.size(), bfloat16(0.0f));
      bf16_grads.assign(shard_grads.size(), bfloat16(0.0f));
      for (std::size_t m = 0; m < specs.size(); ++m) {
        const std::size_t from = flat.offsets[flat.member_of[m]] + flat.member_offset[m];
        resident_views[m] = make_view(m, std::span<bfloat16>(bf16_params).subspan(from, flat.model_sizes[m]),
                                      std::span<bfloat16>(bf16_grads).subspan(from, flat.model_sizes[m]));
      }
    }
    write_initial_values(model, std::span<const UnitView<T>>(views));
  }

  /// Copies this rank's part of wrapped unit w (its `full` values, unpadded) into its master chunk.
  void keep_owned(std::size_t w, std::span<const T> full, std::size_t shard_rank) {
    const auto [owned_begin, owned_count] = flat.owned_range(w, shard_rank);
    std::copy_n(full.begin() + static_cast<std::ptrdiff_t>(owned_begin), owned_count,
                master().begin() + static_cast<std::ptrdiff_t>(flat.offsets[w]));
  }
};

}  // namespace gradsync::detail::fsdp
