// ReplicatedTrainer keeps its storage in host vectors: a backend whose
// buffers live in device memory is refused at compile time.
// expect: gradsync::ReplicatedTrainer needs a backend whose memory space is host memory
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

struct Model {
  using value_type = float;
  std::vector<gradsync::UnitSpec> units() const { return {}; }
  void bind(std::span<const gradsync::UnitView<float>>) {}
};

void f(gradsync::Communicator<DeviceBackend>& comm) {
  gradsync::ReplicatedTrainer trainer(comm, Model{}, gradsync::Sgd<float>({.lr = 0.1}));
}
