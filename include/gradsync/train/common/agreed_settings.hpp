#pragma once
/// \file What a trainer's ranks must share besides their units: the
/// optimizer's type and hyper-parameters, in the words a message prints.
///
/// Replicas that step with different learning rates, or Adam on one rank
/// and AdamW on another, diverge while every collective matches; so the
/// trainers agree on these at construction (detail::check_trainer_units),
/// and on the learning rate again at every step (its calls' labels).

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "gradsync/train/optim/optimizer.hpp"
#include "gradsync/train/common/step_labels.hpp"
#include "gradsync/train/common/unit_agreement.hpp"

namespace gradsync::detail {

/// T's name as the compiler spells it ("gradsync::Adam<float>"), for a
/// type that has no name of its own to give.
template <class T>
constexpr std::string_view type_name() noexcept {
  constexpr std::string_view f = __PRETTY_FUNCTION__;
  // GCC and Clang both write "... [with T = X; ...]" or "... [T = X]".
  constexpr std::size_t at = f.find("T = ");
  if constexpr (at == std::string_view::npos) {
    return f;
  } else {
    constexpr std::size_t from = at + 4;
    constexpr std::size_t end = f.find_first_of(";]", from);
    return f.substr(from, end - from);
  }
}

/// The optimizer's kind, hyper-parameters and steps as settings ranks must
/// share: "optimizer" (its checkpoint kind, "Adam", or its type's name),
/// "optimizer lr", "optimizer beta1", ... (each that state() lists; the
/// learning rate alone where the optimizer lists none) and "optimizer steps
/// taken" (where it lists them).
template <class T, class Opt>
void add_optimizer_settings(std::vector<AgreedValue>& out, const Opt& opt) {
  static constexpr std::string_view fix =
      "Construct every rank's optimizer alike (the same type and hyper-parameters): replicas that step differently "
      "diverge while every collective matches.";
  if constexpr (CheckpointableOptimizer<Opt, T>) {
    const OptimizerStateView<T> s = opt.state();
    out.push_back({"optimizer", std::string(s.kind), std::string(fix)});
    for (const auto& [name, value] : s.hyperparameters) {
      out.push_back({"optimizer " + std::string(name), shortest(value), std::string(fix)});
    }
    // Adam's bias correction counts its steps: an optimizer that stepped
    // before it was handed to the trainer would step differently from its
    // peers ever after.
    out.push_back({"optimizer steps taken", std::to_string(s.steps),
                   "Give every rank's trainer an optimizer in the same state: fresh on every rank, or loaded from "
                   "one checkpoint (load_checkpoint restores it on every rank alike)."});
  } else {
    out.push_back({"optimizer", std::string(type_name<Opt>()), std::string(fix)});
    out.push_back({"optimizer lr", shortest(static_cast<double>(opt.lr())), std::string(fix)});
  }
}

/// A setting from a number or a flag, in words.
inline AgreedValue setting(std::string name, std::size_t value, std::string fix = {}) {
  return {std::move(name), std::to_string(value), std::move(fix)};
}
inline AgreedValue flag(std::string name, bool value, std::string fix = {}) {
  return {std::move(name), value ? "true" : "false", std::move(fix)};
}

}  // namespace gradsync::detail
