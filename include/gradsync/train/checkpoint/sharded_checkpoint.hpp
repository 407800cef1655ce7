#pragma once
/// \file The ShardedTrainer side of save_checkpoint / load_checkpoint: the same
/// calls, names and files as a ReplicatedTrainer's, full or sharded, at any
/// world size.

#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include "gradsync/train/checkpoint/checkpoint_options.hpp"
#include "gradsync/train/checkpoint/checkpoint_source.hpp"
#include "gradsync/train/data/distributed_sampler.hpp"
#include "gradsync/train/checkpoint/replicated_checkpoint.hpp"
#include "gradsync/train/fsdp/sharded_trainer.hpp"
#include "gradsync/train/checkpoint/state_layout.hpp"

namespace gradsync {
namespace detail {

/// The elements of the flat parameters a sharded trainer's rank owns, one
/// range per wrapped unit (none where its chunk is all padding).
template <class Trainer>
std::vector<HeldRange> owned_ranges(const Trainer& trainer) {
  std::vector<HeldRange> held;
  std::size_t start = 0;
  for (std::size_t u = 0; u < trainer.unit_count(); ++u) {
    const auto [first, count] = trainer.owned_range(u);
    if (count > 0) held.push_back({start + first, start + first + count, trainer.chunk_offset(u)});
    start += trainer.unit_size(u);
  }
  return held;
}

template <class M, class Opt, class Comm, class Algo>
struct TrainerCheckpoint<ShardedTrainer<M, Opt, Comm, Algo>> {
  using Trainer = ShardedTrainer<M, Opt, Comm, Algo>;
  using T = typename Trainer::value_type;

  /// A rank's shard; one copy of each is written, replica 0's.
  static ShardSource<T> held(Trainer& trainer) {
    return {trainer.shard_rank(), trainer.shard_count(), trainer.replica() == 0, owned_ranges(trainer),
            std::as_const(trainer).shard(), trainer.buffers()};
  }
  static std::span<T> params(Trainer& trainer) { return trainer.shard(); }
  /// Replica 0 gathers one wrapped unit at a time (parameters, then each
  /// optimizer buffer) and rank 0 streams that unit's tensors into the file,
  /// so it holds (1 + S) gathered units at most, never the model twice. A
  /// write that fails on rank 0 stops the writing, not the gathers, so no
  /// rank waits on it.
  template <class Out>
  static void write_full(Trainer& trainer, const SaveList<T>& l, Out& out) {
    const std::span<const T> buffers = trainer.buffers();
    std::size_t next = 0;
    // Writes the tensors whose data is here: every one up to the first that lies past `end` of the flat parameters.
    auto write_through = [&](std::size_t start, std::size_t end, const std::vector<std::vector<T>>& full) {
      for (; next < l.tensors.size(); ++next) {
        const StateTensor& t = l.tensors[next];
        if (t.source != StateSource::buffer && t.offset + t.count > end) return;
        if (!out.writing()) continue;
        const std::span<const T> from =
            t.count == 0                      ? std::span<const T>()
            : t.source == StateSource::buffer
                ? buffers.subspan(t.offset, t.count)
                : std::span<const T>(full[t.source == StateSource::parameter ? 0 : 1 + t.buffer])
                      .subspan(t.offset - start, t.count);
        out.write(t.info.name, from);
      }
    };
    if (trainer.replica() == 0) {
      const bool stepped = l.opt.buffers.empty() || !l.opt.buffers.front().second.empty();
      const auto shards = static_cast<std::size_t>(trainer.shard_count());
      const std::span<const T> shard = std::as_const(trainer).shard();
      std::size_t start = 0;
      for (std::size_t u = 0; u < trainer.unit_count(); ++u) {
        const std::size_t c = trainer.chunk_size(u), at = trainer.chunk_offset(u);
        std::vector<std::vector<T>> full(1 + l.opt.buffers.size(), std::vector<T>(shards * c));
        trainer.gather_chunk(u, shard.subspan(at, c), full[0]);
        const std::vector<T> zeros(stepped ? 0 : c);
        for (std::size_t k = 0; k < l.opt.buffers.size(); ++k) {
          trainer.gather_chunk(u, stepped ? l.opt.buffers[k].second.subspan(at, c) : std::span<const T>(zeros),
                               full[1 + k]);
        }
        start += trainer.unit_size(u);
        write_through(start - trainer.unit_size(u), start, full);
      }
      write_through(start, start, {});
    }
  }
};

}  // namespace detail
}  // namespace gradsync
