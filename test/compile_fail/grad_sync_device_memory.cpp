// GradSync loops over gradients on the host: a backend whose buffers live in
// device memory is refused at compile time, not read on the host at run time.
// expect: gradsync::GradSync needs a backend whose memory space is host memory
#include <gradsync/gradsync.hpp>

// The Threads transport declared as a device-memory backend: CUDA does not
// run here, and only the declared memory space matters.
struct DeviceBackend {
  using Endpoint = gradsync::Threads::Endpoint;
  static constexpr gradsync::CostModel cost_model = gradsync::Threads::cost_model;
#ifdef GRADSYNC_CONTROL
  static constexpr gradsync::Capabilities capabilities{.memory_space = gradsync::MemorySpace::host};
#else
  static constexpr gradsync::Capabilities capabilities{.memory_space = gradsync::MemorySpace::device};
#endif
};

void f(gradsync::Communicator<DeviceBackend>& comm, std::span<float> grads) {
  gradsync::GradSync<DeviceBackend, float> sync(comm, {grads});
  sync.ready(0);
  sync.finish();
}
