#pragma once
/// \file detail::TorchGradSyncs: which gradient synchronisers DistributedDataParallel may hold on a communicator.

#include <memory>
#include <variant>

#include "gradsync/core/backend_traits.hpp"
#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/float16.hpp"
#include "gradsync/integration/torch/device_communicator.hpp"
#include "gradsync/integration/torch/device_grad_sync.hpp"
#include "gradsync/train/ddp/grad_sync.hpp"

namespace gradsync::detail {

/// The gradient synchronisers DistributedDataParallel may hold: one
/// GradSync per floating dtype on a host communicator, a DeviceGradSync on
/// a DeviceCommunicator.
template <class Comm, class Algo>
struct TorchGradSyncs;
template <class B, class Algo>
struct TorchGradSyncs<Communicator<B>, Algo> {
  using type = std::variant<std::unique_ptr<GradSync<B, float, Algo>>, std::unique_ptr<GradSync<B, double, Algo>>,
                            std::unique_ptr<GradSync<B, bfloat16, Algo>>, std::unique_ptr<GradSync<B, float16, Algo>>>;
};
template <class Algo>
struct TorchGradSyncs<DeviceCommunicator, Algo> {
  using type = std::variant<std::unique_ptr<DeviceGradSync>>;
};

template <class Comm>
consteval bool host_communicator() {
  if constexpr (CommunicatorTraits<Comm>::value) {
    return backend_traits<typename CommunicatorTraits<Comm>::backend>::host_memory;
  } else {
    return false;
  }
}

}  // namespace gradsync::detail
