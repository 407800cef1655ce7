#pragma once
/// \file detail::ShardSource: what one rank contributes to a sharded
/// checkpoint, and the pieces of its shard file, which the synchronous save
/// streams from the trainer and the asynchronous one copies into a snapshot.

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include "gradsync/checkpoint/shard_writer.hpp"
#include "gradsync/train/checkpoint/state_layout.hpp"
#include "gradsync/train/optim/optimizer.hpp"

namespace gradsync::detail {

/// Elements [begin, end) of the flat parameters (every unit's, in order)
/// that a rank holds, at element `at` of its own array (and of its
/// optimizer's buffers, which step that array).
struct HeldRange {
  std::size_t begin = 0, end = 0, at = 0;
};

/// The pieces of one rank's shard file, in the order it writes them, each
/// with the bytes that hold it (in the trainer, or in `zeros`).
template <class T>
struct ShardPieces {
  std::vector<checkpoint::ShardRange> ranges;
  std::vector<std::span<const std::byte>> data;
  /// The state of an optimizer that has not stepped: zeros.
  std::vector<T> zeros;
};

/// What one rank contributes to a sharded checkpoint.
template <class T>
struct ShardSource {
  /// Its shard's number and how many there are; it writes only if `writes`
  /// (one copy of every shard is written: replica 0's).
  int shard = 0, shards = 1;
  bool writes = false;
  std::vector<HeldRange> held;
  std::span<const T> params, buffers;

  /// The ranges this rank's file holds: of each tensor the parts it holds
  /// (and, shard 0 only, the buffers and the scalars), with their bytes.
  ShardPieces<T> pieces(std::span<const StateTensor> tensors, std::span<const StateScalar> scalars,
                        const OptimizerStateView<T>& opt) const {
    ShardPieces<T> p;
    const bool first = shard == 0;
    p.zeros.resize(opt.buffers.empty() || !opt.buffers.front().second.empty() ? 0 : params.size());
    for (const StateTensor& t : tensors) {
      if (t.source == StateSource::buffer) {
        if (first && t.count > 0) {
          p.ranges.push_back({t.info.name, 0, t.count});
          p.data.push_back(std::as_bytes(buffers.subspan(t.offset, t.count)));
        }
        continue;
      }
      const std::span<const T> from = t.source == StateSource::parameter ? params
                                      : opt.buffers[t.buffer].second.empty()
                                          ? std::span<const T>(p.zeros)
                                          : opt.buffers[t.buffer].second;
      for (const HeldRange& h : held) {
        const std::size_t lo = std::max(t.offset, h.begin), hi = std::min(t.offset + t.count, h.end);
        if (lo >= hi) continue;
        p.ranges.push_back({t.info.name, lo - t.offset, hi - t.offset});
        p.data.push_back(std::as_bytes(from.subspan(h.at + (lo - h.begin), hi - lo)));
      }
    }
    if (first) {
      for (const StateScalar& s : scalars) {
        p.ranges.push_back({s.name, 0, 1});
        p.data.push_back(s.data());
      }
    }
    return p;
  }
};

}  // namespace gradsync::detail
