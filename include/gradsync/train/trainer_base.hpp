#pragma once
/// \file TrainerBase: what ReplicatedTrainer and ShardedTrainer share above their storage, written once.

#include "gradsync/core/communicator.hpp"
#include "gradsync/train/trainer_requirements.hpp"

namespace gradsync::detail {

/// The types a trainer names and step(), which is forward_backward() then
/// optimizer_step() in both trainers. CRTP: `Derived` provides those two.
///
/// \tparam Derived  ReplicatedTrainer or ShardedTrainer.
/// \tparam M        the model (see gradsync::Model).
/// \tparam Opt      an optimizer on flat spans of M::value_type.
/// \tparam Comm     gradsync::Communicator<Backend>.
/// \tparam Algo     the algorithm of the trainer's collectives.
template <class Derived, class M, class Opt, class Comm, class Algo>
class TrainerBase {
  static_assert(TrainerRequirements<M, Opt>::template communicator<Comm>());
  static_assert(TrainerRequirements<M, Opt>::model_and_optimizer());

 public:
  using model_type = M;
  using optimizer_type = Opt;
  using communicator_type = Comm;
  using backend_type = typename CommunicatorTraits<Comm>::backend;
  using value_type = typename M::value_type;
  using algorithm = Algo;

  /// One training step on this rank's batch: forward_backward(batch), then
  /// optimizer_step() (see each for what the trainer does in it). Returns
  /// this rank's loss on `batch`.
  template <class Batch>
  double step(const Batch& batch) {
    static_assert(TrainerRequirements<M, Opt>::template batch<Batch>());
    Derived& self = static_cast<Derived&>(*this);
    const double loss = self.forward_backward(batch);
    self.optimizer_step();
    return loss;
  }

 protected:
  TrainerBase() = default;
};

}  // namespace gradsync::detail
