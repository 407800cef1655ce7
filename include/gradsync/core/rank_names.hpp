#pragma once
/// \file RankNames: how error messages name a communicator's ranks, so that a
/// failure inside a group made by Communicator::split names the rank a user
/// launched, not only its number within the group.

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace gradsync::detail {

/// Names the ranks of one communicator in error messages. A communicator
/// not made by split (the world) names "rank 3"; one made by split names the
/// rank in the root communicator first, then the rank within the group and
/// the group: "world rank 5 (rank 1 of shard group 2)". Nothing here runs on
/// a call's success path: an endpoint keeps one (a null pointer for the
/// world) and builds words only when a message is made.
class RankNames {
 public:
  /// The world: ranks are named by their own number.
  RankNames() = default;

  /// The world's names, for code that has no endpoint to ask.
  static const RankNames& world() noexcept {
    static const RankNames names;
    return names;
  }

  /// The names of a group split from the communicator these names serve:
  /// its rank i is this communicator's rank `members[i]`. `name` names the
  /// group ("shard group 2"); empty, it is named after `color` (and after
  /// this group, when this one was split too).
  RankNames split(std::span<const int> members, int color, std::string_view name) const {
    Data d;
    d.world.reserve(members.size());
    for (const int m : members) d.world.push_back(world_rank(m));
    d.group = group_name(color, name);
    return RankNames(std::make_shared<const Data>(std::move(d)));
  }

  /// A group whose members' world ranks are not known (yet): its ranks are
  /// named within the group alone ("rank 1 of shard group 2").
  RankNames split_unmapped(int color, std::string_view name) const {
    Data d;
    d.group = group_name(color, name);
    return RankNames(std::make_shared<const Data>(std::move(d)));
  }

  /// Rank `rank`'s number in the root communicator (-1 where not known).
  int world_rank(int rank) const noexcept {
    if (!d_) return rank;
    if (rank < 0 || static_cast<std::size_t>(rank) >= d_->world.size()) return -1;
    return d_->world[static_cast<std::size_t>(rank)];
  }

  /// The group's name: "world" for a communicator not made by split.
  std::string group() const { return d_ ? d_->group : std::string("world"); }

  /// "rank 3" on the world; "world rank 5 (rank 1 of shard group 2)" on a
  /// group made by split.
  std::string who(int rank) const {
    std::string r = "rank " + std::to_string(rank);
    if (!d_) return r;
    const int w = world_rank(rank);
    if (w < 0) return r + " of " + d_->group;
    return "world rank " + std::to_string(w) + " (" + r + " of " + d_->group + ")";
  }

  /// What rank `rank`'s failure was, as part of a sentence, from its own
  /// message `what`: that message itself when it starts by naming the rank
  /// ("world rank 5 (…) timed out …"), else "world rank 5 (…) failed: <what>".
  std::string failed(int rank, std::string_view what) const {
    if (what.starts_with("gradsync: ")) what.remove_prefix(10);
    const std::string me = who(rank);
    if (what.starts_with(me + " ") || what.starts_with(me + ":")) return std::string(what);
    return me + " failed: " + std::string(what);
  }

  /// Several ranks in one phrase: "rank 2, 3" on the world, each named in
  /// full on a split group ("world rank 4 (rank 0 of …), world rank 6 (…)").
  std::string list(std::span<const int> ranks) const {
    std::string s = d_ ? std::string() : std::string("rank ");
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      if (i) s += ", ";
      s += d_ ? who(ranks[i]) : std::to_string(ranks[i]);
    }
    return s;
  }

 private:
  struct Data {
    std::vector<int> world;  ///< per rank of the group, its rank in the root communicator
    std::string group;
  };

  explicit RankNames(std::shared_ptr<const Data> d) noexcept : d_(std::move(d)) {}

  std::string group_name(int color, std::string_view name) const {
    if (!name.empty()) return std::string(name);
    std::string g = "group of color " + std::to_string(color);
    if (d_) g += " in " + d_->group;
    return g;
  }

  std::shared_ptr<const Data> d_;
};

}  // namespace gradsync::detail
