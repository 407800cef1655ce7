#pragma once
/// \file clip_grad_norm_: torch::nn::utils::clip_grad_norm_ for a fully_shard model, whose gradients are sharded.

#include <algorithm>
#include <cmath>
#include <memory>
#include <span>
#include <vector>

#include <torch/nn/module.h>

#include "gradsync/collective/all_reduce.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/integration/torch/torch_unit_registry.hpp"
#include "gradsync/train/optim/clip_grad_norm.hpp"

namespace gradsync {

/// Collective over `comm`, the communicator every unit under `module` was
/// wrapped with: the norm of order `p` of the whole model's averaged
/// gradient, the same on every rank, after which every unit's gradient is
/// scaled by max_norm / (norm + 1e-6) when that is below 1, as
/// torch::nn::utils::clip_grad_norm_ does on an unsharded model. Call it
/// after backward, before the optimizer's step. Sharded units contribute
/// their shard's partial (summed over the ranks, or the largest for p =
/// ∞), NoShard units their whole gradient once. Parameters no unit holds
/// (wrap the root to have none) are left out.
template <class Holder, Backend B>
double clip_grad_norm_(Holder& module, Communicator<B>& comm, double max_norm, double p = 2.0) {
  detail::check_norm_order("gradsync::clip_grad_norm_", max_norm, p);
  std::shared_ptr<torch::nn::Module> root;
  if constexpr (requires { module.ptr(); }) {
    root = module.ptr();
  } else {
    root = module;
  }
  std::vector<at::Tensor> sharded, whole;
  for (const auto& sub : root->modules(/*include_self=*/true)) {
    auto unit = detail::find_torch_unit(sub.get());
    if (!unit) continue;
    at::Tensor g = unit->local_gradient();
    if (g.defined()) (unit->sharded() ? sharded : whole).push_back(g);
  }
  auto partial = [p](const std::vector<at::Tensor>& grads) {
    double sum = 0;
    for (const at::Tensor& g : grads) {
      const double part = g.scalar_type() == c10::ScalarType::Double
                              ? detail::norm_partial(std::span<const double>(g.data_ptr<double>(), g.numel()), p)
                              : detail::norm_partial(std::span<const float>(g.data_ptr<float>(), g.numel()), p);
      sum = std::isinf(p) ? std::max(sum, part) : sum + part;
    }
    return sum;
  };
  double combined = partial(sharded);
  if (comm.size() > 1) {
    if (std::isinf(p)) {
      AllReduce<Auto>{}(comm, std::span<double>(&combined, 1), Max{});
    } else {
      AllReduce<Auto>{}(comm, std::span<double>(&combined, 1), Sum{});
    }
  }
  const double rest = partial(whole);
  combined = std::isinf(p) ? std::max(combined, rest) : combined + rest;
  const double total = detail::norm_total(combined, p);
  for (const auto* list : {&sharded, &whole}) {
    for (const at::Tensor& g : *list) {
      if (g.scalar_type() == c10::ScalarType::Double) {
        detail::clip_to(std::span<double>(g.data_ptr<double>(), g.numel()), total, max_norm);
      } else {
        detail::clip_to(std::span<float>(g.data_ptr<float>(), g.numel()), total, max_norm);
      }
    }
  }
  return total;
}

}  // namespace gradsync
