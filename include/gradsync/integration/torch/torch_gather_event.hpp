#pragma once
/// \file detail::TorchGatherEvent: one gather of a fully_shard unit as TorchGatherScheduler issued it.

#include <cstddef>

namespace gradsync::detail {

/// One gather a step issued, in issue order (TorchGatherScheduler::trace).
struct TorchGatherEvent {
  std::size_t unit = 0;      ///< the unit's index among those wrapped with the communicator
  bool backward = false;     ///< issued in backward (else in forward)
  bool ahead = false;        ///< a prefetch (else the unit's own gather, when it needed it)
  std::size_t gathered = 0;  ///< units max_gathered_units counts, after it was issued
};

}  // namespace gradsync::detail
