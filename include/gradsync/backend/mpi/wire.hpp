#pragma once
/// \file What Mpi ranks tell each other about their calls, as fixed-size bytes.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "gradsync/core/call_info.hpp"
#include "gradsync/core/error.hpp"

namespace gradsync::detail::mpi {

/// A CallInfo as plain bytes, so that ranks can hash, exchange and compare
/// their calls. Every byte is set (no padding), so equal calls have equal bytes.
struct WireCall {
  std::uint64_t count = 0;
  std::uint64_t chunk_bytes = 0;
  std::uint64_t seq = 0;
  std::int32_t root = 0;
  std::uint8_t collective = 0;
  std::uint8_t type = 0;
  std::uint8_t op = 0;
  std::uint8_t deterministic = 0;
  char algorithm[32] = {};

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

/// One rank's word to the others: it failed in call `seq`, or it left (its
/// communicator was destroyed) after `seq` calls.
struct Notice {
  std::uint8_t left = 0;
  FailureKind kind = FailureKind::error;
  std::uint8_t pad[2] = {};
  std::int32_t rank = 0;
  std::uint64_t seq = 0;
  std::uint64_t nonce = 0;    ///< which communicator it belongs to
  std::int32_t waiting_for = -1;  ///< the peer this rank was waiting for, if one
  std::int32_t pad2 = 0;
  char text[480] = {};

  std::string_view what() const noexcept { return {text, strnlen(text, sizeof(text))}; }
};

}  // namespace gradsync::detail::mpi
