// GradSync loops over gradients on the host: a backend whose buffers live in
// device memory is refused at compile time, not read on the host at run time.
// expect: gradsync::GradSync needs a backend whose memory space is host memory
#include <gradsync/gradsync.hpp>

#include "device_backend.hpp"

void f(gradsync::Communicator<DeviceBackend>& comm, std::span<float> grads) {
  gradsync::GradSync<DeviceBackend, float> sync(comm, {grads});
  sync.ready(0);
  sync.finish();
}
