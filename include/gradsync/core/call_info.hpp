#pragma once
/// \file What one collective call is, as every rank must agree on it.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "gradsync/core/call_label.hpp"
#include "gradsync/core/collective.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/types.hpp"
#include "gradsync/core/visit.hpp"

namespace gradsync::detail {

/// A collective call's identity. Ranks compare these before trusting each
/// other's buffers, and error messages print them.
struct CallInfo {
  Collective collective = Collective::barrier;
  std::string_view algorithm = "";
  DataType type = DataType::float32;
  OpKind op = OpKind::sum;
  std::size_t count = 0;  ///< the count every rank passes (per-rank block for gather/scatter)
  int root = -1;
  bool deterministic = false;
  std::size_t chunk_bytes = 0;  ///< the pipelining chunk the algorithm cuts messages into
  std::uint64_t seq = 0;        ///< this communicator's call number, from 1
  CallLabel label{};            ///< what the call moves, in the caller's terms

  /// Equal calls: every field ranks compare (a label's names are each rank's own).
  friend bool operator==(const CallInfo& a, const CallInfo& b) noexcept {
    return a.collective == b.collective && a.algorithm == b.algorithm && a.type == b.type && a.op == b.op &&
           a.count == b.count && a.root == b.root && a.deterministic == b.deterministic &&
           a.chunk_bytes == b.chunk_bytes && a.seq == b.seq && a.label.same_as(b.label);
  }
};

/// The op's own name (Sum::name, ...); "?" for a value no op has.
constexpr std::string_view name(OpKind k) noexcept {
  return k <= OpKind::prod ? visit(k, []<class Op>(Op) { return Op::name; }) : std::string_view("?");
}

/// "AllReduce #3 (ring, 1000 x float, sum)", and its label put in words by
/// `names` ("AllReduce #3 (ring, 1000 x float, sum; step 2, bucket 0 …)"). A
/// peer's call is described with this rank's names: the peer's may be gone.
inline std::string describe(const CallInfo& c, const LabelNames* names) {
  std::string s(name(c.collective));
  // seq 0: a call not numbered yet (refused before it started).
  if (c.seq) s += " #" + std::to_string(c.seq);
  // Ranks pass split different colors and keys; only the call is shared.
  if (c.collective == Collective::barrier || c.collective == Collective::split) return s;
  s += " (";
  s += c.algorithm;
  s += ", " + std::to_string(c.count) + " x ";
  s += name(c.type);
  if (c.collective == Collective::all_reduce || c.collective == Collective::reduce_scatter) {
    s += ", ";
    s += name(c.op);
  }
  if (c.collective == Collective::broadcast) s += ", root " + std::to_string(c.root);
  if (c.deterministic) s += ", deterministic";
  // Only a chunk size someone chose is worth a word in a message.
  if (c.chunk_bytes && c.chunk_bytes != default_chunk_bytes) s += ", chunks of " + std::to_string(c.chunk_bytes) + " B";
  if (!c.label.empty()) s += "; " + c.label.describe(names);
  s += ")";
  return s;
}

/// A call of this rank's, described with its own label names.
inline std::string describe(const CallInfo& c) { return describe(c, c.label.names); }

}  // namespace gradsync::detail
