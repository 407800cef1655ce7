// A model that does not declare its parameters cannot be trained.
// expect: the model must declare its parameters with `std::vector<gradsync::UnitSpec> units() const`
#include <gradsync/gradsync.hpp>

struct Model {
  using value_type = float;
#ifdef GRADSYNC_CONTROL
  std::vector<gradsync::UnitSpec> units() const { return {}; }
#endif
  void bind(std::span<const gradsync::UnitView<float>>) {}
};

void f(gradsync::Communicator<gradsync::Threads>& comm) {
  gradsync::ReplicatedTrainer trainer(comm, Model{}, gradsync::Sgd<float>());
}
