#pragma once
/// \file AsyncCheckpointer: save_checkpoint whose caller waits only while the
/// training state is copied; the files are written on a background thread
/// and committed at the next save or wait().

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gradsync/core/error.hpp"
#include "gradsync/core/trace_scope.hpp"
#include "gradsync/train/checkpoint/checkpoint_options.hpp"
#include "gradsync/train/checkpoint/checkpoint_snapshot.hpp"
#include "gradsync/train/checkpoint/pending_saves.hpp"
#include "gradsync/train/checkpoint/replicated_checkpoint.hpp"
#include "gradsync/train/checkpoint/save_agreement.hpp"
#include "gradsync/train/checkpoint/shard_source.hpp"
// Both trainers' TrainerCheckpoint, so that this one include serves either.
#include "gradsync/train/checkpoint/sharded_checkpoint.hpp"
#include "gradsync/train/common/memory_need.hpp"
#include "gradsync/train/data/distributed_sampler.hpp"

namespace gradsync {

/// Saves a ReplicatedTrainer's or a ShardedTrainer's checkpoint as
/// save_checkpoint does (the same files, names, layouts and atomicity), but
/// `save()` returns once this rank's part of the state is copied into a
/// host snapshot: a background thread writes, checksums and fsyncs the
/// files while training goes on. The background thread touches only the
/// snapshot and the file system, never a communicator, since a collective
/// of its own would race the trainer's on the same communicator. So the
/// agreement that every rank's files are durable, and rank 0's commit
/// (the rename of the commit file), happen on the caller's thread at
/// `wait()` or at the next `save()`, which waits for the previous save
/// first. Until then the directory's committed checkpoint is the previous
/// one.
///
/// A failure of the background write (a full disk, a directory made
/// unwritable) is kept and thrown on every rank by that `wait()` or next
/// `save()`, as save_checkpoint throws it (a FileError naming the rank, the
/// path and the system's reason), and the previous checkpoint still loads.
/// Destroying the checkpointer with a save not waited for joins the
/// background thread without committing (it cannot agree with the other
/// ranks from a destructor) and writes a line on stderr saying so, with the
/// write's failure if there was one: a directory keeps its previous
/// checkpoint (the next save removes the uncommitted files); a
/// `.safetensors` path has the new file if its write went well, since its
/// rename is its commit.
///
/// The snapshot holds what this rank writes: for CheckpointFormat::full,
/// rank 0 the whole state (a ShardedTrainer's ranks gather it one wrapped
/// unit at a time, as for save_checkpoint, inside `save()`), the others
/// nothing; for CheckpointFormat::sharded, each rank of replica 0 its own
/// ranges. Its buffer is kept for the next save (`snapshot_bytes()`), so
/// only the first save pays for faulting its pages in, or none after
/// reserve(), which maps them in the background. With
/// a memory_budget, `save()` refuses (InvalidArgument on every rank) when
/// the trainer's memory_need().total() and the snapshot exceed it.
///
/// Collective: every rank makes the same calls, between steps. One
/// checkpointer per trainer; neither copyable nor movable.
template <class Trainer>
  requires detail::CheckpointableTrainer<Trainer>
class AsyncCheckpointer {
 public:
  using value_type = typename Trainer::value_type;

  /// Saves `trainer` and, with the second form, `sampler`'s state with it.
  explicit AsyncCheckpointer(Trainer& trainer) : trainer_(trainer), rank_(trainer.communicator().rank()) {}
  AsyncCheckpointer(Trainer& trainer, const DistributedSampler& sampler) : AsyncCheckpointer(trainer) {
    sampler_ = &sampler;
  }
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  ~AsyncCheckpointer() {
    if (faulter_.joinable()) faulter_.join();
    if (!pending_) return;
    detail::PendingSaves::remove(&trainer_);
    if (thread_.joinable()) thread_.join();
    try {
      const std::string failure = error_ ? "; its write failed: " + detail::report_of(error_).text : "";
      // To a .safetensors path the file's own rename, in the background, was the commit.
      const std::string outcome =
          snapshot_.in_directory() ? "it is not committed, so '" + path_.string() + "' keeps the checkpoint it held before"
          : error_                 ? "'" + path_.string() + "' keeps the file it held before"
                                   : "its file is in place, but the ranks did not agree that every rank's part went well";
      std::fprintf(stderr,
                   "gradsync: rank %d: an AsyncCheckpointer was destroyed before wait() settled its save of '%s'%s; "
                   "%s; call wait() on every rank before the checkpointer goes\n",
                   rank_, path_.c_str(), failure.c_str(), outcome.c_str());
    } catch (...) {
      // Out of memory for the message: the save is left as it is all the same.
    }
  }

  /// Waits for the previous save (as wait() does, throwing its failure),
  /// then copies the state and starts writing it to `path` (a directory, or
  /// with CheckpointFormat::full a `.safetensors` file) with the user's
  /// `metadata`, as save_checkpoint(trainer, sampler, path, metadata,
  /// options) would. Returns before the files are written. Collective.
  void save(const std::filesystem::path& path, const checkpoint::Metadata& metadata = {},
            CheckpointOptions options = {}) {
    using T = value_type;
    using Algo = typename Trainer::algorithm;
    wait();
    if (faulter_.joinable()) faulter_.join();
    auto& comm = trainer_.communicator();
    const detail::TraceScope span(detail::trace_recorder(comm), detail::TraceKind::checkpoint_save, trainer_.step_count());
    const bool sharded = options.format == CheckpointFormat::sharded;
    if (sharded) detail::check_sharded_path(path);
    detail::check_full_path(path, sharded);
    const detail::SaveList<T> l = detail::save_list(trainer_, sampler_, metadata);
    const std::string where = "asynchronous save_checkpoint of '" + path.string() + "'";
    detail::agree_to_save(trainer_, sampler_, where);
    const Copy copy = copy_of(l, sharded);
    check_budget(std::max(copy.bytes, snapshot_.bytes()), where);

    snapshot_.plan(path, sharded, copy.writes, l.infos,
                   copy.first ? detail::state_metadata(metadata, l.opt.kind, comm.size()) : checkpoint::Metadata{},
                   copy.bytes, copy.me.shard, copy.me.shards);
    std::exception_ptr error;
    bool start = copy.writes;
    if (sharded) {
      if (copy.pieces) {
        const auto& pieces = *copy.pieces;
        for (std::size_t i = 0; i < pieces.ranges.size(); ++i) snapshot_.add(pieces.ranges[i], pieces.data[i]);
      }
      const std::uint64_t g = detail::agree_generation<Algo>(comm, path, error);
      snapshot_.set_generation(g);
      // 0: rank 0 could not prepare the directory; its error comes with wait()'s agreement.
      start = start && g != 0;
    } else {
      detail::TrainerCheckpoint<Trainer>::write_full(trainer_, l, snapshot_);
      for (const detail::StateScalar& s : l.scalars) snapshot_.write(s.name, s.data());
    }
    if (!error) error = snapshot_.error();
    path_ = path;
    error_ = error;
    written_.store(false, std::memory_order_relaxed);
    pending_ = true;
    detail::PendingSaves::add(&trainer_, path);
    if (!start || error_) {
      written_.store(true, std::memory_order_release);
      return;
    }
    thread_ = std::thread([this, trace = detail::trace_recorder(comm), step = trainer_.step_count()] {
      // Its own track on the timeline: the write overlaps the steps after save().
      detail::trace_thread_name() = "checkpoint writer";
      const detail::TraceScope span(trace, detail::TraceKind::checkpoint_write, step);
      try {
        snapshot_.write_files();
      } catch (...) {
        error_ = std::current_exception();
      }
      written_.store(true, std::memory_order_release);
    });
  }

  /// Allocates the snapshot that a save with `options` needs (as the first
  /// save() would) and, on a thread of its own, maps its pages, so that the
  /// first save() copies at the speed of the later ones instead of waiting
  /// for page faults. Returns without waiting for the mapping; a save()
  /// waits for what is left of it. Collective (the memory_budget check, as
  /// in save(), agrees on every rank), between steps; waits for a pending
  /// save first, as save() does.
  void reserve(CheckpointOptions options = {}) {
    wait();
    if (faulter_.joinable()) faulter_.join();
    const bool sharded = options.format == CheckpointFormat::sharded;
    const Copy copy = copy_of(detail::save_list(trainer_, sampler_, {}), sharded);
    check_budget(std::max(copy.bytes, snapshot_.bytes()), "AsyncCheckpointer::reserve");
    // A buffer that did not grow was mapped by an earlier save or reserve.
    const std::size_t had = snapshot_.bytes();
    snapshot_.reserve(copy.bytes);
    if (snapshot_.bytes() > had) faulter_ = std::thread([this] { snapshot_.fault_in(); });
  }

  /// Waits until every rank's files of the pending save are durable, then
  /// rank 0 commits it; returns once it is committed on every rank, or
  /// throws its failure (any rank's) on every rank, leaving the previous
  /// checkpoint loadable. Nothing pending: returns at once, on every rank
  /// alike. Collective, between steps.
  void wait() {
    using Algo = typename Trainer::algorithm;
    if (!pending_) return;
    detail::check_checkpointable(trainer_, "AsyncCheckpointer::wait");
    pending_ = false;
    detail::PendingSaves::remove(&trainer_);
    auto& comm = trainer_.communicator();
    const detail::TraceScope span(detail::trace_recorder(comm), detail::TraceKind::checkpoint_wait, trainer_.step_count());
    if (thread_.joinable()) thread_.join();
    const std::string where = "asynchronous save_checkpoint of '" + path_.string() + "'";
    detail::agree<Algo>(comm, std::exchange(error_, nullptr), where);
    if (!snapshot_.in_directory()) return;
    std::exception_ptr error;
    if (comm.rank() == 0) {
      try {
        snapshot_.commit();
      } catch (...) {
        error = std::current_exception();
      }
    }
    detail::agree<Algo>(comm, error, where);
  }

  /// A save was started and wait() (or the next save) has not settled it yet.
  bool pending() const noexcept { return pending_; }

  /// This rank's part of the pending save is written and durable (or its
  /// writing failed), or nothing is pending: a local question, no
  /// communication. The save is committed only by wait() or the next save.
  bool written() const noexcept { return !pending_ || written_.load(std::memory_order_acquire); }

  /// Bytes of this rank's snapshot buffer, held from the first save that
  /// needed them until the checkpointer goes (a full file: rank 0's is the
  /// whole state, the others' 0).
  std::size_t snapshot_bytes() const noexcept { return snapshot_.bytes(); }

 private:
  /// What this rank copies into the snapshot: its ranges of a sharded
  /// checkpoint, or (rank 0) every tensor of a full file.
  struct Copy {
    detail::ShardSource<value_type> me;
    std::optional<detail::ShardPieces<value_type>> pieces;
    /// This rank writes a file; `first`: the file that holds the metadata.
    bool writes = false, first = false;
    std::size_t bytes = 0;
  };

  Copy copy_of(const detail::SaveList<value_type>& l, bool sharded) const {
    Copy c;
    c.writes = c.first = trainer_.communicator().rank() == 0;
    if (sharded) {
      c.me = detail::TrainerCheckpoint<Trainer>::held(trainer_);
      c.writes = c.me.writes;
      c.first = c.writes && c.me.shard == 0;
      if (c.writes) {
        c.pieces.emplace(c.me.pieces(l.tensors, l.scalars, l.opt));
        for (const auto& d : c.pieces->data) c.bytes += d.size();
      }
    } else if (c.writes) {
      for (const checkpoint::TensorInfo& info : l.infos) c.bytes += info.bytes();
    }
    return c;
  }

  /// With a memory_budget, refuses on every rank alike a snapshot of
  /// `bytes` that the trainer's need leaves no room for.
  void check_budget(std::size_t bytes, const std::string& where) {
    const std::size_t budget = trainer_.options().memory_budget;
    if (budget == 0) return;
    std::exception_ptr error;
    const MemoryNeed need = trainer_.memory_need();
    if (need.total() + bytes > budget) {
      error = std::make_exception_ptr(InvalidArgument(
          "gradsync: the snapshot of " + MemoryNeed::mib(bytes) + " beside the trainer's need of " +
          MemoryNeed::mib(need.total()) + " is over the memory_budget of " + MemoryNeed::mib(budget) +
          "; save with save_checkpoint (no snapshot), raise memory_budget, or save CheckpointFormat::sharded "
          "(each rank copies only what it owns)"));
    }
    detail::agree<typename Trainer::algorithm>(trainer_.communicator(), error, where);
  }

  Trainer& trainer_;
  const DistributedSampler* sampler_ = nullptr;
  int rank_ = 0;
  detail::CheckpointSnapshot snapshot_;
  std::filesystem::path path_;
  bool pending_ = false;
  /// Set by the background thread before it ends; read after joining it.
  std::exception_ptr error_;
  std::atomic<bool> written_{true};
  std::thread thread_;
  /// Maps the snapshot's pages after reserve(); joined before the snapshot is used.
  std::thread faulter_;
};

}  // namespace gradsync
