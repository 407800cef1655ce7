#pragma once
/// \file detail::endpoint_of(comm): a communicator's backend endpoint, for
/// the code inside gradsync that drives it directly.
///
/// The user's Communicator hands out no implementation types. What needs the
/// endpoint itself (the algorithms' CallView, Nccl's stream and event
/// helpers, bootstrap over Mpi, tests and benchmarks) reaches it here.

#include "gradsync/core/backend.hpp"
#include "gradsync/core/communicator.hpp"

namespace gradsync::detail {

/// The one friend of Communicator that reads its endpoint.
struct EndpointAccess {
  template <Backend B>
  static typename B::Endpoint& get(Communicator<B>& comm) noexcept {
    return comm.ep_;
  }
  template <Backend B>
  static const typename B::Endpoint& get(const Communicator<B>& comm) noexcept {
    return comm.ep_;
  }
};

/// `comm`'s endpoint (B::Endpoint): not part of the public API.
template <Backend B>
typename B::Endpoint& endpoint_of(Communicator<B>& comm) noexcept {
  return EndpointAccess::get(comm);
}
template <Backend B>
const typename B::Endpoint& endpoint_of(const Communicator<B>& comm) noexcept {
  return EndpointAccess::get(comm);
}

}  // namespace gradsync::detail
