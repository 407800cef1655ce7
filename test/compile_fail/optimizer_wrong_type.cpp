// An optimizer for double cannot step a float model's flat storage.
// expect: the optimizer must provide `step(std::span<T> params, std::span<const T> grads)`
#include <gradsync/gradsync.hpp>

struct Model {
  using value_type = float;
  std::vector<gradsync::UnitSpec> units() const { return {}; }
  void bind(std::span<const gradsync::UnitView<float>>) {}
};

#ifdef GRADSYNC_CONTROL
using Opt = gradsync::Adam<float>;
#else
using Opt = gradsync::Adam<double>;
#endif

void f(gradsync::Communicator<gradsync::Threads>& comm) {
  gradsync::ReplicatedTrainer trainer(comm, Model{}, Opt());
}
