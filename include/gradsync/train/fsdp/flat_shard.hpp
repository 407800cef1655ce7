#pragma once
/// \file detail::fsdp::FlatShard: where each wrapped unit's parameters lie, in
/// the unit and in this rank's flat shard, and the views the model is lent
/// over them. Pure arithmetic on sizes, kept apart from the trainer so that
/// the layout (padding, owned ranges) can be read without its lifecycle.

#include <algorithm>
#include <cstddef>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradsync/train/common/model.hpp"

namespace gradsync::detail::fsdp {

/// The layout of the wrapped units over N shards: wrapped unit w of P
/// elements is padded with zeros to N·c, c = ⌈P/N⌉ (P when not sharded),
/// and its chunk lies at offsets[w] of the flat shard.
struct FlatShard {
  /// Wrapped unit w is model units [groups[w].first, groups[w].second].
  std::vector<std::pair<std::size_t, std::size_t>> groups;
  /// Model unit u's elements, and where it lies: in wrapped unit
  /// member_of[u], member_offset[u] elements from its start.
  std::vector<std::size_t> model_sizes, member_of, member_offset;
  /// Per wrapped unit: elements (unpadded), chunk per rank, where its chunk
  /// starts in the flat shard.
  std::vector<std::size_t> sizes, chunks, offsets;
  /// Elements of every unit, unpadded.
  std::size_t total = 0;
  /// Elements of the flat shard: the chunks one after the other.
  std::size_t shard_elements = 0;
  /// Units are split over the shards (else every rank keeps them whole).
  bool sharded = true;

  /// Lays out the model units `specs`, grouped by `grouped` (consecutive
  /// ranges, from the wrap policy), over `shards` ranks.
  static FlatShard make(std::vector<std::pair<std::size_t, std::size_t>> grouped, const std::vector<UnitSpec>& specs,
                        std::size_t shards, bool sharded) {
    FlatShard f;
    f.groups = std::move(grouped);
    f.sharded = sharded;
    for (const UnitSpec& s : specs) {
      std::size_t p = 0;
      for (const TensorSpec& t : s.params) p += t.count();
      f.model_sizes.push_back(p);
    }
    f.member_of.resize(specs.size());
    f.member_offset.resize(specs.size());
    std::size_t at = 0;
    for (std::size_t w = 0; w < f.groups.size(); ++w) {
      std::size_t p = 0;
      for (std::size_t m = f.groups[w].first; m <= f.groups[w].second; ++m) {
        f.member_of[m] = w;
        f.member_offset[m] = p;
        p += f.model_sizes[m];
      }
      const std::size_t c = sharded ? (p + shards - 1) / shards : p;
      f.sizes.push_back(p);
      f.chunks.push_back(c);
      f.offsets.push_back(at);
      at += c;
      f.total += p;
    }
    f.shard_elements = at;
    return f;
  }

  /// Model units [first, last] of wrapped unit w.
  std::size_t first_member(std::size_t w) const noexcept { return groups[w].first; }
  std::size_t last_member(std::size_t w) const noexcept { return groups[w].second; }

  /// Unit u's elements shard `rank` owns, [first, first + count) of the
  /// unit; the rest of its chunk is zero padding. Not sharded: all of them.
  std::pair<std::size_t, std::size_t> owned_range(std::size_t u, std::size_t rank) const {
    const std::size_t c = chunks.at(u), p = sizes.at(u);
    if (!sharded) return {0, p};
    const std::size_t first = std::min(p, rank * c);
    return {first, std::min(c, p - first)};
  }
};

/// Views of one model unit over `params` (its elements) and `grads` (as
/// many, or none): a tensor view per parameter, in declaration order.
template <class T>
UnitView<T> param_views(const UnitSpec& spec, std::span<T> params, std::type_identity_t<std::span<T>> grads) {
  UnitView<T> v;
  std::size_t p = 0;
  for (const TensorSpec& t : spec.params) {
    const std::span<T> g = grads.empty() ? std::span<T>() : grads.subspan(p, t.count());
    v.params.push_back({params.subspan(p, t.count()), g, &t});
    p += t.count();
  }
  v.flat_params = params;
  v.flat_grads = grads;
  return v;
}

/// Adds the unit's buffer views to `v`, over `buffers`, which starts at the
/// unit's first buffer element.
template <class T>
void add_buffer_views(UnitView<T>& v, const UnitSpec& spec, std::span<T> buffers) {
  std::size_t b = 0;
  for (const TensorSpec& t : spec.buffers) {
    v.buffers.push_back({buffers.subspan(b, t.count()), {}, &t});
    b += t.count();
  }
  v.flat_buffers = buffers.first(b);
}

}  // namespace gradsync::detail::fsdp
