#pragma once
/// \file WrapPolicy: how ShardedTrainer groups a model's units into wrapped (FSDP) units.

#include <cstddef>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "gradsync/train/common/model.hpp"

namespace gradsync {

/// Groups consecutive model units into wrapped units, the unit a
/// ShardedTrainer shards, gathers and reduces as one flat buffer (PyTorch
/// FSDP's auto_wrap_policy). Fewer, larger wrapped units mean fewer, larger
/// collectives; the largest one bounds the memory a gather needs.
///
/// Only consecutive units group: a wrapped unit is then one contiguous range
/// of the model's parameters, and a model that reaches its units in order
/// reaches each wrapped unit's members together.
class WrapPolicy {
 public:
  /// Called for each model unit in declaration order: `unit`, its `index`,
  /// and `group_params`, the parameters of the wrapped unit being built
  /// with this one included. true: the wrapped unit ends after this one.
  /// It must answer alike on every rank (the trainer checks the plan).
  using Predicate = std::function<bool(const UnitSpec& unit, std::size_t index, std::size_t group_params)>;

  /// Every model unit is a wrapped unit of its own (the default).
  static WrapPolicy per_unit() { return WrapPolicy(Kind::per_unit, 0, {}); }

  /// Consecutive model units merge until the group holds at least
  /// `min_params` parameters (FSDP's size_based_auto_wrap_policy, whose
  /// default is 1e8); the units after the last full group form one more,
  /// smaller, wrapped unit.
  static WrapPolicy size_based(std::size_t min_params) { return WrapPolicy(Kind::size_based, min_params, {}); }

  /// Wrapped units end where `ends_group` says (FSDP's lambda / CustomPolicy);
  /// units after the last `true` form one more wrapped unit.
  static WrapPolicy custom(Predicate ends_group) {
    return WrapPolicy(Kind::custom, 0, std::move(ends_group));
  }

  /// Each wrapped unit as [first, last] model unit indices, in order,
  /// together covering every model unit once.
  std::vector<std::pair<std::size_t, std::size_t>> group(const std::vector<UnitSpec>& units) const {
    std::vector<std::pair<std::size_t, std::size_t>> groups;
    std::size_t first = 0, params = 0;
    for (std::size_t i = 0; i < units.size(); ++i) {
      for (const TensorSpec& t : units[i].params) params += t.count();
      if (ends(units[i], i, params)) {
        groups.emplace_back(first, i);
        first = i + 1;
        params = 0;
      }
    }
    if (first < units.size()) groups.emplace_back(first, units.size() - 1);
    return groups;
  }

  /// The policy in words, for the plan: "per unit", "size-based (at least
  /// 1000 parameters)", "custom predicate".
  std::string describe() const {
    switch (kind_) {
      case Kind::per_unit: return "per unit";
      case Kind::size_based: return "size-based (at least " + std::to_string(min_params_) + " parameters)";
      case Kind::custom: return "custom predicate";
    }
    return "?";
  }

  /// Whether the grouping depends on more than the units (a predicate),
  /// which is what the trainer must check across ranks.
  bool is_custom() const noexcept { return kind_ == Kind::custom; }

 private:
  enum class Kind { per_unit, size_based, custom };

  WrapPolicy(Kind kind, std::size_t min_params, Predicate p)
      : kind_(kind), min_params_(min_params), predicate_(std::move(p)) {}

  bool ends(const UnitSpec& unit, std::size_t index, std::size_t params) const {
    switch (kind_) {
      case Kind::per_unit: return true;
      case Kind::size_based: return params >= min_params_;
      case Kind::custom: return predicate_ && predicate_(unit, index, params);
    }
    return true;
  }

  Kind kind_;
  std::size_t min_params_;
  Predicate predicate_;
};

}  // namespace gradsync
