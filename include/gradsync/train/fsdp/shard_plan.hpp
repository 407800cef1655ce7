#pragma once
/// \file ShardPlan: what a ShardedTrainer wrapped, how it is split, and what each rank keeps.

#include <algorithm>
#include <cstddef>
#include <ostream>
#include <string>
#include <vector>

namespace gradsync {

/// A ShardedTrainer's wrapping plan: its wrapped units (what it gathers
/// and reduces as one flat buffer), the model units each one concatenates,
/// and the sizes that follow from the split over `shards` ranks.
struct ShardPlan {
  struct Unit {
    /// The member's name, or "first..last" for several.
    std::string name;
    /// Indices of the model units it concatenates, in order.
    std::vector<std::size_t> model_units;
    /// P: parameters (elements).
    std::size_t params = 0;
    /// c: elements of each rank's chunk, ⌈P/N⌉ (P under NoShard).
    std::size_t shard = 0;
    /// N·c − P: zeros that pad the gathered unit (0 under NoShard).
    std::size_t padding = 0;
    /// What every rank keeps between steps for it: parameter and gradient
    /// chunks and the optimizer's state, (2 + S)·c·element_bytes.
    std::size_t bytes_per_rank = 0;
    /// What a gather of it holds while it is gathered, N·c·element_bytes
    /// (0 under NoShard, which gathers nothing).
    std::size_t gathered_bytes = 0;
  };

  std::vector<Unit> units;
  /// The policy that grouped them (WrapPolicy::describe).
  std::string policy;
  /// The strategy's name ("FullShard", ...).
  std::string strategy;
  /// N: ranks a unit is split over (the shard group's size).
  int shards = 1;
  /// Copies of each shard (HybridShard's groups; 1 otherwise).
  int replicas = 1;
  std::size_t element_bytes = 0;
  /// S: optimizer state elements per parameter.
  std::size_t state_per_element = 0;

  std::size_t model_units() const noexcept {
    std::size_t n = 0;
    for (const Unit& u : units) n += u.model_units.size();
    return n;
  }
  std::size_t params() const noexcept {
    std::size_t n = 0;
    for (const Unit& u : units) n += u.params;
    return n;
  }
  /// Persistent bytes per rank: the sum of the units' bytes_per_rank.
  std::size_t bytes_per_rank() const noexcept {
    std::size_t n = 0;
    for (const Unit& u : units) n += u.bytes_per_rank;
    return n;
  }
  /// The largest gather, which bounds a step's transient memory.
  std::size_t max_gathered_bytes() const noexcept {
    std::size_t n = 0;
    for (const Unit& u : units) n = std::max(n, u.gathered_bytes);
    return n;
  }
};

/// The plan as a table, one line per wrapped unit and a total:
///
///     wrapping plan: 2 wrapped units of 4 model units, size-based (at least 30 parameters)
///     FullShard over 4 ranks x 1 replica, 4-byte elements, optimizer state 1 per parameter
///       unit  model units  name           params  shard  padding  bytes/rank  gathered
///          0  0-1          layer0..layer1     61     16        3         192       256
///     ...
///      total                                  69     ..                  ...
inline std::string to_string(const ShardPlan& plan) {
  auto pad = [](std::string s, std::size_t width, bool right) {
    if (s.size() >= width) return s;
    return right ? std::string(width - s.size(), ' ') + s : s + std::string(width - s.size(), ' ');
  };
  auto members = [](const ShardPlan::Unit& u) {
    if (u.model_units.empty()) return std::string("-");
    if (u.model_units.size() == 1) return std::to_string(u.model_units.front());
    return std::to_string(u.model_units.front()) + "-" + std::to_string(u.model_units.back());
  };
  std::size_t name_width = 4;
  for (const ShardPlan::Unit& u : plan.units) name_width = std::max(name_width, u.name.size());
  std::string s = "wrapping plan: " + std::to_string(plan.units.size()) + " wrapped units of " +
                  std::to_string(plan.model_units()) + " model units, " + plan.policy + "\n" + plan.strategy +
                  " over " + std::to_string(plan.shards) + " ranks x " + std::to_string(plan.replicas) +
                  (plan.replicas == 1 ? " replica, " : " replicas, ") + std::to_string(plan.element_bytes) +
                  "-byte elements, optimizer state " + std::to_string(plan.state_per_element) + " per parameter\n";
  s += "  unit  model units  " + pad("name", name_width, false) +
       "      params      shard  padding    bytes/rank      gathered\n";
  std::size_t shard = 0, padding = 0;
  for (std::size_t i = 0; i < plan.units.size(); ++i) {
    const ShardPlan::Unit& u = plan.units[i];
    s += pad(std::to_string(i), 6, true) + "  " + pad(members(u), 11, false) + "  " + pad(u.name, name_width, false) +
         pad(std::to_string(u.params), 12, true) + pad(std::to_string(u.shard), 11, true) +
         pad(std::to_string(u.padding), 9, true) + pad(std::to_string(u.bytes_per_rank), 14, true) +
         pad(std::to_string(u.gathered_bytes), 14, true) + "\n";
    shard += u.shard;
    padding += u.padding;
  }
  s += pad("total", 6, true) + "  " + pad("", 11, false) + "  " + pad("", name_width, false) +
       pad(std::to_string(plan.params()), 12, true) + pad(std::to_string(shard), 11, true) +
       pad(std::to_string(padding), 9, true) + pad(std::to_string(plan.bytes_per_rank()), 14, true) +
       pad("max " + std::to_string(plan.max_gathered_bytes()), 14, true) + "\n";
  return s;
}

inline std::ostream& operator<<(std::ostream& os, const ShardPlan& plan) { return os << to_string(plan); }

}  // namespace gradsync
