#pragma once
/// \file save_checkpoint / load_checkpoint of a ReplicatedTrainer: the whole
/// training state, committed atomically by rank 0 once every rank's files
/// are durable, loaded all or nothing by every rank.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gradsync/checkpoint/safetensors_reader.hpp"
#include "gradsync/checkpoint/safetensors_writer.hpp"
#include "gradsync/checkpoint/shard_index.hpp"
#include "gradsync/checkpoint/shard_writer.hpp"
#include "gradsync/checkpoint/tensor_info.hpp"
#include "gradsync/collective/all_gather.hpp"
#include "gradsync/collective/broadcast.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/trace_scope.hpp"
#include "gradsync/train/common/hash_bytes.hpp"
#include "gradsync/train/checkpoint/checkpoint_directory.hpp"
#include "gradsync/train/checkpoint/checkpoint_options.hpp"
#include "gradsync/train/checkpoint/checkpoint_source.hpp"
#include "gradsync/train/checkpoint/pending_saves.hpp"
#include "gradsync/train/checkpoint/save_agreement.hpp"
#include "gradsync/train/checkpoint/shard_source.hpp"
#include "gradsync/train/data/distributed_sampler.hpp"
#include "gradsync/train/optim/optimizer.hpp"
#include "gradsync/train/ddp/replicated_trainer.hpp"
#include "gradsync/train/checkpoint/state_layout.hpp"

namespace gradsync {

/// The file load_checkpoint reads for `path`: `path` itself if it ends in
/// `.safetensors` or `.index.json`; in a directory, the file its
/// `checkpoint.commit` names (the committed generation's full file or
/// sharded index), or in a directory saved before commit files its
/// `checkpoint.index.json` if there is one, else its `checkpoint.safetensors`;
/// `path/checkpoint.commit` if the directory holds none. Throws Error if the
/// commit file is damaged.
inline std::filesystem::path checkpoint_file(const std::filesystem::path& path) {
  const auto entry = detail::find_checkpoint(path);
  return entry ? entry->file : path / detail::commit_file_name;
}

namespace detail {

/// `__metadata__` keys gradsync writes besides the file layer's own.
inline constexpr std::string_view checkpoint_kind = "training-state/1";
inline constexpr std::string_view optimizer_kind_key = "gradsync.optimizer";
inline constexpr std::string_view world_size_key = "gradsync.world_size";

template <class Trainer>
void check_checkpointable(Trainer& trainer, const char* what) {
  using T = typename Trainer::value_type;
  static_assert(CheckpointableOptimizer<typename Trainer::optimizer_type, T>,
                "gradsync::save_checkpoint / load_checkpoint: the optimizer must provide state(), check_state() "
                "and load_state() (gradsync::CheckpointableOptimizer; Sgd, Adam and AdamW do)");
  if (!trainer.between_steps()) {
    throw InvalidArgument(std::string("gradsync: ") + what + " on rank " +
                          std::to_string(trainer.communicator().rank()) +
                          " between forward_backward() and optimizer_step(), or after accumulate(): gradients are "
                          "not saved, so a checkpoint is taken or loaded between steps");
  }
}

/// Every rank says whether its part went well; every rank learns which
/// failed. This is the barrier of save and load, and what makes a rank
/// whose part failed fail the others at once rather than leave them waiting.
template <class Algo, class Comm>
std::vector<std::int32_t> gather_failures(Comm& comm, bool failed) {
  const std::int32_t mine = failed ? 1 : 0;
  std::vector<std::int32_t> all(static_cast<std::size_t>(comm.size()));
  AllGather<Algo>{}(comm, std::span<const std::int32_t>(&mine, 1), std::span<std::int32_t>(all));
  return all;
}

/// What a save writes, built and checked on every rank before any
/// communication: the tensors of the state, its scalars, and their specs.
template <class T>
struct SaveList {
  OptimizerStateView<T> opt;
  std::vector<StateTensor> tensors;
  std::vector<StateScalar> scalars;
  std::vector<checkpoint::TensorInfo> infos;
};

template <class Trainer>
SaveList<typename Trainer::value_type> save_list(Trainer& trainer, const DistributedSampler* sampler,
                                                 const checkpoint::Metadata& metadata) {
  using T = typename Trainer::value_type;
  check_checkpointable(trainer, "save_checkpoint");
  for (const auto& [k, v] : metadata) {
    if (k.starts_with("gradsync.")) {
      throw InvalidArgument("gradsync: save_checkpoint: metadata key '" + k +
                            "' is reserved (keys starting with 'gradsync.' are gradsync's own)");
    }
  }
  SaveList<T> l;
  l.opt = trainer.optimizer().state();
  std::vector<std::string_view> buffer_names;
  for (const auto& b : l.opt.buffers) buffer_names.push_back(b.first);
  l.tensors = state_tensors<T>(trainer.units(), buffer_names);
  const SamplerState sampler_state = sampler ? sampler->state() : SamplerState{};
  l.scalars = state_scalars<T>(trainer.step_count(), l.opt, sampler ? &sampler_state : nullptr);
  for (const StateTensor& t : l.tensors) l.infos.push_back(t.info);
  for (const StateScalar& s : l.scalars) l.infos.push_back(s.info());
  for (std::size_t i = 0; i < l.infos.size(); ++i) {
    for (std::size_t j = 0; j < i; ++j) {
      if (l.infos[i].name == l.infos[j].name) {
        throw InvalidArgument("gradsync: save_checkpoint: two tensors of the training state are both called '" +
                              l.infos[i].name + "'; rename a unit or tensor of the model");
      }
    }
  }
  return l;
}

/// The user's metadata and gradsync's strings of a training state.
inline checkpoint::Metadata state_metadata(const checkpoint::Metadata& metadata, std::string_view optimizer,
                                           int world) {
  checkpoint::Metadata meta = metadata;
  meta[std::string(checkpoint_kind_key)] = std::string(checkpoint_kind);
  meta[std::string(optimizer_kind_key)] = std::string(optimizer);
  meta[std::string(world_size_key)] = std::to_string(world);
  return meta;
}

/// Refuses a sharded save to a path that names a file, on every rank alike.
inline void check_sharded_path(const std::filesystem::path& path) {
  const std::string name = path.filename().string();
  if (path.extension() == ".safetensors" || name.ends_with(".index.json") || name == commit_file_name) {
    throw InvalidArgument("gradsync: save_checkpoint: a sharded checkpoint is a directory (its commit file, index and "
                          "one file per shard), but '" + path.string() + "' names a file; give the directory");
  }
}

/// Refuses a full save to a path that names a sharded checkpoint's index or
/// the commit file: a full checkpoint is a directory or a `.safetensors` file.
inline void check_full_path(const std::filesystem::path& path, bool sharded) {
  const std::string name = path.filename().string();
  if (!sharded && (name.ends_with(".index.json") || name == commit_file_name)) {
    throw InvalidArgument("gradsync: save_checkpoint: '" + path.string() + "' names a sharded checkpoint's " +
                          (name == commit_file_name ? "commit file" : "index") +
                          "; a full checkpoint goes to a directory or a .safetensors file");
  }
}

/// The message and class of a failure, as `agree` sends it to the other ranks.
struct FailureReport {
  enum Kind : std::int64_t { error, invalid_argument, file };
  Kind kind = error;
  std::int64_t os_error = 0;
  std::string text, path;
};

/// The class and message of exception `e`.
inline FailureReport report_of(const std::exception_ptr& e) {
  FailureReport r;
  try {
    std::rethrow_exception(e);
  } catch (const FileError& x) {
    r = {FailureReport::file, x.os_error(), x.what(), x.path()};
  } catch (const InvalidArgument& x) {
    r = {FailureReport::invalid_argument, 0, x.what(), ""};
  } catch (const std::exception& x) {
    r.text = x.what();
  } catch (...) {
    r.text = "an exception that is not a std::exception";
  }
  return r;
}

[[noreturn]] inline void throw_report(const FailureReport& r, const std::string& message) {
  switch (r.kind) {
    case FailureReport::file: throw FileError(message, r.path, static_cast<int>(r.os_error));
    case FailureReport::invalid_argument: throw InvalidArgument(message);
    case FailureReport::error: break;
  }
  throw Error(message);
}

/// The agreement that ends each phase of a save or a load: if any rank
/// failed, the first that did sends its error to the others, so that every
/// rank throws an error of the same class naming that rank and its reason
/// (its file and tensor, or its path and the system's reason); a rank that
/// failed too throws its own. Every error is a gradsync::Error.
template <class Algo, class Comm>
void agree(Comm& comm, const std::exception_ptr& mine, const std::string& what) {
  const std::vector<std::int32_t> failed = gather_failures<Algo>(comm, mine != nullptr);
  const auto it = std::find(failed.begin(), failed.end(), 1);
  if (it == failed.end()) return;
  const int root = static_cast<int>(it - failed.begin());
  const FailureReport own = mine ? report_of(mine) : FailureReport{};
  FailureReport r = comm.rank() == root ? own : FailureReport{};
  std::int64_t sizes[4] = {r.kind, r.os_error, static_cast<std::int64_t>(r.text.size()),
                           static_cast<std::int64_t>(r.path.size())};
  const Broadcast<Algo> broadcast;
  broadcast(comm, std::span<std::int64_t>(sizes), root);
  std::vector<std::int32_t> chars(r.text.begin(), r.text.end());
  chars.insert(chars.end(), r.path.begin(), r.path.end());
  chars.resize(static_cast<std::size_t>(sizes[2] + sizes[3]));
  broadcast(comm, std::span<std::int32_t>(chars), root);
  const std::string head = "gradsync: " + what + " failed on rank ";
  // The inner message's own "gradsync: " would only repeat the head's.
  auto reason = [](const std::string& text) {
    return text.starts_with("gradsync: ") ? text.substr(10) : text;
  };
  if (mine) throw_report(own, head + std::to_string(comm.rank()) + ": " + reason(own.text));
  r.kind = static_cast<FailureReport::Kind>(sizes[0]);
  r.os_error = sizes[1];
  r.text.assign(chars.begin(), chars.begin() + static_cast<std::ptrdiff_t>(sizes[2]));
  r.path.assign(chars.begin() + static_cast<std::ptrdiff_t>(sizes[2]), chars.end());
  throw_report(r, head + std::to_string(root) + " (rank " + std::to_string(comm.rank()) + " stops with it): " +
                      reason(r.text));
}

/// A full checkpoint file as rank 0 writes it, tensor by tensor: a failure
/// is kept rather than thrown (and stops the writing), so that finish()'s
/// agreement tells every rank and none is left waiting in a collective.
/// To a `.safetensors` path the file's own atomic rename is the commit; to
/// a directory it is generation-named and committed by the commit file
/// (checkpoint_directory.hpp).
template <class T>
class FullFileWriter {
 public:
  template <class Comm>
  FullFileWriter(Comm& comm, const std::filesystem::path& path, const SaveList<T>& l,
                 const checkpoint::Metadata& metadata)
      : path_(path), in_directory_(path.extension() != ".safetensors"), l_(l) {
    if (comm.rank() != 0) return;
    try {
      std::filesystem::path file = path;
      if (in_directory_) {
        generation_ = prepare_generation(path);
        file = path / full_file_name_of(generation_);
      } else if (path.has_parent_path()) {
        checkpoint::detail::make_directories(path.parent_path());
      }
      writer_.emplace(file, l.infos, state_metadata(metadata, l.opt.kind, comm.size()));
    } catch (...) {
      error_ = std::current_exception();
    }
  }

  /// True on rank 0 until a write fails.
  bool writing() const noexcept { return writer_.has_value(); }

  void write(std::string_view name, std::span<const T> data) {
    if (!writer_) return;
    try {
      writer_->write(name, data);
    } catch (...) {
      error_ = std::current_exception();
      writer_.reset();
    }
  }

  /// Keeps a failure of rank 0's own work between writes (an allocation, say)
  /// for finish()'s agreement, so the other ranks hear of it there.
  void fail(std::exception_ptr e) noexcept {
    if (!error_) error_ = e;
    writer_.reset();
  }

  /// Writes the scalars and makes the file durable; once every rank agrees
  /// it is, rank 0 commits it (to a directory: the commit file, then the
  /// other generations' files go) and the ranks agree again. Every rank
  /// throws if rank 0 failed. Collective.
  template <class Algo, class Comm>
  void finish(Comm& comm) {
    if (writer_) {
      try {
        for (const StateScalar& s : l_.scalars) writer_->write(s.name, s.data());
        writer_->commit();
      } catch (...) {
        error_ = std::current_exception();
      }
    }
    const std::string where = "save_checkpoint of '" + path_.string() + "'";
    agree<Algo>(comm, error_, where);
    if (!in_directory_) return;
    std::exception_ptr error;
    if (comm.rank() == 0) {
      try {
        commit_generation(path_, generation_, writer_->path().filename().string());
        remove_leftovers(path_, generation_);
      } catch (...) {
        error = std::current_exception();
      }
    }
    agree<Algo>(comm, error, where);
  }

 private:
  std::filesystem::path path_;
  bool in_directory_ = false;
  std::uint64_t generation_ = 0;
  const SaveList<T>& l_;
  std::optional<checkpoint::SafetensorsWriter> writer_;
  std::exception_ptr error_;
};

/// Rank 0 creates `dir` and picks the generation a save writes there, and
/// every rank learns it: 0 when rank 0 failed, whose error is then in
/// `error` for the agreement that follows. Collective.
template <class Algo, class Comm>
std::uint64_t agree_generation(Comm& comm, const std::filesystem::path& dir, std::exception_ptr& error) {
  std::int64_t generation = 0;
  if (comm.rank() == 0) {
    try {
      generation = static_cast<std::int64_t>(prepare_generation(dir));
    } catch (...) {
      error = std::current_exception();
    }
  }
  Broadcast<Algo>{}(comm, std::span<std::int64_t>(&generation, 1), 0);
  return static_cast<std::uint64_t>(generation);
}

/// The end of a sharded save of generation `g`, once each rank has written
/// its shard file (or recorded in `error` why not): the first agreement says
/// every file is durable; then rank 0 builds the index from the files'
/// headers, writes it, commits the generation and removes the other
/// generations' files; the second agreement tells every rank the outcome.
template <class Algo, class Comm>
void commit_when_durable(Comm& comm, std::exception_ptr& error, const std::string& where,
                         const std::filesystem::path& dir, std::uint64_t g, int shards,
                         const std::vector<checkpoint::TensorInfo>& infos) {
  agree<Algo>(comm, error, where);
  if (comm.rank() == 0) {
    try {
      commit_sharded(dir, g, shards, infos);
    } catch (...) {
      error = std::current_exception();
    }
  }
  agree<Algo>(comm, error, where);
}

/// A sharded save: rank 0 creates the directory and picks the generation;
/// each writing rank streams its ranges into its shard file (shard 0 adds
/// the buffers, the scalars and the metadata); then commit_when_durable.
template <class Algo, class Comm, class T>
void save_sharded(Comm& comm, const SaveList<T>& l, const ShardSource<T>& me, const std::filesystem::path& dir,
                  const checkpoint::Metadata& metadata) {
  const std::string where = "save_checkpoint of '" + dir.string() + "'";
  std::exception_ptr error;
  const std::uint64_t g = agree_generation<Algo>(comm, dir, error);
  if (me.writes && g != 0) {
    try {
      const bool first = me.shard == 0;
      const ShardPieces<T> p = me.pieces(l.tensors, l.scalars, l.opt);
      checkpoint::ShardWriter writer(dir, shard_stem, generation_id(g), me.shard, me.shards, l.infos, p.ranges,
                                     first ? state_metadata(metadata, l.opt.kind, comm.size()) : checkpoint::Metadata{});
      for (std::size_t i = 0; i < p.ranges.size(); ++i) writer.write(p.ranges[i], p.data[i]);
      writer.commit();
    } catch (...) {
      error = std::current_exception();
    }
  }
  commit_when_durable<Algo>(comm, error, where, dir, g, me.shards, l.infos);
}

/// What a rank reads and checks before it changes anything.
template <class T>
struct StagedState {
  std::vector<T> params, buffers;
  OptimizerState<T> optimizer;
  std::vector<StateScalar> scalars;
  checkpoint::Metadata user;
};

/// Reads and checks, into staging, the part of the checkpoint `src` that a
/// rank holds: `held` ranges of the flat parameters and of each optimizer
/// buffer into arrays of `local` elements (zeros elsewhere), all
/// `buffer_elements` of the buffers, and every scalar. Then asks the
/// optimizer and the sampler to check their parts.
template <class T, class Opt>
StagedState<T> stage_state(const CheckpointSource& src, Opt& optimizer, const std::vector<UnitSpec>& units,
                           std::span<const HeldRange> held, std::size_t local, std::size_t buffer_elements,
                           const DistributedSampler* sampler) {
  auto refuse = [&](const std::string& what) {
    throw InvalidArgument("gradsync: load_checkpoint: '" + src.file().string() +
                          "' does not match this training state: " + what);
  };
  const auto& meta = src.metadata();
  const auto kind = meta.find(std::string(checkpoint_kind_key));
  if (kind == meta.end() || kind->second != checkpoint_kind) {
    refuse("it is not a gradsync training checkpoint ('" + std::string(checkpoint_kind_key) + "' is " +
           (kind == meta.end() ? "missing" : "'" + kind->second + "'") + ", expected '" +
           std::string(checkpoint_kind) + "')");
  }
  const OptimizerStateView<T> opt = optimizer.state();
  const auto saved_kind = meta.find(std::string(optimizer_kind_key));
  if (saved_kind == meta.end() || saved_kind->second != opt.kind) {
    refuse("it holds the state of optimizer " + (saved_kind == meta.end() ? "(none)" : saved_kind->second) +
           ", this trainer's is " + std::string(opt.kind));
  }
  std::vector<std::string_view> buffer_names;
  for (const auto& b : opt.buffers) buffer_names.push_back(b.first);
  const std::vector<StateTensor> tensors = state_tensors<T>(units, buffer_names);
  const SamplerState current = sampler ? sampler->state() : SamplerState{};
  StagedState<T> staged;
  staged.scalars = state_scalars<T>(0, opt, sampler ? &current : nullptr);

  // Names, dtypes and shapes first, all of them, before any data is read.
  auto expect = [&](const checkpoint::TensorInfo& want) {
    const checkpoint::TensorInfo* got = src.find(want.name);
    if (!got) refuse("it has no tensor '" + want.name + "'");
    if (got->dtype != want.dtype || got->shape != want.shape) {
      refuse("tensor '" + want.name + "' is " + std::string(checkpoint::dtype_name(got->dtype)) + " " +
             checkpoint::shape_string(got->shape) + ", this training state's is " +
             std::string(checkpoint::dtype_name(want.dtype)) + " " + checkpoint::shape_string(want.shape));
    }
  };
  for (const StateTensor& t : tensors) expect(t.info);
  for (const StateScalar& s : staged.scalars) expect(s.info());
  for (const std::string& n : src.names()) {
    // A checkpoint with a sampler's state loads without a sampler (evaluation, say).
    if (!sampler && n.starts_with("sampler.")) continue;
    const bool known = std::any_of(tensors.begin(), tensors.end(), [&](const StateTensor& t) { return t.info.name == n; }) ||
                       std::any_of(staged.scalars.begin(), staged.scalars.end(), [&](const StateScalar& s) { return s.name == n; });
    if (!known) refuse("it holds tensor '" + n + "', which this training state does not have");
  }

  // Then the data this rank holds, every checksum verified as it is read.
  staged.params.assign(local, T(0));
  staged.buffers.assign(buffer_elements, T(0));
  staged.optimizer.buffers.assign(opt.buffers.size(), std::vector<T>(local, T(0)));
  std::vector<checkpoint::RangeSlot> slots;
  for (const StateTensor& t : tensors) {
    if (t.source == StateSource::buffer) {
      slots.push_back({t.info, 0, t.count, std::as_writable_bytes(std::span<T>(staged.buffers).subspan(t.offset, t.count))});
      continue;
    }
    std::vector<T>& to = t.source == StateSource::parameter ? staged.params : staged.optimizer.buffers[t.buffer];
    for (const HeldRange& h : held) {
      const std::size_t lo = std::max(t.offset, h.begin), hi = std::min(t.offset + t.count, h.end);
      if (lo >= hi) continue;
      slots.push_back({t.info, lo - t.offset, hi - t.offset,
                       std::as_writable_bytes(std::span<T>(to).subspan(h.at + (lo - h.begin), hi - lo))});
    }
  }
  for (StateScalar& s : staged.scalars) slots.push_back({s.info(), 0, 1, s.data()});
  src.load(slots);

  staged.optimizer.steps = staged.scalars[ScalarIndex::optimizer_step].as_counter();
  for (std::size_t h = 0; h < opt.hyperparameters.size(); ++h) {
    staged.optimizer.hyperparameters.push_back(staged.scalars[ScalarIndex::first_hyperparameter + h].as_real());
  }
  optimizer.check_state(staged.optimizer);
  if (sampler) sampler->check_state(sampler_state_of(staged.scalars, ScalarIndex::first_hyperparameter + opt.hyperparameters.size()));
  for (const auto& [k, v] : meta) {
    if (!k.starts_with("gradsync.")) staged.user.emplace(k, v);
  }
  return staged;
}

/// After every rank staged its part: did all read the same checkpoint, by
/// its scalars (the step, the optimizer's steps and hyper-parameters) and
/// `fingerprint` (CheckpointSource::fingerprint: its tensors' checksums)?
/// Ranks handed different checkpoints (a stale copy on one node, or another
/// run's save at the same step) would otherwise each load their own and
/// train apart, unseen wherever their next step's labels do not differ.
/// Collective; throws InvalidArgument on every rank, before any rank
/// changes anything.
template <class Algo, class Comm>
void check_same_checkpoint(Comm& comm, const std::vector<StateScalar>& scalars, std::uint64_t fingerprint,
                           const std::string& where) {
  std::uint64_t h = fingerprint;
  // The sampler's are read only where a sampler is passed, which a rank
  // that evaluates may not: those are compared by each sampler's own check.
  for (const StateScalar& s : scalars) {
    if (!s.name.starts_with("sampler.")) h = hash_bytes(s.bytes.data(), s.bytes.size(), h);
  }
  const std::array<std::int64_t, 2> mine{static_cast<std::int64_t>(h),
                                         static_cast<std::int64_t>(scalars[ScalarIndex::trainer_step].as_counter())};
  std::vector<std::int64_t> all(2 * static_cast<std::size_t>(comm.size()));
  AllGather<Algo>{}(comm, std::span<const std::int64_t>(mine), std::span<std::int64_t>(all));
  std::string ranks;
  for (std::size_t r = 0; r < all.size() / 2; ++r) {
    if (all[2 * r] == all[0]) continue;
    ranks += (ranks.empty() ? "" : ", ") + std::to_string(r) + " (step " + std::to_string(all[2 * r + 1]) + ")";
  }
  if (ranks.empty()) return;
  throw InvalidArgument("gradsync: " + where + ": the ranks read different training states: rank 0 a state at step " +
                        std::to_string(all[1]) + ", and another on rank(s) " + ranks +
                        " (another checkpoint, or its files from two saves); nothing was loaded");
}

/// Stages on every rank, agrees, and if every rank passed calls
/// `commit(staged)` (which must not throw) and restores the counters,
/// the sampler and the optimizer; returns the user's metadata.
template <class Trainer, class Commit>
checkpoint::Metadata load_state(Trainer& trainer, DistributedSampler* sampler, const std::filesystem::path& path,
                                std::span<const HeldRange> held, std::size_t local, Commit commit) {
  using T = typename Trainer::value_type;
  check_checkpointable(trainer, "load_checkpoint");
  auto& comm = trainer.communicator();
  std::string file = path.string();
  StagedState<T> staged;
  std::uint64_t fingerprint = 0;
  std::exception_ptr error;
  try {
    const CheckpointSource src(path);
    file = src.file().string();
    fingerprint = src.fingerprint();
    staged = stage_state<T>(src, trainer.optimizer(), trainer.units(), held, local, trainer.buffers().size(), sampler);
  } catch (...) {
    error = std::current_exception();
  }
  agree<typename Trainer::algorithm>(comm, error, "load_checkpoint of '" + file + "'");
  check_same_checkpoint<typename Trainer::algorithm>(comm, staged.scalars, fingerprint,
                                                     "load_checkpoint of '" + file + "'");
  // Every rank checked everything: from here on nothing throws.
  commit(staged);
  std::copy(staged.buffers.begin(), staged.buffers.end(), trainer.buffers().begin());
  if (sampler) {
    sampler->load_state(
        sampler_state_of(staged.scalars, ScalarIndex::first_hyperparameter + staged.optimizer.hyperparameters.size()));
  }
  trainer.set_step_count(static_cast<std::size_t>(staged.scalars[ScalarIndex::trainer_step].as_counter()));
  trainer.optimizer().load_state(std::move(staged.optimizer));
  return std::move(staged.user);
}

/// How save_checkpoint and load_checkpoint reach one kind of trainer:
/// specialised beside each trainer's checkpoint code (ShardedTrainer's in
/// sharded_checkpoint.hpp), with `held` (what this rank holds and writes of
/// a sharded checkpoint), `params` (where a load puts the parameters held)
/// and `write_full` (the tensors of a full file, in order, into a sink with
/// FullFileWriter's writing/write/fail: the file, or an AsyncCheckpointer's
/// snapshot).
template <class Trainer>
struct TrainerCheckpoint {};

template <class M, class Opt, class Comm, class Algo>
struct TrainerCheckpoint<ReplicatedTrainer<M, Opt, Comm, Algo>> {
  using Trainer = ReplicatedTrainer<M, Opt, Comm, Algo>;
  using T = typename Trainer::value_type;

  /// Every replica holds everything: one shard, which rank 0 writes.
  static ShardSource<T> held(Trainer& trainer) {
    return {0, 1, trainer.communicator().rank() == 0, {{0, trainer.parameters().size(), 0}}, trainer.parameters(),
            trainer.buffers()};
  }
  static std::span<T> params(Trainer& trainer) { return trainer.parameters(); }
  template <class Out>
  static void write_full(Trainer& trainer, const SaveList<T>& l, Out& out) {
    if (!out.writing()) return;
    // Only rank 0 is here, between collectives: whatever it throws must wait
    // for finish()'s agreement, or the other ranks would learn of it only by
    // their deadline.
    try {
      const std::span<const T> params = trainer.parameters(), buffers = trainer.buffers();
      // An optimizer that has not stepped has no buffers yet: its state is zeros.
      const std::vector<T> zeros(l.opt.buffers.empty() || !l.opt.buffers.front().second.empty() ? 0 : params.size());
      for (const StateTensor& t : l.tensors) {
        std::span<const T> from = t.source == StateSource::parameter ? params
                                  : t.source == StateSource::buffer  ? buffers
                                  : l.opt.buffers[t.buffer].second.empty()
                                      ? std::span<const T>(zeros)
                                      : l.opt.buffers[t.buffer].second;
        out.write(t.info.name, from.subspan(t.offset, t.count));
      }
    } catch (...) {
      out.fail(std::current_exception());
    }
  }
};

template <class Trainer>
concept CheckpointableTrainer = requires(Trainer& trainer) { TrainerCheckpoint<Trainer>::held(trainer); };

template <class Trainer>
void save_trainer(Trainer& trainer, const DistributedSampler* sampler, const std::filesystem::path& path,
                  const checkpoint::Metadata& metadata, CheckpointOptions options) {
  using T = typename Trainer::value_type;
  using Algo = typename Trainer::algorithm;
  const TraceScope span(trace_recorder(trainer.communicator()), TraceKind::checkpoint_save, trainer.step_count());
  const bool sharded = options.format == CheckpointFormat::sharded;
  if (sharded) check_sharded_path(path);
  check_full_path(path, sharded);
  if (const auto pending = PendingSaves::to(&trainer, path)) {
    throw InvalidArgument("gradsync: save_checkpoint of '" + path.string() + "' on rank " +
                          std::to_string(trainer.communicator().rank()) +
                          ": this trainer's AsyncCheckpointer has a save to it that is not committed yet; call its "
                          "wait() first (two saves to one path at once would each remove or replace the other's files)");
  }
  const SaveList<T> l = save_list(trainer, sampler, metadata);
  agree_to_save(trainer, sampler, "save_checkpoint of '" + path.string() + "'");
  if (sharded) {
    save_sharded<Algo>(trainer.communicator(), l, TrainerCheckpoint<Trainer>::held(trainer), path, metadata);
    return;
  }
  FullFileWriter<T> out(trainer.communicator(), path, l, metadata);
  TrainerCheckpoint<Trainer>::write_full(trainer, l, out);
  out.template finish<Algo>(trainer.communicator());
}

/// Each rank reads only the ranges it holds (from a full file: each tensor
/// it holds a part of, whole, for its checksum), then the agreement, then
/// the commit, which cannot throw.
template <class Trainer>
checkpoint::Metadata load_trainer(Trainer& trainer, DistributedSampler* sampler, const std::filesystem::path& path) {
  using T = typename Trainer::value_type;
  const TraceScope span(trace_recorder(trainer.communicator()), TraceKind::checkpoint_load, trainer.step_count());
  const ShardSource<T> me = TrainerCheckpoint<Trainer>::held(trainer);
  return load_state(trainer, sampler, path, me.held, me.params.size(), [&](StagedState<T>& s) {
    std::copy(s.params.begin(), s.params.end(), TrainerCheckpoint<Trainer>::params(trainer).begin());
  });
}

}  // namespace detail

/// Saves the whole training state of a ReplicatedTrainer or a ShardedTrainer
/// (parameters, buffers, optimizer state and hyper-parameters, step count),
/// the sampler's seed, epoch and position, and the user's `metadata` (keys
/// not starting with `gradsync.`), at the model's full, unpadded shapes and
/// under the same names for both trainers. Collective: every rank calls it;
/// when it returns on any rank the checkpoint is committed. If any rank
/// fails, every rank throws a gradsync::Error naming the failing rank and
/// its reason (a FileError, with the path and the system's errno, when the
/// file system refused) and the checkpoint the path held before still loads.
///
/// `path` a directory (created if missing): the save writes a new
/// generation of files there and commits it by renaming one small file,
/// `path/checkpoint.commit`, which names it; a process killed at any moment
/// leaves the previous checkpoint or the new one. The other generations'
/// files go after the commit. gradsync owns the names `checkpoint*` there.
/// (checkpoint_directory.hpp has the layout.)
///
/// CheckpointFormat::full (the default): one safetensors file, written by
/// rank 0: `path/checkpoint-<generation>.safetensors`, or `path` itself if
/// it ends in `.safetensors` (its atomic rename is then the commit). A
/// ShardedTrainer's shard group gathers one unit at a time for it.
///
/// CheckpointFormat::sharded: `path` is a directory and the checkpoint its
/// `checkpoint-<generation>.index.json` and shard files. Each rank of
/// replica 0 writes what it owns (a ReplicatedTrainer's rank 0 the one
/// shard, since every rank holds everything); once all are durable rank 0
/// writes the index and commits.
template <class Trainer>
  requires detail::CheckpointableTrainer<Trainer>
void save_checkpoint(Trainer& trainer, const DistributedSampler& sampler, const std::filesystem::path& path,
                     const checkpoint::Metadata& metadata = {}, CheckpointOptions options = {}) {
  detail::save_trainer(trainer, &sampler, path, metadata, options);
}

/// save_checkpoint without a sampler.
template <class Trainer>
  requires detail::CheckpointableTrainer<Trainer>
void save_checkpoint(Trainer& trainer, const std::filesystem::path& path, const checkpoint::Metadata& metadata = {},
                     CheckpointOptions options = {}) {
  detail::save_trainer(trainer, nullptr, path, metadata, options);
}

/// Loads what save_checkpoint saved, by either trainer at any world size,
/// into `trainer` and `sampler` and returns the user's metadata.
/// Collective: every rank reads the checkpoint and checks every name,
/// dtype, shape and checksum, the optimizer's kind and the sampler's
/// dataset, before any rank changes anything; if any rank's check fails,
/// every rank throws (the failing one its own error, naming the file and
/// the tensor) and nothing is loaded anywhere. The world size may differ
/// from the one that saved, if it divides the samples of the epoch already
/// taken (DistributedSampler::check_state). `path` names a full file, a
/// sharded checkpoint's index, or a directory: the generation its commit
/// file names (other files there are ignored), or in a directory saved
/// before commit files, the one checkpoint it holds. Each rank of
/// a ReplicatedTrainer reads all of it (from whichever files hold it), each
/// rank of a ShardedTrainer only the element ranges it owns.
template <class Trainer>
  requires detail::CheckpointableTrainer<Trainer>
checkpoint::Metadata load_checkpoint(Trainer& trainer, DistributedSampler& sampler, const std::filesystem::path& path) {
  return detail::load_trainer(trainer, &sampler, path);
}

/// load_checkpoint without a sampler: a sampler's state in the file is ignored.
template <class Trainer>
  requires detail::CheckpointableTrainer<Trainer>
checkpoint::Metadata load_checkpoint(Trainer& trainer, const std::filesystem::path& path) {
  return detail::load_trainer(trainer, nullptr, path);
}

}  // namespace gradsync
