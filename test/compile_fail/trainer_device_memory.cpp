// ReplicatedTrainer keeps its storage in host vectors: a backend whose
// buffers live in device memory is refused at compile time.
// expect: gradsync::ReplicatedTrainer and gradsync::ShardedTrainer need a backend whose memory space is host memory
#include <gradsync/gradsync.hpp>

#include "device_backend.hpp"

struct Model {
  using value_type = float;
  std::vector<gradsync::UnitSpec> units() const { return {}; }
  void bind(std::span<const gradsync::UnitView<float>>) {}
};

void f(gradsync::Communicator<DeviceBackend>& comm) {
  gradsync::ReplicatedTrainer trainer(comm, Model{}, gradsync::Sgd<float>({.lr = 0.1}));
}
