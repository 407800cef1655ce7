#pragma once
/// \file Bootstrapping a Nccl communicator over MPI.

#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <string>

#include "gradsync/backend/mpi.hpp"
#include "gradsync/backend/nccl.hpp"
#include "gradsync/core/endpoint_of.hpp"

namespace gradsync {

/// One rank per MPI process: rank 0's ncclUniqueId is broadcast over `mpi`,
/// and the GPU is the node-local rank modulo the GPUs this process sees.
inline Communicator<Nccl> nccl_communicator(Communicator<Mpi>& mpi, NcclOptions options = {}) {
  int devices = 0;
  detail::nccl::check_cuda(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  if (devices < 1) throw Error("gradsync: " + detail::who(mpi) + " sees no CUDA device");
  ncclUniqueId id{};
  if (mpi.rank() == 0) id = nccl_unique_id();
  if (MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, detail::endpoint_of(mpi).mpi_comm()) != MPI_SUCCESS) {
    throw Error("gradsync: " + detail::who(mpi) + ": MPI_Bcast of the NCCL unique id failed");
  }
  return nccl_communicator(id, mpi.rank(), mpi.size(), mpi.local_rank() % devices, options);
}

}  // namespace gradsync
