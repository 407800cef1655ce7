#pragma once
/// \file fully_shard_persistent_bytes: what a fully_shard model keeps on this rank between steps.

#include <cstddef>

#include <torch/nn/module.h>

#include "gradsync/integration/torch/torch_unit_registry.hpp"

namespace gradsync {

/// Bytes this rank keeps between steps for the parameters and gradients of
/// every unit under `module`: per unit, twice its padded shard
/// (⌈P/N⌉ elements of the parameters' dtype) under FullShard and
/// ShardGradOp, twice the whole unit (P) under NoShard. The gathered
/// parameters and the flat gradient a reduce-scatter packs are transient
/// and not counted, nor is the optimizer's state (built on the same pieces,
/// so 1/N of it too). Local: no communication.
template <class Holder>
std::size_t fully_shard_persistent_bytes(Holder& module) {
  std::size_t bytes = 0;
  for (const auto& unit : detail::torch_units_under(module)) bytes += unit->persistent_bytes();
  return bytes;
}

}  // namespace gradsync
