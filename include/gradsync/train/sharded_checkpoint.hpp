#pragma once
/// \file save_checkpoint / load_checkpoint of a ShardedTrainer: the same
/// calls, names and files as a ReplicatedTrainer's, full or sharded, at any
/// world size.

#include <algorithm>
#include <cstddef>
#include <exception>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gradsync/checkpoint/safetensors_writer.hpp"
#include "gradsync/train/checkpoint_options.hpp"
#include "gradsync/train/checkpoint_source.hpp"
#include "gradsync/train/distributed_sampler.hpp"
#include "gradsync/train/replicated_checkpoint.hpp"
#include "gradsync/train/sharded_trainer.hpp"
#include "gradsync/train/state_layout.hpp"

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

/// A full checkpoint of a sharded trainer: replica 0 gathers one wrapped
/// unit at a time (parameters, then each optimizer buffer) and rank 0
/// streams that unit's tensors into the file, so it holds (1 + S) gathered
/// units at most, never the model twice. A write that fails on rank 0 stops
/// the writing, not the gathers, so no rank waits on it.
template <class Trainer>
void save_full_sharded(Trainer& trainer, const DistributedSampler* sampler, const std::filesystem::path& path,
                       const checkpoint::Metadata& metadata) {
  using T = typename Trainer::value_type;
  const SaveList<T> l = save_list(trainer, sampler, metadata);
  auto& comm = trainer.communicator();
  const std::filesystem::path file = checkpoint_file(path);
  std::exception_ptr error;
  std::optional<checkpoint::SafetensorsWriter> writer;
  if (comm.rank() == 0) {
    try {
      if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path());
      writer.emplace(file, l.infos, state_metadata(metadata, l.opt.kind, comm.size()));
    } catch (...) {
      error = std::current_exception();
    }
  }
  const std::span<const T> buffers = trainer.buffers();
  std::size_t next = 0;
  // Writes the tensors whose data is here: every one up to the first that lies past `end` of the flat parameters.
  auto write_through = [&](std::size_t start, std::size_t end, const std::vector<std::vector<T>>& full) {
    for (; next < l.tensors.size(); ++next) {
      const StateTensor& t = l.tensors[next];
      if (t.source != StateSource::buffer && t.offset + t.count > end) return;
      if (!writer) continue;
      try {
        const std::span<const T> from =
            t.count == 0                      ? std::span<const T>()
            : t.source == StateSource::buffer
                ? buffers.subspan(t.offset, t.count)
                : std::span<const T>(full[t.source == StateSource::parameter ? 0 : 1 + t.buffer])
                      .subspan(t.offset - start, t.count);
        writer->write(t.info.name, from);
      } catch (...) {
        error = std::current_exception();
        writer.reset();
      }
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
  if (writer) {
    try {
      for (const StateScalar& s : l.scalars) writer->write(s.name, s.data());
      writer->commit();
      if (path.extension() != ".safetensors") remove_other_layout(path, CheckpointFormat::full);
    } catch (...) {
      error = std::current_exception();
    }
  }
  agree<typename Trainer::algorithm>(comm, error, "save_checkpoint of '" + file.string() + "'");
}

template <class Trainer>
void save_sharded_trainer(Trainer& trainer, const DistributedSampler* sampler, const std::filesystem::path& path,
                          const checkpoint::Metadata& metadata, CheckpointOptions options) {
  using T = typename Trainer::value_type;
  if (options.format == CheckpointFormat::full) return save_full_sharded(trainer, sampler, path, metadata);
  check_sharded_path(path);
  const SaveList<T> l = save_list(trainer, sampler, metadata);
  const ShardSource<T> me{trainer.shard_rank(), trainer.shard_count(), trainer.replica() == 0, owned_ranges(trainer),
                          std::as_const(trainer).shard(), trainer.buffers()};
  save_sharded<typename Trainer::algorithm>(trainer.communicator(), l, me, path, metadata);
}

/// Each rank reads only the ranges it owns (from a full file: each tensor
/// it owns a part of, whole, for its checksum), then the agreement, then the
/// commit into the shard, which cannot throw.
template <class Trainer>
checkpoint::Metadata load_sharded_trainer(Trainer& trainer, DistributedSampler* sampler,
                                          const std::filesystem::path& path) {
  using T = typename Trainer::value_type;
  const std::vector<HeldRange> held = owned_ranges(trainer);
  const std::size_t local = std::as_const(trainer).shard().size();
  return load_state(trainer, sampler, path, held, local, [&](StagedState<T>& s) {
    std::copy(s.params.begin(), s.params.end(), trainer.shard().begin());
  });
}

}  // namespace detail

/// Saves the whole training state of a ShardedTrainer, as save_checkpoint
/// of a ReplicatedTrainer does and under the same names, at the trainer's
/// full, unpadded shapes. CheckpointFormat::full (the default): one file,
/// `path` or `path/checkpoint.safetensors`, that rank 0 writes while the
/// shard group gathers one unit at a time. CheckpointFormat::sharded: `path`
/// is a directory; each rank of replica 0 writes what it owns and rank 0
/// then puts `checkpoint.index.json` in place, so the checkpoint appears
/// only once every file is durable. Collective; if any rank fails, every
/// rank throws.
template <class M, class Opt, class Comm, class Algo>
void save_checkpoint(ShardedTrainer<M, Opt, Comm, Algo>& trainer, const DistributedSampler& sampler,
                     const std::filesystem::path& path, const checkpoint::Metadata& metadata = {},
                     CheckpointOptions options = {}) {
  detail::save_sharded_trainer(trainer, &sampler, path, metadata, options);
}

/// save_checkpoint without a sampler.
template <class M, class Opt, class Comm, class Algo>
void save_checkpoint(ShardedTrainer<M, Opt, Comm, Algo>& trainer, const std::filesystem::path& path,
                     const checkpoint::Metadata& metadata = {}, CheckpointOptions options = {}) {
  detail::save_sharded_trainer(trainer, nullptr, path, metadata, options);
}

/// Loads a checkpoint of either layout, written at any world size by either
/// trainer, into a ShardedTrainer: each rank reads only the element ranges
/// it owns. All or nothing on every rank, as for a ReplicatedTrainer.
template <class M, class Opt, class Comm, class Algo>
checkpoint::Metadata load_checkpoint(ShardedTrainer<M, Opt, Comm, Algo>& trainer, DistributedSampler& sampler,
                                     const std::filesystem::path& path) {
  return detail::load_sharded_trainer(trainer, &sampler, path);
}

/// load_checkpoint without a sampler: a sampler's state in the file is ignored.
template <class M, class Opt, class Comm, class Algo>
checkpoint::Metadata load_checkpoint(ShardedTrainer<M, Opt, Comm, Algo>& trainer, const std::filesystem::path& path) {
  return detail::load_sharded_trainer(trainer, nullptr, path);
}

}  // namespace gradsync
