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
#include <vector>

#include "gradsync/algorithm/tags.hpp"
#include "gradsync/collective/all_gather.hpp"
#include "gradsync/collective/broadcast.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/train/hash_bytes.hpp"
#include "gradsync/train/model.hpp"

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

/// A number every rank must have been given alike (a trainer's
/// memory_budget, whether it offloads), checked together with the units:
/// it is part of the 8-byte fingerprint, so agreeing ranks pay nothing
/// more for it.
struct AgreedValue {
  /// What it is, e.g. "ShardedTrainerOptions::memory_budget".
  std::string_view name;
  std::uint64_t value = 0;
  /// The sentence that ends the message when the ranks' values differ.
  std::string_view fix;
};

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
/// does not, every rank throws the same InvalidArgument listing each
/// rank's value of each that differs (a unit that differs is named first,
/// as without them).
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
  for (const AgreedValue& a : also) print = hash_bytes(&a.value, sizeof a.value, print);
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
  // values of `also` differ. Each rank's values travel beside its index.
  const std::int64_t at = prints[rank] == prints[ref] ? -1 : first_difference(units, ref_units);
  const std::size_t stride = 1 + also.size();
  std::vector<std::int64_t> sent{at};
  for (const AgreedValue& a : also) sent.push_back(std::bit_cast<std::int64_t>(a.value));
  std::vector<std::int64_t> firsts_and_values(stride * n);
  all_gather(comm, std::span<const std::int64_t>(sent), std::span<std::int64_t>(firsts_and_values));
  std::int64_t d = -1;
  std::size_t other = 0;
  std::vector<std::size_t> differ;
  for (std::size_t r = 0; r < n; ++r) {
    const std::int64_t first = firsts_and_values[stride * r];
    if (first < 0) continue;
    differ.push_back(r);
    if (d < 0 || first < d) {
      d = first;
      other = r;
    }
  }
  if (d < 0) {
    // The tables are equal (or their hashes collided, which cannot be told apart): values differ.
    std::string msg, fixes;
    for (std::size_t k = 0; k < also.size(); ++k) {
      auto value = [&](std::size_t r) { return firsts_and_values[stride * r + 1 + k]; };
      bool same = true;
      for (std::size_t r = 1; r < n; ++r) same = same && value(r) == value(0);
      if (same) continue;
      msg += msg.empty() ? "gradsync: " + std::string(who) + ": ranks were given different " : "; and different ";
      msg += std::string(also[k].name) + ":";
      for (std::size_t r = 0; r < n; ++r) {
        msg += (r ? ", rank " : " rank ") + std::to_string(r) + " " +
               std::to_string(std::bit_cast<std::uint64_t>(value(r)));
      }
      fixes += " " + std::string(also[k].fix);
    }
    if (msg.empty()) return;
    throw InvalidArgument(msg + "." + fixes);
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
  const std::string budget_name = std::string(trainer) + "Options::memory_budget (bytes)";
  std::vector<AgreedValue> agreed{
      {budget_name, memory_budget, "Give every rank the same memory_budget, so that all accept or refuse alike."}};
  agreed.insert(agreed.end(), also.begin(), also.end());
  check_units_agree(comm, describe_units(units), trainer,
                    "Every rank's model must declare the same units, with the same names and shapes, in the same "
                    "order: check what its units() depends on (configuration, rank, world size).",
                    agreed);
}

}  // namespace gradsync::detail
