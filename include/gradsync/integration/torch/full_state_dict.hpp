#pragma once
/// \file full_state_dict: a fully_shard model's full parameters and buffers, named as the unwrapped module names them.

#include <memory>
#include <string>
#include <unordered_map>

#include <torch/nn/module.h>
#include <torch/ordered_dict.h>

#include "gradsync/integration/torch/torch_unit_registry.hpp"

namespace gradsync {

/// Collective over every unit under `module` (each gathers on its own
/// communicator, in the module tree's order, the same on every rank):
/// copies of the full parameters, by the names `named_parameters()` gives
/// them, then of the buffers, on every rank. Parameters no unit holds are
/// copied as they are. What a checkpoint or a comparison with an unsharded
/// model reads.
///
/// \tparam Holder  a module holder (ShardedModule, a TORCH_MODULE type) or
///                 a `std::shared_ptr` to a torch::nn::Module subclass.
template <class Holder>
torch::OrderedDict<std::string, at::Tensor> full_state_dict(Holder& module) {
  const std::shared_ptr<torch::nn::Module> root = detail::module_root(module);
  std::unordered_map<const c10::TensorImpl*, at::Tensor> full;
  for (const auto& sub : root->modules(/*include_self=*/true)) {
    if (auto unit = detail::find_torch_unit(sub.get())) {
      const std::vector<at::Tensor> values = unit->full_parameters();
      for (std::size_t i = 0; i < values.size(); ++i) full[unit->parameters()[i].unsafeGetTensorImpl()] = values[i];
    }
  }
  torch::NoGradGuard no_grad;
  torch::OrderedDict<std::string, at::Tensor> out;
  for (const auto& np : root->named_parameters(/*recurse=*/true)) {
    auto it = full.find(np.value().unsafeGetTensorImpl());
    out.insert(np.key(), it != full.end() ? it->second : np.value().detach().clone());
  }
  for (const auto& nb : root->named_buffers(/*recurse=*/true)) out.insert(nb.key(), nb.value().detach().clone());
  return out;
}

}  // namespace gradsync
