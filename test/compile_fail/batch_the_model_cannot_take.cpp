// step() with a batch type the model has no forward_backward for.
// expect: the model has no `double forward_backward(const Batch&, const gradsync::StepContext<compute_type>&)` for this batch type
#include <gradsync/gradsync.hpp>

struct Images {};
struct Tokens {};

struct Model {
  using value_type = float;
  std::vector<gradsync::UnitSpec> units() const { return {}; }
  void bind(std::span<const gradsync::UnitView<float>>) {}
  double forward_backward(const Images&, const gradsync::StepContext<float>&) { return 0; }
};

void f(gradsync::Communicator<gradsync::Threads>& comm) {
  gradsync::ReplicatedTrainer trainer(comm, Model{}, gradsync::Sgd<float>());
#ifdef GRADSYNC_CONTROL
  trainer.step(Images{});
#else
  trainer.step(Tokens{});
#endif
}
