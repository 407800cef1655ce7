#pragma once
/// \file save_checkpoint / load_checkpoint of a ReplicatedTrainer: the whole
/// training state in one safetensors file, written atomically by rank 0,
/// loaded all or nothing by every rank.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gradsync/checkpoint/safetensors_reader.hpp"
#include "gradsync/checkpoint/safetensors_writer.hpp"
#include "gradsync/checkpoint/tensor_info.hpp"
#include "gradsync/collective/all_gather.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/train/distributed_sampler.hpp"
#include "gradsync/train/optimizer.hpp"
#include "gradsync/train/replicated_trainer.hpp"
#include "gradsync/train/state_layout.hpp"

namespace gradsync {

/// The file a checkpoint path names: itself if it ends in `.safetensors`,
/// otherwise `checkpoint.safetensors` inside that directory.
inline std::filesystem::path checkpoint_file(const std::filesystem::path& path) {
  return path.extension() == ".safetensors" ? path : path / "checkpoint.safetensors";
}

namespace detail {

/// `__metadata__` keys gradsync writes besides the file layer's own.
inline constexpr std::string_view checkpoint_kind_key = "gradsync.checkpoint";
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

/// Rethrows this rank's own error, else throws one naming the first rank
/// that failed; returns if none did.
inline void settle_failures(const std::vector<std::int32_t>& failed, int rank, const std::exception_ptr& mine,
                            const std::string& what) {
  if (mine) std::rethrow_exception(mine);
  const auto it = std::find(failed.begin(), failed.end(), 1);
  if (it == failed.end()) return;
  throw Error("gradsync: " + what + " failed on rank " + std::to_string(it - failed.begin()) +
              " (its own error says why); rank " + std::to_string(rank) + " stops with it");
}

template <class Trainer>
void save_replicated(Trainer& trainer, const DistributedSampler* sampler, const std::filesystem::path& path,
                     const checkpoint::Metadata& metadata) {
  using T = typename Trainer::value_type;
  check_checkpointable(trainer, "save_checkpoint");
  auto& comm = trainer.communicator();
  for (const auto& [k, v] : metadata) {
    if (k.starts_with("gradsync.")) {
      throw InvalidArgument("gradsync: save_checkpoint: metadata key '" + k +
                            "' is reserved (keys starting with 'gradsync.' are gradsync's own)");
    }
  }
  const OptimizerStateView<T> opt = trainer.optimizer().state();
  std::vector<std::string_view> buffer_names;
  for (const auto& b : opt.buffers) buffer_names.push_back(b.first);
  const std::vector<StateTensor> tensors = state_tensors<T>(trainer.units(), buffer_names);
  const SamplerState sampler_state = sampler ? sampler->state() : SamplerState{};
  const std::vector<StateScalar> scalars =
      state_scalars<T>(trainer.step_count(), opt, sampler ? &sampler_state : nullptr);
  std::vector<checkpoint::TensorInfo> infos;
  for (const StateTensor& t : tensors) infos.push_back(t.info);
  for (const StateScalar& s : scalars) infos.push_back(s.info());
  for (std::size_t i = 0; i < infos.size(); ++i) {
    for (std::size_t j = 0; j < i; ++j) {
      if (infos[i].name == infos[j].name) {
        throw InvalidArgument("gradsync: save_checkpoint: two tensors of the training state are both called '" +
                              infos[i].name + "'; rename a unit or tensor of the model");
      }
    }
  }
  const std::filesystem::path file = checkpoint_file(path);
  std::exception_ptr error;
  if (comm.rank() == 0) {
    try {
      if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path());
      checkpoint::Metadata meta = metadata;
      meta[std::string(checkpoint_kind_key)] = std::string(checkpoint_kind);
      meta[std::string(optimizer_kind_key)] = std::string(opt.kind);
      meta[std::string(world_size_key)] = std::to_string(comm.size());
      checkpoint::SafetensorsWriter writer(file, infos, std::move(meta));
      const std::span<const T> params = trainer.parameters(), buffers = trainer.buffers();
      // An optimizer that has not stepped has no buffers yet: its state is zeros.
      const std::vector<T> zeros(opt.buffers.empty() || !opt.buffers.front().second.empty() ? 0 : params.size());
      for (const StateTensor& t : tensors) {
        std::span<const T> from = t.source == StateSource::parameter ? params
                                  : t.source == StateSource::buffer  ? buffers
                                  : opt.buffers[t.buffer].second.empty()
                                      ? std::span<const T>(zeros)
                                      : opt.buffers[t.buffer].second;
        writer.write(t.info.name, from.subspan(t.offset, t.count));
      }
      for (const StateScalar& s : scalars) writer.write(s.name, s.data());
      writer.commit();
    } catch (...) {
      error = std::current_exception();
    }
  }
  settle_failures(gather_failures<typename Trainer::algorithm>(comm, error != nullptr), comm.rank(), error,
                  "save_checkpoint of '" + file.string() + "'");
}

/// What a rank reads and checks before it changes anything.
template <class T>
struct StagedState {
  std::vector<T> params, buffers;
  OptimizerState<T> optimizer;
  std::vector<StateScalar> scalars;
  checkpoint::Metadata user;
};

template <class Trainer>
StagedState<typename Trainer::value_type> stage_replicated(Trainer& trainer, const DistributedSampler* sampler,
                                                          const std::filesystem::path& file) {
  using T = typename Trainer::value_type;
  checkpoint::SafetensorsReader reader(file);
  auto refuse = [&](const std::string& what) {
    throw InvalidArgument("gradsync: load_checkpoint: '" + file.string() + "' does not match this training state: " +
                          what);
  };
  const auto& meta = reader.metadata();
  const auto kind = meta.find(std::string(checkpoint_kind_key));
  if (kind == meta.end() || kind->second != checkpoint_kind) {
    refuse("it is not a gradsync training checkpoint ('" + std::string(checkpoint_kind_key) + "' is " +
           (kind == meta.end() ? "missing" : "'" + kind->second + "'") + ", expected '" +
           std::string(checkpoint_kind) + "')");
  }
  const OptimizerStateView<T> opt = trainer.optimizer().state();
  const auto saved_kind = meta.find(std::string(optimizer_kind_key));
  if (saved_kind == meta.end() || saved_kind->second != opt.kind) {
    refuse("it holds the state of optimizer " + (saved_kind == meta.end() ? "(none)" : saved_kind->second) +
           ", this trainer's is " + std::string(opt.kind));
  }
  std::vector<std::string_view> buffer_names;
  for (const auto& b : opt.buffers) buffer_names.push_back(b.first);
  const std::vector<StateTensor> tensors = state_tensors<T>(trainer.units(), buffer_names);
  const SamplerState current = sampler ? sampler->state() : SamplerState{};
  StagedState<T> staged;
  staged.scalars = state_scalars<T>(0, opt, sampler ? &current : nullptr);

  // Names, dtypes and shapes first, all of them, before any data is read.
  auto expect = [&](const checkpoint::TensorInfo& want) -> const checkpoint::TensorEntry& {
    const checkpoint::TensorEntry* got = reader.find(want.name);
    if (!got) refuse("it has no tensor '" + want.name + "'");
    if (got->spec.dtype != want.dtype || got->spec.shape != want.shape) {
      refuse("tensor '" + want.name + "' is " + std::string(checkpoint::dtype_name(got->spec.dtype)) + " " +
             checkpoint::shape_string(got->spec.shape) + ", this training state's is " +
             std::string(checkpoint::dtype_name(want.dtype)) + " " + checkpoint::shape_string(want.shape));
    }
    return *got;
  };
  for (const StateTensor& t : tensors) expect(t.info);
  for (const StateScalar& s : staged.scalars) expect(s.info());
  for (const checkpoint::TensorEntry& e : reader.tensors()) {
    const std::string& n = e.spec.name;
    // A checkpoint with a sampler's state loads without a sampler (evaluation, say).
    if (!sampler && n.starts_with("sampler.")) continue;
    const bool known = std::any_of(tensors.begin(), tensors.end(), [&](const StateTensor& t) { return t.info.name == n; }) ||
                       std::any_of(staged.scalars.begin(), staged.scalars.end(), [&](const StateScalar& s) { return s.name == n; });
    if (!known) refuse("it holds tensor '" + n + "', which this training state does not have");
  }

  // Then the data, every checksum verified as it is read.
  staged.params.resize(trainer.parameters().size());
  staged.buffers.resize(trainer.buffers().size());
  staged.optimizer.buffers.assign(opt.buffers.size(), std::vector<T>(trainer.parameters().size()));
  for (const StateTensor& t : tensors) {
    std::vector<T>& to = t.source == StateSource::parameter ? staged.params
                         : t.source == StateSource::buffer  ? staged.buffers
                                                            : staged.optimizer.buffers[t.buffer];
    reader.read(t.info.name, std::as_writable_bytes(std::span<T>(to).subspan(t.offset, t.count)));
  }
  for (StateScalar& s : staged.scalars) reader.read(s.name, s.data());

  staged.optimizer.steps = staged.scalars[ScalarIndex::optimizer_step].as_counter();
  for (std::size_t h = 0; h < opt.hyperparameters.size(); ++h) {
    staged.optimizer.hyperparameters.push_back(staged.scalars[ScalarIndex::first_hyperparameter + h].as_real());
  }
  trainer.optimizer().check_state(staged.optimizer);
  if (sampler) sampler->check_state(sampler_state_of(staged.scalars, ScalarIndex::first_hyperparameter + opt.hyperparameters.size()));
  for (const auto& [k, v] : meta) {
    if (!k.starts_with("gradsync.")) staged.user.emplace(k, v);
  }
  return staged;
}

template <class Trainer>
checkpoint::Metadata load_replicated(Trainer& trainer, DistributedSampler* sampler, const std::filesystem::path& path) {
  using T = typename Trainer::value_type;
  check_checkpointable(trainer, "load_checkpoint");
  auto& comm = trainer.communicator();
  const std::filesystem::path file = checkpoint_file(path);
  StagedState<T> staged;
  std::exception_ptr error;
  try {
    staged = stage_replicated(trainer, sampler, file);
  } catch (...) {
    error = std::current_exception();
  }
  settle_failures(gather_failures<typename Trainer::algorithm>(comm, error != nullptr), comm.rank(), error,
                  "load_checkpoint of '" + file.string() + "'");
  // Every rank checked everything: from here on nothing throws.
  std::copy(staged.params.begin(), staged.params.end(), trainer.parameters().begin());
  std::copy(staged.buffers.begin(), staged.buffers.end(), trainer.buffers().begin());
  if (sampler) {
    sampler->load_state(
        sampler_state_of(staged.scalars, ScalarIndex::first_hyperparameter + staged.optimizer.hyperparameters.size()));
  }
  trainer.set_step_count(static_cast<std::size_t>(staged.scalars[ScalarIndex::trainer_step].as_counter()));
  trainer.optimizer().load_state(std::move(staged.optimizer));
  return std::move(staged.user);
}

}  // namespace detail

/// Saves the whole training state of `trainer` (parameters, buffers,
/// optimizer state and hyper-parameters, step count), the sampler's seed,
/// epoch and position, and the user's `metadata` (keys not starting with
/// `gradsync.`) to one safetensors file: `path` if it ends in
/// `.safetensors`, else `path/checkpoint.safetensors` (directories are
/// created). Collective: every rank calls it; rank 0 writes, atomically
/// (the previous file under that name stays whole until the new one is
/// durable), and when it returns on any rank the file is complete. If
/// rank 0 cannot write, every rank throws.
template <class M, class Opt, class Comm, class Algo>
void save_checkpoint(ReplicatedTrainer<M, Opt, Comm, Algo>& trainer, const DistributedSampler& sampler,
                     const std::filesystem::path& path, const checkpoint::Metadata& metadata = {}) {
  detail::save_replicated(trainer, &sampler, path, metadata);
}

/// save_checkpoint without a sampler.
template <class M, class Opt, class Comm, class Algo>
void save_checkpoint(ReplicatedTrainer<M, Opt, Comm, Algo>& trainer, const std::filesystem::path& path,
                     const checkpoint::Metadata& metadata = {}) {
  detail::save_replicated(trainer, nullptr, path, metadata);
}

/// Loads what save_checkpoint saved into `trainer` and `sampler` and returns
/// the user's metadata. Collective: every rank reads the file and checks
/// every name, dtype, shape and checksum, the optimizer's kind and the
/// sampler's dataset, before any rank changes anything; if any rank's
/// check fails, every rank throws (the failing one its own error, naming
/// the file and the tensor) and nothing is loaded anywhere. The world size
/// may differ from the one that saved, if it divides the samples of the
/// epoch already taken (DistributedSampler::check_state).
template <class M, class Opt, class Comm, class Algo>
checkpoint::Metadata load_checkpoint(ReplicatedTrainer<M, Opt, Comm, Algo>& trainer, DistributedSampler& sampler,
                                     const std::filesystem::path& path) {
  return detail::load_replicated(trainer, &sampler, path);
}

/// load_checkpoint without a sampler: a sampler's state in the file is ignored.
template <class M, class Opt, class Comm, class Algo>
checkpoint::Metadata load_checkpoint(ReplicatedTrainer<M, Opt, Comm, Algo>& trainer,
                                     const std::filesystem::path& path) {
  return detail::load_replicated(trainer, nullptr, path);
}

}  // namespace gradsync
