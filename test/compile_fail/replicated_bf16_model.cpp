// ReplicatedTrainer lends the model its own value_type storage, so a model
// that computes in bfloat16 is refused with one sentence that says where it
// trains instead. The control computes in its value_type.
// expect: ReplicatedTrainer lends the model its own value_type storage, so the model must compute in its value_type
#include <gradsync/gradsync.hpp>

struct Batch {};

struct Model {
  using value_type = float;
#ifdef GRADSYNC_CONTROL
  using compute_type = float;
#else
  using compute_type = gradsync::bfloat16;
#endif
  std::vector<gradsync::UnitSpec> units() const { return {{"u", {{"w", {4}}}, {}}}; }
  void init_unit(std::size_t, const gradsync::UnitView<float>&) {}
  double forward_backward(const Batch&, const gradsync::StepContext<compute_type>&) { return 0; }
};

void f(gradsync::Communicator<gradsync::Threads>& comm) {
  gradsync::ReplicatedTrainer trainer(comm, Model{}, gradsync::Sgd<float>());
  trainer.step(Batch{});
}
