#pragma once
/// \file detail::check_units_agree: every rank declared the same units, or
/// every rank throws the same error naming the first unit and rank that differ.
///
/// Ranks whose models split the same number of parameters differently would
/// otherwise average unrelated gradients without a word: the collectives
/// only see equal counts. Trainers call this at construction, before their
/// first broadcast.

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gradsync/algorithm/tags.hpp"
#include "gradsync/collective/all_gather.hpp"
#include "gradsync/collective/broadcast.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/train/common/hash_bytes.hpp"
#include "gradsync/train/common/model.hpp"

namespace gradsync::detail {

/// A shape in words: "[1024 x 10]", "[]" for a scalar.
inline std::string describe_shape(const std::vector<std::size_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? " x " : "") + std::to_string(shape[i]);
  return s + "]";
}

/// A model's unit as ranks must agree on it: its name, then each
/// parameter's and buffer's name and shape in order, e.g.
/// "'fc2' (weight [1024 x 10], bias [10])" or
/// "'bn' (weight [64], bias [64]; buffers running_mean [64], running_var [64])".
inline std::string describe_unit(const UnitSpec& u) {
  std::string s = "'" + u.name + "' (";
  for (std::size_t i = 0; i < u.params.size(); ++i) {
    s += (i ? ", " : "") + u.params[i].name + " " + describe_shape(u.params[i].shape);
  }
  if (!u.buffers.empty()) {
    s += u.params.empty() ? "buffers " : "; buffers ";
    for (std::size_t i = 0; i < u.buffers.size(); ++i) {
      s += (i ? ", " : "") + u.buffers[i].name + " " + describe_shape(u.buffers[i].shape);
    }
  }
  return s + ")";
}

inline std::vector<std::string> describe_units(const std::vector<UnitSpec>& units) {
  std::vector<std::string> out;
  out.reserve(units.size());
  for (const UnitSpec& u : units) out.push_back(describe_unit(u));
  return out;
}

/// A flat unit (GradSync's gradient span) as ranks must agree on it:
/// "'fc2' (10250 elements)", or "10250 elements" without a name.
inline std::string describe_unit(std::string_view name, std::size_t count) {
  const std::string n = std::to_string(count) + " elements";
  return name.empty() ? n : "'" + std::string(name) + "' (" + n + ")";
}

/// Unit descriptions as 64-bit words, the only integer width every backend
/// moves: [units, then per unit its length in bytes and its bytes, 8 a word].
inline std::vector<std::int64_t> pack_units(const std::vector<std::string>& units) {
  std::vector<std::int64_t> w{static_cast<std::int64_t>(units.size())};
  for (const std::string& u : units) {
    w.push_back(static_cast<std::int64_t>(u.size()));
    const std::size_t at = w.size();
    w.resize(at + (u.size() + 7) / 8, 0);
    if (!u.empty()) std::memcpy(w.data() + at, u.data(), u.size());
  }
  return w;
}

/// The inverse of pack_units; throws on words that are not a packed table.
inline std::vector<std::string> unpack_units(std::span<const std::int64_t> w, std::string_view who) {
  auto bad = [&] {
    return InvalidArgument("gradsync: " + std::string(who) + ": a rank's unit table arrived malformed (" +
                           std::to_string(w.size()) + " words)");
  };
  if (w.empty() || w[0] < 0) throw bad();
  std::vector<std::string> units;
  std::size_t at = 1;
  for (std::int64_t u = 0; u < w[0]; ++u) {
    if (at >= w.size() || w[at] < 0) throw bad();
    const auto bytes = static_cast<std::size_t>(w[at++]);
    const std::size_t words = (bytes + 7) / 8;
    if (words > w.size() - at) throw bad();
    std::string s(bytes, '\0');
    if (bytes) std::memcpy(s.data(), w.data() + at, bytes);
    units.push_back(std::move(s));
    at += words;
  }
  return units;
}

/// Index of the first unit where `a` and `b` differ (the shorter one's
/// length if one is the other's prefix), or -1 if they are equal.
inline std::int64_t first_difference(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  const std::size_t n = std::min(a.size(), b.size());
  for (std::size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) return static_cast<std::int64_t>(i);
  }
  return a.size() == b.size() ? -1 : static_cast<std::int64_t>(n);
}

/// A setting every rank must have been given alike (a trainer's strategy,
/// bucket sizes, dtypes, its optimizer's type and hyper-parameters),
/// checked together with the units: it is part of the 8-byte fingerprint,
/// so agreeing ranks pay nothing more for it.
struct AgreedValue {
  /// What it is, e.g. "ShardedTrainerOptions::shard_size", "optimizer lr".
  std::string name;
  /// Its value in words, as the message prints it ("0.1", "FullShard").
  std::string value;
  /// The sentence that ends the message when the ranks' values differ.
  std::string fix;
};

/// "rank 3", "ranks 0-2", "ranks 0, 2, 5-7" (or "world rank 3"...).
inline std::string rank_list(const std::vector<std::size_t>& ranks, std::string_view word = "rank") {
  std::string s(word);
  if (ranks.size() != 1) s += "s";
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    s += (i ? ", " : " ") + std::to_string(ranks[i]);
    if (j > i) s += "-" + std::to_string(ranks[j]);
    i = j + 1;
  }
  return s;
}

/// The message for settings that differ: for each (by name, in the order
/// first met) the ranks that hold each value, e.g. "optimizer lr: 0.4 on
/// world ranks 0-2, 0.1 on world rank 3". `all[r]` is rank r's list of
/// name and value pairs; a name a rank lacks reads "(none)". Where
/// `present` is given, only the ranks it marks are listed (the world ranks
/// of a group). Empty when every rank holds the same values.
inline std::string differing_values(const std::vector<std::vector<std::pair<std::string, std::string>>>& all,
                                    std::string_view rank_word, std::string* fixes = nullptr,
                                    std::span<const AgreedValue> mine = {}, const std::vector<bool>& present = {}) {
  std::vector<std::string> names;
  for (const auto& list : all) {
    for (const auto& [name, value] : list) {
      if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
    }
  }
  std::string msg;
  for (const std::string& name : names) {
    std::vector<std::pair<std::string, std::vector<std::size_t>>> groups;
    for (std::size_t r = 0; r < all.size(); ++r) {
      if (!present.empty() && !present[r]) continue;
      std::string value = "(none)";
      for (const auto& [n, v] : all[r]) {
        if (n == name) value = v;
      }
      auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& x) { return x.first == value; });
      if (g == groups.end()) {
        groups.push_back({value, {r}});
      } else {
        g->second.push_back(r);
      }
    }
    if (groups.size() < 2) continue;
    msg += (msg.empty() ? "" : "; ") + name + ":";
    for (std::size_t i = 0; i < groups.size(); ++i) {
      msg += (i ? ", " : " ") + groups[i].first + " on " + rank_list(groups[i].second, rank_word);
    }
    if (fixes) {
      for (const AgreedValue& a : mine) {
        if (a.name == name && !a.fix.empty() && fixes->find(a.fix) == std::string::npos) *fixes += " " + a.fix;
      }
    }
  }
  return msg;
}

/// Each rank's `texts`, on every rank: their lengths first, then the
/// padded tables (an AllGather moves equal counts).
template <Backend B>
std::vector<std::vector<std::string>> gather_texts(Communicator<B>& comm, const std::vector<std::string>& texts,
                                                   std::string_view who) {
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<std::int64_t> table = pack_units(texts);
  const auto words = static_cast<std::int64_t>(table.size());
  std::vector<std::int64_t> sizes(n);
  const AllGather<Auto> all_gather{};
  all_gather(comm, std::span<const std::int64_t>(&words, 1), std::span<std::int64_t>(sizes));
  const std::int64_t most = *std::max_element(sizes.begin(), sizes.end());
  table.resize(static_cast<std::size_t>(most), 0);
  std::vector<std::int64_t> all(static_cast<std::size_t>(most) * n);
  all_gather(comm, std::span<const std::int64_t>(table), std::span<std::int64_t>(all));
  std::vector<std::vector<std::string>> out;
  for (std::size_t r = 0; r < n; ++r) {
    out.push_back(unpack_units(std::span<const std::int64_t>(all).subspan(r * static_cast<std::size_t>(most),
                                                                          static_cast<std::size_t>(sizes[r])),
                               who));
  }
  return out;
}

/// Collective: checks that every rank of `comm` passed the same `units`
/// (one description per unit, in order; see describe_unit). If not, throws
/// InvalidArgument on every rank, with the same message everywhere: the
/// first unit where a rank differs from the reference (the lowest rank of
/// the most common table), what both declared there, and which ranks
/// differ. `who` names the caller, `fix` is the sentence that ends it.
///
/// Costs one 8-byte AllGather when the ranks agree. Only when they do not,
/// the reference's table is broadcast, each rank's first differing index
/// gathered, and the first differing rank's description of that unit
/// broadcast: every step is a collective every rank takes, and every
/// branch depends only on what all ranks received, so all reach the same
/// verdict and none is left waiting.
///
/// The values in `also` must agree too: if the units agree and a value
/// does not, every rank throws the same InvalidArgument naming each
/// setting that differs and which ranks hold which value (a unit that
/// differs is named first, as without them).
template <Backend B>
void check_units_agree(Communicator<B>& comm, const std::vector<std::string>& units, std::string_view who,
                       std::string_view fix, std::span<const AgreedValue> also = {}) {
  const int world = comm.size();
  if (world == 1) return;
  const auto n = static_cast<std::size_t>(world);
  const auto rank = static_cast<std::size_t>(comm.rank());
  const AllGather<Auto> all_gather{};
  const Broadcast<Auto> broadcast{};

  const std::vector<std::int64_t> table = pack_units(units);
  std::uint64_t print = hash_bytes(table.data(), table.size() * sizeof(std::int64_t), 0x756e697473616772ull);
  for (const AgreedValue& a : also) {
    print = hash_bytes(a.name.data(), a.name.size(), print);
    print = hash_bytes(a.value.data(), a.value.size(), hash_bytes("=", 1, print));
  }
  const std::int64_t mine = std::bit_cast<std::int64_t>(print);
  std::vector<std::int64_t> prints(n);
  all_gather(comm, std::span<const std::int64_t>(&mine, 1), std::span<std::int64_t>(prints));
  if (std::all_of(prints.begin(), prints.end(), [&](std::int64_t p) { return p == prints[0]; })) return;

  // The reference: the lowest rank of the most common table, so a lone
  // rank that differs is the one named, even when it is rank 0.
  std::map<std::int64_t, std::size_t> votes;
  for (std::int64_t p : prints) ++votes[p];
  std::size_t ref = 0;
  for (std::size_t r = 1; r < n; ++r) {
    if (votes[prints[r]] > votes[prints[ref]]) ref = r;
  }

  std::int64_t words = static_cast<std::int64_t>(table.size());
  broadcast(comm, std::span<std::int64_t>(&words, 1), static_cast<int>(ref));
  std::vector<std::int64_t> ref_table(static_cast<std::size_t>(words));
  if (rank == ref) ref_table = table;
  broadcast(comm, std::span<std::int64_t>(ref_table), static_cast<int>(ref));
  const std::vector<std::string> ref_units = unpack_units(ref_table, who);

  // Equal fingerprints are taken as equal tables; a different one has a
  // first difference (the unit count is part of the table) unless only
  // values of `also` differ.
  const std::int64_t at = prints[rank] == prints[ref] ? -1 : first_difference(units, ref_units);
  std::vector<std::int64_t> firsts(n);
  all_gather(comm, std::span<const std::int64_t>(&at, 1), std::span<std::int64_t>(firsts));
  std::int64_t d = -1;
  std::size_t other = 0;
  std::vector<std::size_t> differ;
  for (std::size_t r = 0; r < n; ++r) {
    const std::int64_t first = firsts[r];
    if (first < 0) continue;
    differ.push_back(r);
    if (d < 0 || first < d) {
      d = first;
      other = r;
    }
  }
  if (d < 0) {
    // The tables are equal (or their hashes collided, which cannot be told
    // apart): settings differ. Every rank's settings travel, so every rank
    // writes the same message.
    std::vector<std::string> texts;
    for (const AgreedValue& a : also) {
      texts.push_back(a.name);
      texts.push_back(a.value);
    }
    const std::vector<std::vector<std::string>> all = gather_texts(comm, texts, who);
    // Listed by world rank, the numbers a user launched: on a group made by
    // split, its rank r is the world's rank world_rank(r).
    const detail::RankNames& names = detail::rank_names(comm);
    bool by_world = true;
    for (std::size_t r = 0; r < n; ++r) by_world = by_world && names.world_rank(static_cast<int>(r)) >= 0;
    std::vector<std::vector<std::pair<std::string, std::string>>> lists;
    std::vector<std::size_t> order(n);
    for (std::size_t r = 0; r < n; ++r) {
      order[r] = by_world ? static_cast<std::size_t>(names.world_rank(static_cast<int>(r))) : r;
    }
    const std::size_t slots = by_world ? *std::max_element(order.begin(), order.end()) + 1 : n;
    std::vector<bool> present(slots, false);
    lists.resize(slots);
    for (std::size_t r = 0; r < n; ++r) {
      present[order[r]] = true;
      for (std::size_t i = 0; i + 1 < all[r].size(); i += 2) lists[order[r]].push_back({all[r][i], all[r][i + 1]});
    }
    std::string fixes;
    const std::string msg = differing_values(lists, by_world ? "world rank" : "rank", &fixes, also, present);
    if (msg.empty()) return;
    throw InvalidArgument("gradsync: " + std::string(who) + ": ranks were given different settings: " + msg + "." +
                          fixes);
  }
  const auto du = static_cast<std::size_t>(d);

  // What `other` declared at unit d (nothing, past its last unit), and how many units.
  std::vector<std::int64_t> head{0, static_cast<std::int64_t>(units.size())};
  std::vector<std::int64_t> body;
  if (rank == other) {
    body = pack_units(du < units.size() ? std::vector<std::string>{units[du]} : std::vector<std::string>{});
    head[0] = static_cast<std::int64_t>(body.size());
  }
  broadcast(comm, std::span<std::int64_t>(head), static_cast<int>(other));
  body.resize(static_cast<std::size_t>(head[0]));
  broadcast(comm, std::span<std::int64_t>(body), static_cast<int>(other));
  const std::vector<std::string> other_unit = unpack_units(body, who);
  const auto other_count = static_cast<std::size_t>(head[1]);

  const std::string r0 = "rank " + std::to_string(ref);
  const std::string r1 = "rank " + std::to_string(other);
  const std::string u = "unit " + std::to_string(du);
  std::string msg = "gradsync: " + std::string(who) + ": ranks declared different units: ";
  auto in_all = [](std::size_t k) { return std::to_string(k) + (k == 1 ? " unit in all" : " units in all"); };
  if (du >= ref_units.size()) {
    msg += r0 + " declared no " + u + " (" + in_all(ref_units.size()) + "), " + r1 + " declared " + u + " as " +
           (other_unit.empty() ? std::string("?") : other_unit[0]) + " (" + in_all(other_count) + ")";
  } else if (other_unit.empty()) {
    msg += r0 + " declared " + u + " as " + ref_units[du] + " (" + in_all(ref_units.size()) + "), " + r1 +
           " declared no " + u + " (" + in_all(other_count) + ")";
  } else {
    msg += r0 + " declared " + u + " as " + ref_units[du] + ", " + r1 + " declared it as " + other_unit[0];
    if (other_count != ref_units.size()) {
      msg += " (" + in_all(ref_units.size()) + " on " + r0 + ", " + std::to_string(other_count) + " on " + r1 + ")";
    }
  }
  if (differ.size() > 1) {
    msg += ". Ranks that differ from " + r0 + ":";
    for (std::size_t i = 0; i < differ.size(); ++i) msg += (i ? ", " : " ") + std::to_string(differ[i]);
  }
  msg += ". ";
  msg += fix;
  throw InvalidArgument(msg);
}

/// A trainer's first collective, before it allocates or broadcasts: every
/// rank's model declared the same units (the same total split into other
/// units or shapes would train on unrelated gradients), and every rank was
/// given the same `memory_budget`, which each rank checks on its own.
/// `trainer` is the class's name ("ShardedTrainer"); its options struct is
/// that name + "Options".
template <Backend B>
void check_trainer_units(Communicator<B>& comm, const std::vector<UnitSpec>& units, std::string_view trainer,
                         std::uint64_t memory_budget, std::span<const AgreedValue> also = {}) {
  std::vector<AgreedValue> agreed{{std::string(trainer) + "Options::memory_budget (bytes)",
                                   std::to_string(memory_budget),
                                   "Give every rank the same memory_budget, so that all accept or refuse alike."}};
  agreed.insert(agreed.end(), also.begin(), also.end());
  check_units_agree(comm, describe_units(units), trainer,
                    "Every rank's model must declare the same units, with the same names and shapes, in the same "
                    "order: check what its units() depends on (configuration, rank, world size).",
                    agreed);
}

}  // namespace gradsync::detail
