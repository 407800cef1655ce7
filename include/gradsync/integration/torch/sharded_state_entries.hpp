#pragma once
/// \file detail::sharded_state_entries: what a sharded save of a fully_shard model writes and a load fills, per rank.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/nn/module.h>

#include "gradsync/checkpoint/tensor_dtype.hpp"
#include "gradsync/checkpoint/tensor_info.hpp"
#include "gradsync/integration/torch/torch_unit_registry.hpp"

namespace gradsync::detail {

/// The checkpoint dtype of a LibTorch scalar type, if safetensors files here hold it.
inline std::optional<checkpoint::TensorDtype> checkpoint_dtype_of(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Double: return checkpoint::TensorDtype::F64;
    case c10::ScalarType::Float: return checkpoint::TensorDtype::F32;
    case c10::ScalarType::BFloat16: return checkpoint::TensorDtype::BF16;
    case c10::ScalarType::Half: return checkpoint::TensorDtype::F16;
    case c10::ScalarType::Long: return checkpoint::TensorDtype::I64;
    case c10::ScalarType::Int: return checkpoint::TensorDtype::I32;
    case c10::ScalarType::Bool: return checkpoint::TensorDtype::BOOL;
    default: return std::nullopt;
  }
}

/// One tensor of a module's state as one rank sees it: its full spec (the
/// unwrapped module's name, dtype and shape), the elements [begin, end) of
/// its full value this rank holds, `local` (the tensor holding them: a
/// unit's 1-D piece, or the whole tensor) and whether this rank's copy is
/// the one a save writes.
struct ShardedStateEntry {
  checkpoint::TensorInfo info;
  std::uint64_t begin = 0, end = 0;
  at::Tensor local;
  bool writes = false;
};

/// The entries of `root`'s parameters (named_parameters() order), then of
/// its buffers: pieces of the units' parameters as each unit holds them,
/// whole tensors for the parameters no unit holds and for the buffers
/// (rank `rank` 0's copy written). `refusal` gets the first reason the
/// state cannot be saved or loaded now on this rank (empty if none):
/// a unit wrapped with a communicator other than `comm` (its ranks would
/// not be this save's), a unit gathered (between a forward and its
/// backward, its parameters are not its pieces), a dtype no file here
/// holds.
inline std::vector<ShardedStateEntry> sharded_state_entries(const std::shared_ptr<torch::nn::Module>& root,
                                                            const void* comm, int rank, std::string& refusal) {
  struct Held {
    TorchUnit::HeldPiece piece;
    bool writes = false;
  };
  std::unordered_map<const c10::TensorImpl*, Held> held;
  for (const auto& sub : root->modules(/*include_self=*/true)) {
    auto unit = find_torch_unit(sub.get());
    if (!unit) continue;
    if (refusal.empty() && unit->communicator() != comm) {
      refusal = "the unit of module '" + sub->name() + "' (" + unit->description() +
                ") was wrapped with another communicator; save and load with the one fully_shard was given";
    }
    if (refusal.empty() && unit->sharded() && unit->gathered_bytes() > 0) {
      refusal = "the unit of module '" + sub->name() + "' (" + unit->description() +
                ") holds its gathered parameters (between a forward and its backward); save or load between steps";
    }
    const std::vector<TorchUnit::HeldPiece> pieces = unit->held_pieces();
    for (std::size_t i = 0; i < pieces.size(); ++i) {
      held[unit->parameters()[i].unsafeGetTensorImpl()] = {pieces[i], unit->writes_held()};
    }
  }
  std::vector<ShardedStateEntry> out;
  auto add = [&](const std::string& name, const at::Tensor& t, const Held* h) {
    ShardedStateEntry e;
    e.info.name = name;
    e.local = t;
    const auto dtype = checkpoint_dtype_of(t.scalar_type());
    if (!dtype && refusal.empty()) {
      refusal = "tensor '" + name + "' is " + c10::toString(t.scalar_type()) +
                ", which gradsync's checkpoint files do not hold";
    }
    e.info.dtype = dtype.value_or(checkpoint::TensorDtype::F32);
    const std::vector<std::int64_t> shape = h ? h->piece.shape : t.sizes().vec();
    for (std::int64_t d : shape) e.info.shape.push_back(static_cast<std::uint64_t>(d));
    e.begin = h ? h->piece.begin : 0;
    e.end = h ? h->piece.end : static_cast<std::uint64_t>(t.numel());
    e.writes = h ? h->writes : rank == 0;
    if (refusal.empty() && static_cast<std::uint64_t>(t.numel()) != e.end - e.begin) {
      refusal = "tensor '" + name + "' holds " + std::to_string(t.numel()) + " elements where its unit says " +
                std::to_string(e.end - e.begin) + "; save or load between steps";
    }
    out.push_back(std::move(e));
  };
  for (const auto& np : root->named_parameters(/*recurse=*/true)) {
    auto it = held.find(np.value().unsafeGetTensorImpl());
    add(np.key(), np.value(), it != held.end() ? &it->second : nullptr);
  }
  for (const auto& nb : root->named_buffers(/*recurse=*/true)) add(nb.key(), nb.value(), nullptr);
  return out;
}

}  // namespace gradsync::detail
