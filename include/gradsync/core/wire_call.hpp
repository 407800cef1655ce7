#pragma once
/// \file WireCall: a call's identity as 64 plain bytes, which ranks in other
/// processes can exchange, hash and compare (Mpi and Nccl call agreement).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "gradsync/core/call_info.hpp"
#include "gradsync/core/rank_names.hpp"

namespace gradsync::detail {

/// A CallInfo as plain bytes, so that ranks can hash, exchange and compare
/// their calls. Every byte is set (no padding), so equal calls have equal bytes.
struct WireCall {
  std::uint64_t count = 0;
  std::uint64_t chunk_bytes = 0;
  std::uint64_t seq = 0;
  std::uint64_t label_id = 0;
  std::uint64_t label_setting = 0;
  std::int32_t root = 0;
  std::uint8_t collective = 0;
  std::uint8_t type = 0;
  std::uint8_t op = 0;
  std::uint8_t deterministic = 0;
  /// The algorithm's name ("ring", "native"): the longest is 6 characters.
  char algorithm[16] = {};

  static WireCall of(const CallInfo& c) noexcept {
    WireCall w;
    w.count = c.count;
    w.chunk_bytes = c.chunk_bytes;
    w.seq = c.seq;
    w.root = c.root;
    w.collective = static_cast<std::uint8_t>(c.collective);
    w.type = static_cast<std::uint8_t>(c.type);
    w.op = static_cast<std::uint8_t>(c.op);
    w.deterministic = c.deterministic ? 1 : 0;
    w.label_id = c.label.id;
    w.label_setting = c.label.setting;
    // The name's content, not its address: each process has its own copy.
    std::memcpy(w.algorithm, c.algorithm.data(), std::min(c.algorithm.size(), sizeof(w.algorithm) - 1));
    return w;
  }

  /// The call back; its algorithm name views this object.
  CallInfo call() const noexcept {
    CallInfo c;
    c.collective = static_cast<Collective>(collective);
    c.algorithm = std::string_view(algorithm, strnlen(algorithm, sizeof(algorithm)));
    c.type = static_cast<DataType>(type);
    c.op = static_cast<OpKind>(op);
    c.count = count;
    c.root = root;
    c.deterministic = deterministic != 0;
    c.chunk_bytes = chunk_bytes;
    c.seq = seq;
    c.label.id = label_id;
    c.label.setting = label_setting;
    return c;
  }

  /// What ranks compare on the fast path: the eight words mixed in turn,
  /// a word at a time rather than FNV's byte at a time (8 multiplies, not
  /// 64: a tiny call feels the difference). Each step is a bijection of the
  /// state, so calls that differ in one word always hash apart.
  std::uint64_t hash() const noexcept {
    std::uint64_t words[sizeof(WireCall) / 8];
    std::memcpy(words, this, sizeof(words));
    std::uint64_t h = 0xcbf29ce484222325ull;
    for (const std::uint64_t w : words) {
      h = (h ^ w) * 0x9e3779b97f4a7c15ull;
      h ^= h >> 29;
    }
    return h;
  }

  friend bool operator==(const WireCall& a, const WireCall& b) noexcept {
    return std::memcmp(&a, &b, sizeof(WireCall)) == 0;
  }
};
static_assert(sizeof(WireCall) == 64, "WireCall must have no padding: ranks compare its bytes");

/// The verdict on calls every rank gathered: nothing when all equal `mine`,
/// otherwise the message every rank throws as InvalidArgument, naming this
/// rank's call and the first rank whose call differs from it: the ranks as
/// `ranks` names them (world ranks on a communicator made by split), their
/// labels in words through this rank's `names`.
inline std::optional<std::string> disagreement(int rank, const WireCall& mine, std::span<const WireCall> all,
                                               const RankNames& ranks, const LabelNames* names = nullptr) {
  for (std::size_t q = 0; q < all.size(); ++q) {
    if (all[q] == mine) continue;
    return "gradsync: ranks disagree on a collective: " + ranks.who(rank) + " called " + describe(mine.call(), names) +
           ", " + ranks.who(static_cast<int>(q)) + " called " + describe(all[q].call(), names);
  }
  return std::nullopt;
}

}  // namespace gradsync::detail
