#pragma once
/// \file load_sharded_state_dict: a sharded save of a fully_shard model read back, at any world size.

#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <unordered_set>
#include <vector>

#include <torch/nn/module.h>

#include "gradsync/checkpoint/shard_index.hpp"
#include "gradsync/checkpoint/tensor_info.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/integration/torch/sharded_state_entries.hpp"
#include "gradsync/train/checkpoint/checkpoint_directory.hpp"
#include "gradsync/train/checkpoint/replicated_checkpoint.hpp"

namespace gradsync {

/// Collective over `comm`, the communicator `module`'s units were wrapped
/// with: loads into `module` the parameters and buffers that
/// save_sharded_state_dict wrote to `dir` (the generation its commit file
/// names), whatever the world size and strategy of the save. Each rank
/// reads only the element ranges it holds under its own layout, from
/// whichever shard files hold them, checking each piece's checksum; the
/// checkpoint must hold exactly the module's tensors (names, dtypes and
/// full shapes), as PyTorch's load_state_dict(strict=True) asks.
///
/// All or nothing: every rank reads and checks into staging, the ranks
/// agree, and only then does any rank change its tensors. A missing,
/// corrupt or mismatched file makes every rank throw the same
/// gradsync::Error (InvalidArgument for a mismatch, FileError for the
/// system's refusal), naming the rank that found it and why, with the
/// module unchanged on every rank and none left waiting. Call it between
/// steps; the optimizer's state is not loaded.
///
/// \tparam Holder  a module holder (ShardedModule, a TORCH_MODULE type) or
///                 a `std::shared_ptr` to a torch::nn::Module subclass.
/// \tparam B       the backend of `comm` (Threads, Mpi).
template <class Holder, Backend B>
void load_sharded_state_dict(Holder& module, Communicator<B>& comm, const std::filesystem::path& dir) {
  std::shared_ptr<torch::nn::Module> root;
  if constexpr (requires { module.ptr(); }) {
    root = module.ptr();
  } else {
    root = module;
  }
  const std::string where = "load_sharded_state_dict from '" + dir.string() + "'";
  std::exception_ptr error;
  std::vector<detail::ShardedStateEntry> entries;
  std::vector<at::Tensor> staged;
  try {
    std::string refusal;
    entries = detail::sharded_state_entries(root, &comm, comm.rank(), refusal);
    // agree() puts `where` and the rank before each message.
    if (!refusal.empty()) throw InvalidArgument("gradsync: " + refusal);
    const auto entry = detail::find_checkpoint(dir);
    if (!entry) throw Error("gradsync: the directory holds no checkpoint (no commit file); write one with save_sharded_state_dict");
    if (!entry->sharded) {
      throw InvalidArgument("gradsync: '" + entry->file.string() +
                            "' is a full checkpoint; load_sharded_state_dict reads what save_sharded_state_dict "
                            "writes (for a full file, read it with load_safetensors)");
    }
    const checkpoint::ShardIndex index = checkpoint::ShardIndex::read(entry->file);
    if (!entry->id.empty() && index.checkpoint_id() != entry->id) {
      throw Error("gradsync: the index '" + entry->file.string() + "' is of checkpoint '" +
                  index.checkpoint_id() + "' where the commit file names '" + entry->id + "'");
    }
    // Strict, both ways: a tensor of the module the checkpoint lacks is
    // named by ShardIndex::load, one the checkpoint has that the module lacks here.
    std::unordered_set<std::string> names;
    for (const auto& e : entries) names.insert(e.info.name);
    for (const auto& t : index.tensors()) {
      if (!names.contains(t.spec.name)) {
        throw InvalidArgument("gradsync: the checkpoint holds tensor '" + t.spec.name +
                              "', which the module has not: it was saved from another model");
      }
    }
    std::vector<checkpoint::RangeSlot> slots;
    for (const auto& e : entries) {
      at::Tensor s = torch::empty({static_cast<std::int64_t>(e.end - e.begin)}, e.local.options());
      slots.push_back({e.info, e.begin, e.end, std::span<std::byte>(static_cast<std::byte*>(s.data_ptr()), s.nbytes())});
      staged.push_back(std::move(s));
    }
    index.load(slots);
  } catch (...) {
    error = std::current_exception();
  }
  detail::agree<Auto>(comm, error, where);
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < entries.size(); ++i) entries[i].local.copy_(staged[i].view(entries[i].local.sizes()));
}

}  // namespace gradsync
