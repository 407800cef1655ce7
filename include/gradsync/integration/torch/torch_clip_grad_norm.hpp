#pragma once
/// \file clip_grad_norm_: torch::nn::utils::clip_grad_norm_ for a fully_shard model, whose gradients are sharded.

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
#include "gradsync/integration/torch/tensor.hpp"
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
/// gradient once; a parameter whose `.grad` is undefined counts for
/// nothing, as in torch's. Parameters no unit holds (wrap the root to have
/// none) are left out.
template <class Holder, Backend B>
double clip_grad_norm_(Holder& module, Communicator<B>& comm, double max_norm, double p = 2.0) {
  detail::check_norm_order("gradsync::clip_grad_norm_", max_norm, p);
  std::vector<at::Tensor> sharded, whole;
  // HybridShard's shards are held by each replica: a unit's share of the
  // sum over the ranks is its partial over its number of copies.
  std::vector<int> copies;
  // What each parameter's `.grad` holds, as torch::nn::utils::clip_grad_norm_
  // reads it: a unit no backward reached since its gradients were reset
  // contributes nothing, not the gradient its shard kept from before.
  for (const auto& unit : detail::torch_units_under(module)) {
    for (const at::Tensor& t : unit->parameters()) {
      const at::Tensor& g = t.grad();
      if (!g.defined()) continue;
      if (unit->sharded()) {
        sharded.push_back(g);
        copies.push_back(unit->replicas());
      } else {
        whole.push_back(g);
      }
    }
  }
  auto partial = [p](const std::vector<at::Tensor>& grads, const std::vector<int>& per) {
    double sum = 0;
    for (std::size_t i = 0; i < grads.size(); ++i) {
      const at::Tensor g = grads[i].contiguous();
      double part = g.scalar_type() == c10::ScalarType::Double
                        ? detail::norm_partial(detail::span_of<const double>(g), p)
                        : detail::norm_partial(detail::span_of<const float>(g), p);
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
    for (const at::Tensor& grad : *list) {
      // fully_shard's gradients are contiguous; one the caller replaced may not be.
      at::Tensor g = grad.contiguous();
      if (g.scalar_type() == c10::ScalarType::Double) {
        detail::clip_to(detail::span_of<double>(g), total, max_norm);
      } else {
        detail::clip_to(detail::span_of<float>(g), total, max_norm);
      }
      if (!g.is_same(grad)) grad.copy_(g);
    }
  }
  return total;
}

}  // namespace gradsync
