#pragma once
/// \file load_sharded_state_dict: a sharded save of a fully_shard model (and its optimizer) read back, at any world size.

#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <unordered_set>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "gradsync/algorithm/tags.hpp"
#include "gradsync/checkpoint/shard_index.hpp"
#include "gradsync/checkpoint/tensor_info.hpp"
#include "gradsync/collective/all_gather.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/integration/torch/sharded_optimizer_state.hpp"
#include "gradsync/integration/torch/sharded_state_entries.hpp"
#include "gradsync/integration/torch/torch_unit_registry.hpp"
#include "gradsync/train/checkpoint/checkpoint_directory.hpp"
#include "gradsync/train/checkpoint/checkpoint_source.hpp"
#include "gradsync/train/checkpoint/replicated_checkpoint.hpp"

namespace gradsync {

namespace detail {

/// The checkpoint dtype's LibTorch scalar type (those checkpoint_dtype_of maps).
inline c10::ScalarType scalar_type_of(checkpoint::TensorDtype t) {
  switch (t) {
    case checkpoint::TensorDtype::F64: return c10::ScalarType::Double;
    case checkpoint::TensorDtype::BF16: return c10::ScalarType::BFloat16;
    case checkpoint::TensorDtype::F16: return c10::ScalarType::Half;
    case checkpoint::TensorDtype::I64: return c10::ScalarType::Long;
    case checkpoint::TensorDtype::I32: return c10::ScalarType::Int;
    case checkpoint::TensorDtype::BOOL: return c10::ScalarType::Bool;
    case checkpoint::TensorDtype::F32: return c10::ScalarType::Float;
    default:
      throw InvalidArgument(std::string("gradsync: no LibTorch tensor of a module holds checkpoint dtype ") +
                            std::string(checkpoint::dtype_name(t)));
  }
}

/// Did every rank open the same checkpoint (`fingerprint`: fingerprint_of
/// its index)? Ranks handed different ones (a stale copy on one node,
/// another run's save) would each load their own shards and train a model
/// no save ever held. Collective; throws InvalidArgument on every rank.
template <Backend B>
void check_same_index(Communicator<B>& comm, std::uint64_t fingerprint, const std::string& where) {
  const auto mine = static_cast<std::int64_t>(fingerprint);
  std::vector<std::int64_t> all(static_cast<std::size_t>(comm.size()));
  AllGather<Auto>{}(comm, std::span<const std::int64_t>(&mine, 1), std::span<std::int64_t>(all));
  std::string ranks;
  for (std::size_t r = 1; r < all.size(); ++r) {
    if (all[r] != all[0]) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  }
  if (ranks.empty()) return;
  throw InvalidArgument("gradsync: " + where + ": the ranks read different checkpoints: rank(s) " + ranks +
                        " read another than rank 0 did (a stale copy, or another run's save); nothing was loaded");
}

/// load_sharded_state_dict, with the optimizer's state where `optimizer` is not null.
template <class Holder, Backend B>
void load_sharded_state(Holder& module, torch::optim::Optimizer* optimizer, Communicator<B>& comm,
                        const std::filesystem::path& dir) {
  const std::shared_ptr<torch::nn::Module> root = module_root(module);
  const std::string where = "load_sharded_state_dict from '" + dir.string() + "'";
  std::exception_ptr error;
  std::vector<ShardedStateEntry> entries;
  std::vector<OptimizerStateEntry> states;
  std::vector<at::Tensor> staged;
  std::uint64_t fingerprint = 0;
  try {
    std::string refusal;
    entries = sharded_state_entries(root, &comm, comm.rank(), refusal);
    if (optimizer) states = sharded_optimizer_entries(*optimizer, entries, /*loading=*/true, comm.rank(), refusal);
    // agree() puts `where` and the rank before each message.
    if (!refusal.empty()) throw InvalidArgument("gradsync: " + refusal);
    const auto entry = find_checkpoint(dir);
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
    fingerprint = fingerprint_of(index);
    // Strict, both ways: a tensor of the module the checkpoint lacks is
    // named by ShardIndex::load, one the checkpoint has that the module
    // lacks here (the optimizer's are skipped when none is given).
    std::unordered_set<std::string> names;
    for (const auto& e : entries) names.insert(e.info.name);
    for (const auto& e : states) names.insert(e.entry.info.name);
    for (const auto& t : index.tensors()) {
      if (!optimizer && t.spec.name.starts_with("optimizer.")) continue;
      if (!names.contains(t.spec.name)) {
        throw InvalidArgument("gradsync: the checkpoint holds tensor '" + t.spec.name +
                              "', which the module has not: it was saved from another model");
      }
    }
    std::vector<checkpoint::RangeSlot> slots;
    auto stage = [&](const ShardedStateEntry& e) {
      at::Tensor s = torch::empty({static_cast<std::int64_t>(e.end - e.begin)},
                                  at::TensorOptions().dtype(scalar_type_of(e.info.dtype)));
      slots.push_back({e.info, e.begin, e.end, std::span<std::byte>(static_cast<std::byte*>(s.data_ptr()), s.nbytes())});
      staged.push_back(std::move(s));
    };
    for (const auto& e : entries) stage(e);
    for (const auto& e : states) stage(e.entry);
    index.load(slots);
  } catch (...) {
    error = std::current_exception();
  }
  agree<Auto>(comm, error, where);
  check_same_index(comm, fingerprint, where);
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < entries.size(); ++i) entries[i].local.copy_(staged[i].view(entries[i].local.sizes()));
  for (std::size_t i = 0; i < states.size(); ++i) states[i].set(staged[entries.size() + i]);
}

}  // namespace detail

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
/// module (and optimizer) unchanged on every rank and none left waiting.
/// Call it between steps.
///
/// With `optimizer` (torch::optim::SGD, Adam or AdamW on the module's
/// parameters, with or without state yet), its state too, as
/// save_sharded_state_dict with an optimizer wrote it (resharded like the
/// parameters); without, the checkpoint's optimizer tensors are ignored.
///
/// \tparam Holder  a module holder (ShardedModule, a TORCH_MODULE type) or
///                 a `std::shared_ptr` to a torch::nn::Module subclass.
/// \tparam B       the backend of `comm` (Threads, Mpi).
template <class Holder, Backend B>
void load_sharded_state_dict(Holder& module, Communicator<B>& comm, const std::filesystem::path& dir) {
  detail::load_sharded_state(module, nullptr, comm, dir);
}

template <class Holder, Backend B>
void load_sharded_state_dict(Holder& module, torch::optim::Optimizer& optimizer, Communicator<B>& comm,
                             const std::filesystem::path& dir) {
  detail::load_sharded_state(module, &optimizer, comm, dir);
}

}  // namespace gradsync
