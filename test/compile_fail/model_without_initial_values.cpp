// A model that cannot write its initial values into the trainer's storage
// cannot be trained. The control has init_unit alone, which is enough.
// expect: the model must write its initial values with `void init_unit(std::size_t, const gradsync::UnitView<value_type>&)` or `void bind(std::span<const gradsync::UnitView<value_type>>)`
#include <gradsync/gradsync.hpp>

struct Model {
  using value_type = float;
  std::vector<gradsync::UnitSpec> units() const { return {}; }
#ifdef GRADSYNC_CONTROL
  void init_unit(std::size_t, const gradsync::UnitView<float>&) {}
#else
  void bind(std::vector<float>&) {}
#endif
};

void f(gradsync::Communicator<gradsync::Threads>& comm) {
  gradsync::ReplicatedTrainer trainer(comm, Model{}, gradsync::Sgd<float>());
}
