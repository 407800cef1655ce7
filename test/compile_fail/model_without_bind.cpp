// A model that cannot take views of the trainer's storage cannot be trained.
// expect: the model must accept its storage with `void bind(std::span<const gradsync::UnitView<value_type>>)`
#include <gradsync/gradsync.hpp>

struct Model {
  using value_type = float;
  std::vector<gradsync::UnitSpec> units() const { return {}; }
#ifdef GRADSYNC_CONTROL
  void bind(std::span<const gradsync::UnitView<float>>) {}
#else
  void bind(std::vector<float>&) {}
#endif
};

void f(gradsync::Communicator<gradsync::Threads>& comm) {
  gradsync::ReplicatedTrainer trainer(comm, Model{}, gradsync::Sgd<float>());
}
