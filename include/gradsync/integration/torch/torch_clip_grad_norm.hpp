#pragma once
/// \file clip_grad_norm_: torch::nn::utils::clip_grad_norm_ for a fully_shard model, whose gradients are sharded.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
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
/// ∞; HybridShard's over its replicas' count), NoShard units their whole
/// gradient once. Parameters no unit holds
/// (wrap the root to have none) are left out.
template <class Holder, Backend B>
double clip_grad_norm_(Holder& module, Communicator<B>& comm, double max_norm, double p = 2.0) {
  detail::check_norm_order("gradsync::clip_grad_norm_", max_norm, p);
  std::vector<at::Tensor> sharded, whole;
  // HybridShard's shards are held by each replica: a unit's share of the
  // sum over the ranks is its partial over its number of copies.
  std::vector<int> copies;
  for (const auto& unit : detail::torch_units_under(module)) {
    at::Tensor g = unit->local_gradient();
    if (!g.defined()) continue;
    if (unit->sharded()) {
      sharded.push_back(g);
      copies.push_back(unit->replicas());
    } else {
      whole.push_back(g);
    }
  }
  auto partial = [p](const std::vector<at::Tensor>& grads, const std::vector<int>& per) {
    double sum = 0;
    for (std::size_t i = 0; i < grads.size(); ++i) {
      const at::Tensor& g = grads[i];
      double part = g.scalar_type() == c10::ScalarType::Double
                        ? detail::norm_partial(std::span<const double>(g.data_ptr<double>(), g.numel()), p)
                        : detail::norm_partial(std::span<const float>(g.data_ptr<float>(), g.numel()), p);
      if (!per.empty() && !std::isinf(p)) part /= per[i];
      sum = std::isinf(p) ? detail::max_keeping_nan(sum, part) : sum + part;
    }
    return sum;
  };
  double combined = partial(sharded, copies);
  if (comm.size() > 1) {
    if (std::isinf(p)) {
      std::array<double, 2> pair = detail::inf_partial_for_max(combined);
      AllReduce<Auto>{}(comm, std::span<double>(pair), Max{});
      combined = detail::combined_inf_partial(pair);
    } else {
      AllReduce<Auto>{}(comm, std::span<double>(&combined, 1), Sum{});
    }
  }
  const double rest = partial(whole, {});
  combined = std::isinf(p) ? detail::max_keeping_nan(combined, rest) : combined + rest;
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
