#pragma once
// The Threads transport declared as a device-memory backend, for the cases
// that host-only code refuses it: CUDA does not run here, and only the
// declared memory space matters. Under GRADSYNC_CONTROL it declares host
// memory, so the case compiles.
#include <gradsync/gradsync.hpp>

struct DeviceBackend {
  using Endpoint = gradsync::Threads::Endpoint;
  static constexpr gradsync::CostModel cost_model = gradsync::Threads::cost_model;
#ifdef GRADSYNC_CONTROL
  static constexpr gradsync::Capabilities capabilities{.memory_space = gradsync::MemorySpace::host};
#else
  static constexpr gradsync::Capabilities capabilities{.memory_space = gradsync::MemorySpace::device};
#endif
};
