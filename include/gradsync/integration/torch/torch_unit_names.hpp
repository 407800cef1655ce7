#pragma once
/// \file detail::TorchUnitNames: how a fully_shard unit's collective labels read in errors.

#include <cstdint>
#include <string>

#include "gradsync/core/call_label.hpp"
#include "gradsync/integration/torch/torch_unit_registry.hpp"
#include "gradsync/train/common/step_labels.hpp"

namespace gradsync::detail {

/// Reads a label of a fully_shard unit, this rank's or a peer's, with the
/// descriptions of the units wrapped with this rank's communicator (the
/// peers wrapped the same ones in the same order).
class TorchUnitNames final : public LabelNames {
 public:
  explicit TorchUnitNames(const void* comm) noexcept : comm_(comm) {}
  std::string describe(std::uint64_t id, std::uint64_t setting) const override {
    return StepLabels("backward", "fully_shard unit", torch_unit_descriptions(comm_), "setting").describe(id, setting);
  }

 private:
  const void* comm_;
};

}  // namespace gradsync::detail
