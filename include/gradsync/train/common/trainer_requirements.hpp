#pragma once
/// \file What both trainers ask of their model, optimizer and batch type, said once.

#include <concepts>

#include "gradsync/core/communicator.hpp"
#include "gradsync/train/common/model.hpp"
#include "gradsync/train/optim/optimizer.hpp"

namespace gradsync::detail {

/// Each requirement fails in its own sentence; the compiler's "required
/// from" line names the trainer and member that asked.
template <class M, class Opt>
struct TrainerRequirements {
  template <class Comm>
  static consteval bool communicator() {
    static_assert(CommunicatorTraits<Comm>::value,
                  "gradsync trainer: the third parameter must be gradsync::Communicator<Backend>");
    return true;
  }

  static consteval bool model_and_optimizer() {
    static_assert(ModelHasValueType<M>,
                  "gradsync trainer: the model must declare `using value_type = float;` (or double)");
    if constexpr (ModelHasValueType<M>) {
      static_assert(ModelComputeType<M>,
                    "gradsync trainer: the model's compute_type, if it declares one, must be its value_type or "
                    "gradsync::bfloat16");
    }
    static_assert(ModelDeclaresUnits<M>,
                  "gradsync trainer: the model must declare its parameters with "
                  "`std::vector<gradsync::UnitSpec> units() const`");
    static_assert(ModelWritesInitialValues<M>,
                  "gradsync trainer: the model must write its initial values with "
                  "`void init_unit(std::size_t, const gradsync::UnitView<value_type>&)` or "
                  "`void bind(std::span<const gradsync::UnitView<value_type>>)`");
    static_assert(std::move_constructible<M>, "gradsync trainer: the model must be move-constructible");
    // Without a value_type there is no element type to check the optimizer against.
    if constexpr (ModelHasValueType<M>) {
      static_assert(Optimizer<Opt, typename M::value_type>,
                    "gradsync trainer: the optimizer must provide `step(std::span<T> params, "
                    "std::span<const T> grads)`, `double lr() const` and `set_lr(double)` for T = the model's "
                    "value_type");
    }
    return true;
  }

  template <class Batch>
  static consteval bool batch() {
    static_assert(TrainableOn<M, Batch>,
                  "gradsync trainer: the model has no `double forward_backward(const Batch&, "
                  "const gradsync::StepContext<compute_type>&)` for this batch type (compute_type: the "
                  "model's value_type unless it declares one)");
    return true;
  }
};

}  // namespace gradsync::detail
