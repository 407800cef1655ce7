#pragma once
/// \file detail::NonfiniteVerdict: whether a step went non-finite on any
/// rank, and where first, agreed by every rank in one small all-reduce.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>

#include "gradsync/collective/all_reduce.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/options.hpp"

namespace gradsync::detail {

/// One step's verdict on every rank. A reduce-scatter leaves each rank only
/// its shard of the averaged gradient, and a loss is each rank's own, so a
/// rank alone cannot know whether the step went non-finite elsewhere: the
/// minimum over ranks of (first non-finite unit, rank with a non-finite
/// loss) gives every rank the same answer, naming the same unit and rank.
struct NonfiniteVerdict {
  static constexpr std::int64_t none = std::numeric_limits<std::int64_t>::max();
  /// The first unit (lowest index) whose averaged gradient holds a NaN or Inf on some rank.
  std::int64_t unit = none;
  /// The lowest rank whose loss was NaN or Inf.
  std::int64_t loss_rank = none;

  bool finite() const noexcept { return unit == none && loss_rank == none; }

  /// This rank's findings (`unit`: its first non-finite unit, if any;
  /// `loss_finite`: its loss), combined over `comm` by an AllReduce Min of
  /// two integers carrying `opts` (the trainer's label for the step).
  template <class Algo, class Comm>
  static NonfiniteVerdict agree(Comm& comm, const Options& opts, std::optional<std::size_t> unit, bool loss_finite) {
    std::int64_t v[2] = {unit ? static_cast<std::int64_t>(*unit) : none, loss_finite ? none : comm.rank()};
    if (comm.size() > 1) AllReduce<Algo>{opts}(comm, std::span<std::int64_t>(v), Min{});
    return {v[0], v[1]};
  }

  /// The verdict in words; `unit_name(u)` names unit u ("unit 3 ('fc2')").
  template <class Name>
  std::string describe(Name&& unit_name) const {
    std::string s;
    if (unit != none) s = "the averaged gradient of " + unit_name(static_cast<std::size_t>(unit)) + " holds a NaN or an Inf";
    if (loss_rank != none) {
      s += (s.empty() ? "" : ", and ") + std::string("rank ") + std::to_string(loss_rank) + "'s loss is a NaN or an Inf";
    }
    return s;
  }
};

}  // namespace gradsync::detail
