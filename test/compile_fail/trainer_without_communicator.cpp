// The third template argument is the communicator type, not the backend.
// expect: the third parameter must be gradsync::Communicator<Backend>
#include <gradsync/gradsync.hpp>

struct Model {
  using value_type = float;
  std::vector<gradsync::UnitSpec> units() const { return {}; }
  void bind(std::span<const gradsync::UnitView<float>>) {}
};

#ifdef GRADSYNC_CONTROL
using Trainer = gradsync::ReplicatedTrainer<Model, gradsync::Sgd<float>, gradsync::Communicator<gradsync::Threads>>;
#else
using Trainer = gradsync::ReplicatedTrainer<Model, gradsync::Sgd<float>, gradsync::Threads>;
#endif
Trainer* make();
void f() { (void)sizeof(Trainer); }
