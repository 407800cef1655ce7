#pragma once
/// \file detail::fsdp::UnitMembers: the model protocol for the model units
/// of one wrapped unit. The model asks for each model unit once in forward
/// and once in backward, holds it while it uses it and reports its
/// gradient ready while still holding it from the backward ask; a model
/// that breaks this gets a sentence naming the unit and the fix. Apart from
/// UnitGroup's phases because it is the model's contract, per model unit,
/// whatever the strategy does with the wrapped unit.

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "gradsync/core/error.hpp"
#include "gradsync/train/common/model.hpp"

namespace gradsync::detail::fsdp {

/// A model unit in this step: the protocol is the model's, per model unit.
template <class C>
struct MemberState {
  UnitView<C> view;  ///< what the model sees while it holds the unit
  int asks = 0;      ///< in this step: 1 = forward, 2 = backward
  bool held = false;
  bool ready = false;
};

/// Model units [first, last] of one wrapped unit, C the model's compute type.
template <class C>
class UnitMembers {
 public:
  UnitMembers(std::size_t first, std::size_t last) : first_(first), members_(last - first + 1) {}

  /// A step (or evaluation) starts: no member asked, held or ready.
  void begin_step() noexcept {
    for (MemberState<C>& m : members_) m = {std::move(m.view), 0, false, false};
    held_ = ready_ = 0;
  }

  /// The model asks for member `layer` (`layer_name` for messages); returns
  /// whether it is the backward ask. Reached through UnitGroup::ask, which
  /// also takes a lingering unit back.
  bool ask(std::size_t layer, bool evaluating, const std::string& where, const std::string& layer_name) {
    MemberState<C>& m = member(layer);
    if (m.held) {
      throw InvalidArgument(where + ": the model asked for " + layer_name +
                            " while it still holds it; ask once and keep the handle (ctx.params) while you use it");
    }
    if (!evaluating && m.asks == 2) {
      throw InvalidArgument(where + ": the model asked for " + layer_name +
                            " a third time in one step; a step asks once in forward and once in backward");
    }
    ++m.asks;
    return !evaluating && m.asks == 2;
  }

  /// The model holds member `layer` until its release.
  void hold(std::size_t layer) noexcept {
    member(layer).held = true;
    ++held_;
  }
  /// Lends member `layer` as `view` (over the gathered unit) until its release.
  const UnitView<C>& hand_out(std::size_t layer, UnitView<C> view) {
    member(layer).view = std::move(view);
    hold(layer);
    return member(layer).view;
  }

  /// The model reports member `layer`'s gradient final; returns true once
  /// every member's is, when the unit's gradient can be reduced.
  bool report_ready(std::size_t layer, bool evaluating, const std::string& where, const std::string& layer_name) {
    MemberState<C>& m = member(layer);
    if (evaluating) {
      throw InvalidArgument(where + ": the model reported " + layer_name +
                            " ready during evaluate(), which runs no backward");
    }
    if (m.ready) {
      throw InvalidArgument(where + ": the model reported " + layer_name + " ready twice in one backward");
    }
    if (!m.held || m.asks != 2) {
      throw InvalidArgument(where + ": the model reported " + layer_name +
                            " ready without holding it from a backward ask; in backward, hold `auto p = "
                            "ctx.params(u)` (its second ask of the step), add the gradient into p's grad views, "
                            "then call ctx.ready(u)");
    }
    m.ready = true;
    return ++ready_ == members_.size();
  }
  /// Member `layer` reported its gradient in this backward.
  bool ready(std::size_t layer) const noexcept { return members_[layer - first_].ready; }

  /// The model lets go of member `layer`: returns how often it was asked
  /// for in this step, or 0 if the model did not hold it.
  int let_go(std::size_t layer) noexcept {
    MemberState<C>& m = member(layer);
    if (!m.held) return 0;
    m.held = false;
    --held_;
    return m.asks;
  }
  /// Members the model holds now.
  std::size_t held() const noexcept { return held_; }
  /// Every member has been asked for at least `asks` times in this step.
  bool all_asked(int asks) const noexcept {
    for (const MemberState<C>& m : members_) {
      if (m.asks < asks) return false;
    }
    return true;
  }
  /// The step ended: the model holds none (a handle kept past it was let go of).
  void drop_holds() noexcept {
    held_ = 0;
    for (MemberState<C>& m : members_) m.held = false;
  }

 private:
  MemberState<C>& member(std::size_t layer) noexcept { return members_[layer - first_]; }

  std::size_t first_;
  std::vector<MemberState<C>> members_;
  std::size_t held_ = 0;   ///< members the model holds
  std::size_t ready_ = 0;  ///< members reported ready in this backward
};

}  // namespace gradsync::detail::fsdp
