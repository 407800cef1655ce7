#pragma once
/// \file detail::graph_reach: the autograd nodes a forward's result reaches, for find_unused_parameters.

#include <unordered_set>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

namespace gradsync::detail {

/// Every node of the autograd graph behind `out` (none where it has no
/// graph): a parameter whose gradient accumulator is not among them gets no
/// gradient from `out`'s backward, as PyTorch's DDP finds by the same walk.
inline std::unordered_set<const torch::autograd::Node*> graph_reach(const at::Tensor& out) {
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<const torch::autograd::Node*> todo;
  if (out.grad_fn()) todo.push_back(out.grad_fn().get());
  while (!todo.empty()) {
    const torch::autograd::Node* n = todo.back();
    todo.pop_back();
    if (!seen.insert(n).second) continue;
    for (const torch::autograd::Edge& e : n->next_edges()) {
      if (e.function) todo.push_back(e.function.get());
    }
  }
  return seen;
}

}  // namespace gradsync::detail
