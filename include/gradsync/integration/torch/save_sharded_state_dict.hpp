#pragma once
/// \file save_sharded_state_dict: a fully_shard model's parameters, buffers and optimizer state, each rank writing the pieces it holds.

#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "gradsync/checkpoint/shard_writer.hpp"
#include "gradsync/checkpoint/tensor_info.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/integration/torch/sharded_optimizer_state.hpp"
#include "gradsync/integration/torch/sharded_state_entries.hpp"
#include "gradsync/integration/torch/torch_unit_registry.hpp"
#include "gradsync/train/checkpoint/checkpoint_directory.hpp"
#include "gradsync/train/checkpoint/replicated_checkpoint.hpp"

namespace gradsync {

namespace detail {

/// save_sharded_state_dict, with the optimizer's state where `optimizer` is not null.
template <class Holder, Backend B>
void save_sharded_state(Holder& module, torch::optim::Optimizer* optimizer, Communicator<B>& comm,
                        const std::filesystem::path& dir) {
  const std::shared_ptr<torch::nn::Module> root = module_root(module);
  const std::string where = "save_sharded_state_dict to '" + dir.string() + "'";
  std::exception_ptr error;
  std::string refusal;
  std::vector<ShardedStateEntry> entries;
  try {
    entries = sharded_state_entries(root, &comm, comm.rank(), refusal);
    if (optimizer) {
      for (auto& o : sharded_optimizer_entries(*optimizer, entries, /*loading=*/false, comm.rank(), refusal)) {
        entries.push_back(std::move(o.entry));
      }
    }
    // agree() puts `where` and the rank before the message.
    if (!refusal.empty()) throw InvalidArgument("gradsync: " + refusal);
  } catch (...) {
    error = std::current_exception();
  }
  agree<Auto>(comm, error, where);

  std::vector<checkpoint::TensorInfo> infos;
  for (const auto& e : entries) infos.push_back(e.info);
  // Rank 0 creates the directory and picks a generation no file there has.
  const std::uint64_t g = agree_generation<Auto>(comm, dir, error);
  if (g != 0) {
    try {
      std::vector<checkpoint::ShardRange> ranges;
      std::vector<at::Tensor> data;
      for (const auto& e : entries) {
        if (!e.writes || e.begin == e.end) continue;
        ranges.push_back({e.info.name, e.begin, e.end});
        data.push_back(e.local.detach().contiguous());
      }
      checkpoint::ShardWriter writer(dir, shard_stem, generation_id(g), comm.rank(), comm.size(),
                                     infos, ranges);
      for (std::size_t i = 0; i < ranges.size(); ++i) {
        writer.write(ranges[i], std::span<const std::byte>(static_cast<const std::byte*>(data[i].data_ptr()),
                                                           data[i].nbytes()));
      }
      writer.commit();
    } catch (...) {
      error = std::current_exception();
    }
  }
  commit_when_durable<Auto>(comm, error, where, dir, g, comm.size(), infos);
}

}  // namespace detail

/// Collective over `comm`, the communicator `module`'s units were wrapped
/// with: the parameters and buffers of `module`, by the names the
/// unwrapped module's named_parameters() and named_buffers() give them, as
/// a sharded checkpoint in directory `dir`, the trainers' format
/// (docs/DESIGN.md, "Checkpoints"): each rank writes the pieces of the
/// units' parameters it holds (one copy of each: under HybridShard the
/// first shard group's) into its own shard file, rank 0 also the
/// parameters no unit holds and the buffers; once every file is durable,
/// rank 0 writes the index and commits the generation with the directory's
/// commit file, so a save that fails or is killed leaves the previous
/// checkpoint loadable. Nothing is gathered: each rank writes 1/N of the
/// model. load_sharded_state_dict reads it back at any world size.
///
/// Call it between steps (not between a forward and its backward). Every
/// rank throws the same gradsync::Error (InvalidArgument for wrong use,
/// FileError for the system's refusal), naming the rank that failed and
/// why, if any rank fails; none is left waiting.
///
/// With `optimizer` (torch::optim::SGD, Adam or AdamW on the module's
/// parameters, after a step), its state too: each trainable parameter's
/// SGD momentum_buffer (with momentum; plain SGD has none), or Adam's
/// exp_avg and exp_avg_sq (max_exp_avg_sq under amsgrad) and step, pieces
/// of the parameter's shape as the parameter's, named
/// "optimizer.<parameter>.exp_avg" and so on.
///
/// \tparam Holder  a module holder (ShardedModule, a TORCH_MODULE type) or
///                 a `std::shared_ptr` to a torch::nn::Module subclass.
/// \tparam B       the backend of `comm` (Threads, Mpi).
template <class Holder, Backend B>
void save_sharded_state_dict(Holder& module, Communicator<B>& comm, const std::filesystem::path& dir) {
  detail::save_sharded_state(module, nullptr, comm, dir);
}

template <class Holder, Backend B>
void save_sharded_state_dict(Holder& module, torch::optim::Optimizer& optimizer, Communicator<B>& comm,
                             const std::filesystem::path& dir) {
  detail::save_sharded_state(module, &optimizer, comm, dir);
}

}  // namespace gradsync
