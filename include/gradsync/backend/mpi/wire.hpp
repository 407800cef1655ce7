#pragma once
/// \file What Mpi ranks tell each other when they fail or leave, as fixed-size bytes.
///
/// Their calls travel as detail::WireCall (core/wire_call.hpp), shared with Nccl.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "gradsync/core/call_info.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/wire_call.hpp"

namespace gradsync::detail::mpi {

/// One rank's word to the others: it failed in call `seq`, or it left (its
/// communicator was destroyed) after `seq` calls; `unwound`: destroyed by an
/// exception on that rank, which is a failure to look for there, not a
/// rank that was done. A rank may send a second one, `released`, once it
/// has taken back its receives (a goodbye is always sent after that).
struct Notice {
  std::uint8_t left = 0;
  FailureKind kind = FailureKind::error;
  std::uint8_t unwound = 0;
  std::uint8_t joined = 0;  ///< the sender had begun call `seq` (sent its part of the agreement)
  std::int32_t rank = 0;
  std::uint64_t seq = 0;
  std::uint64_t nonce = 0;    ///< which communicator it belongs to
  std::int32_t waiting_for = -1;  ///< the peer this rank was waiting for, if one
  /// The sender holds no receive on the data channel and posts none again,
  /// so a send to it still pending will never be read (see Control::may_read).
  std::uint8_t released = 0;
  /// Says only `released`: the sender's failure reaches the peers otherwise
  /// (a disagreement every rank concludes, a goodbye from a rank that left).
  std::uint8_t only_released = 0;
  std::uint8_t pad2[2] = {};
  char text[480] = {};

  std::string_view what() const noexcept { return {text, strnlen(text, sizeof(text))}; }

  /// Rank `rank`'s notice on the communicator of `nonce`; `why` is cut to fit.
  static Notice make(std::int32_t rank, std::uint64_t nonce, bool left, FailureKind kind, std::uint64_t seq,
                     std::string_view why, std::int32_t waiting_for, bool unwound, bool joined, bool released) noexcept {
    Notice n;
    n.left = left ? 1 : 0;
    n.unwound = unwound ? 1 : 0;
    n.joined = joined ? 1 : 0;
    n.released = released ? 1 : 0;
    n.kind = kind;
    n.rank = rank;
    n.seq = seq;
    n.nonce = nonce;
    n.waiting_for = waiting_for;
    std::memcpy(n.text, why.data(), std::min(why.size(), sizeof(n.text) - 1));
    return n;
  }
};

}  // namespace gradsync::detail::mpi
