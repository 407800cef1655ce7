#pragma once
/// \file no_sync for fully_shard models: backward accumulates full local gradients without communicating.

#include <memory>
#include <utility>
#include <vector>

#include "gradsync/integration/torch/torch_unit_registry.hpp"

namespace gradsync {

/// What gradsync::no_sync returns: while it lives, the backward of every
/// fully_shard unit under the module only adds the unit's full (unsharded)
/// gradient to a local sum, and the first backward after it reduces that
/// sum with its own (PyTorch FSDP's `no_sync()`, FSDP2's
/// `set_requires_gradient_sync(False)`). Each unit then holds a full
/// gradient until that backward (memory of the unsharded unit, as
/// PyTorch's), and the parameters' `.grad` stay what the last synced
/// backward left: step the optimizer only after a synced backward. The
/// sum is the unit's own, so `zero_grad` does not clear it.
///
/// Every rank must run as many backwards under it before a synced one: a
/// rank that runs one more fails the unit's next collective on every rank,
/// naming both ranks' counts of backwards ("backward 2", "backward 3").
/// On exit each unit goes back to what it was.
class FullyShardNoSync {
 public:
  /// \tparam Holder  a module holder (ShardedModule, TORCH_MODULE) or a shared_ptr to a module.
  template <class Holder>
  explicit FullyShardNoSync(Holder& module) {
    for (auto& unit : detail::torch_units_under(module)) {
      const bool was = unit->requires_gradient_sync();
      unit->set_requires_gradient_sync(false);
      units_.emplace_back(std::move(unit), was);
    }
  }
  FullyShardNoSync(const FullyShardNoSync&) = delete;
  FullyShardNoSync& operator=(const FullyShardNoSync&) = delete;
  ~FullyShardNoSync() {
    for (auto& [unit, was] : units_) unit->set_requires_gradient_sync(was);
  }

 private:
  std::vector<std::pair<std::shared_ptr<detail::TorchUnit>, bool>> units_;
};

/// Gradient sync off for every fully_shard unit under `module` while the
/// returned guard lives (see FullyShardNoSync):
///
///     { auto guard = gradsync::no_sync(net);
///       for (auto& mb : first_micro_batches) loss(net(mb)).backward(); }
///     loss(net(last)).backward();   // reduces the sum of all of them
///     opt.step();
template <class Holder>
[[nodiscard]] FullyShardNoSync no_sync(Holder& module) {
  return FullyShardNoSync(module);
}

}  // namespace gradsync
