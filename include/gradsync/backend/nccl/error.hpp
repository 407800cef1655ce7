#pragma once
/// \file CUDA and NCCL return codes turned into gradsync::Error.

#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "gradsync/core/error.hpp"

namespace gradsync::detail::nccl {

inline void check_cuda(cudaError_t rc, const char* what) {
  if (rc == cudaSuccess) return;
  throw Error(std::string("gradsync: ") + what + " failed: " + cudaGetErrorName(rc) + ": " + cudaGetErrorString(rc));
}

/// NCCL's own words: the result's name plus its last error message.
inline std::string nccl_message(ncclResult_t rc, ncclComm_t comm = nullptr) {
  std::string s = ncclGetErrorString(rc);
  const char* last = ncclGetLastError(comm);
  if (last && *last) s += std::string(" (") + last + ")";
  return s;
}

inline void check_nccl(ncclResult_t rc, const char* what, ncclComm_t comm = nullptr) {
  if (rc == ncclSuccess) return;
  throw Error(std::string("gradsync: ") + what + " failed: " + nccl_message(rc, comm));
}

/// Makes `device` current for the scope, restoring the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
    device_ = device;
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  int device_ = 0;
};

}  // namespace gradsync::detail::nccl
