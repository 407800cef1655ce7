#pragma once
/// \file The Nccl backend: one rank per GPU, stream-ordered, over NCCL.
///
/// Opt-in: include this header from a CUDA translation unit (.cu, built by
/// nvcc with -std=c++20 --expt-relaxed-constexpr) and link NCCL and the
/// CUDA runtime. Collectives take spans of device memory, are enqueued on
/// the communicator's stream and return at once; `gradsync::synchronize`,
/// `gradsync::record` (an event) and barrier() are the host waits, each
/// with the communicator's deadline. For MPI bootstrap also include
/// gradsync/backend/nccl/from_mpi.hpp.
///
///   auto comm = gradsync::nccl_communicator(id, rank, size, device);
///   gradsync::AllReduce<gradsync::Native>{}(comm, grads);      // ncclAllReduce
///   gradsync::AllReduce<gradsync::Ring>{}(gradsync::on(comm, s).comm(), grads);
///   gradsync::synchronize(comm);

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gradsync/backend/nccl/endpoint.hpp"
#include "gradsync/backend/nccl/error.hpp"
#include "gradsync/backend/nccl/nccl_options.hpp"
#include "gradsync/core/backend_traits.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/cost_model.hpp"
#include "gradsync/core/endpoint_of.hpp"
#include "gradsync/core/error.hpp"

namespace gradsync {

/// Backend policy: one rank per GPU; point-to-point is ncclSend/ncclRecv.
struct Nccl {
  using Endpoint = detail::nccl::Endpoint;

  /// Device memory of one GPU, stream-ordered; Native is NCCL's own
  /// collective, whose order is NCCL's business; split by ncclCommSplit.
  static constexpr Capabilities capabilities{
      .memory_space = MemorySpace::device,
      .native_collectives = true,
      .native_rank_ordered = false,
      .split = true,
  };

  /// Guesses until measured: NVLink-class links (~150 GB/s per direction,
  /// ~8 us per p2p batch) and a reduce kernel near HBM speed (~1.5 TB/s
  /// counting read+write). native_alpha below alpha makes Auto pick NCCL's
  /// own collectives, which on GPUs is what one wants. Fit them with
  /// `tools/gpu-check` (nccl_all_reduce_perf --backend nccl --algo all).
  static constexpr CostModel cost_model{
      .alpha = 8.0e-6,
      .beta = 1.0 / 150.0e9,
      .gamma = 1.0 / 1500.0e9,
      .native_alpha = 4.0e-6,
      .chunk_bytes = std::size_t{1} << 22,
  };
};

namespace detail::nccl {

/// The communicator that carries the call agreement: `comm`'s ranks, split
/// off once (nullptr when calls are not checked or there is nobody to
/// disagree with). Collective over `comm`'s ranks; several communicators
/// driven by one thread must be split inside one NCCL group.
inline ncclComm_t control_for(ncclComm_t comm, int rank, int size, const NcclOptions& options) {
  if (!options.check_calls || size < 2) return nullptr;
  ncclComm_t control = nullptr;
  check_nccl(ncclCommSplit(comm, 0, rank, &control, nullptr), "ncclCommSplit (the call-agreement communicator)", comm);
  return control;
}

}  // namespace detail::nccl

/// A communicator from a unique id every rank shares (rank 0 calls
/// ncclGetUniqueId and sends it by its own means), for users with their own
/// launcher. `device` is the GPU this rank drives.
inline Communicator<Nccl> nccl_communicator(const ncclUniqueId& id, int rank, int size, int device,
                                            NcclOptions options = {}) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw InvalidArgument("gradsync: nccl_communicator expects 0 <= rank < size, got rank " + std::to_string(rank) +
                          " and size " + std::to_string(size));
  }
  detail::nccl::DeviceGuard guard(device);
  ncclComm_t comm = nullptr;
  detail::nccl::check_nccl(ncclCommInitRank(&comm, size, id, rank), "ncclCommInitRank");
  ncclComm_t control = nullptr;
  try {
    control = detail::nccl::control_for(comm, rank, size, options);
  } catch (...) {
    ncclCommDestroy(comm);
    throw;
  }
  return Communicator<Nccl>(Nccl::Endpoint(comm, device, control));
}

/// A fresh unique id (no GPU needed): rank 0 makes it, every rank uses it.
inline ncclUniqueId nccl_unique_id() {
  ncclUniqueId id{};
  detail::nccl::check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  return id;
}

/// One process, several GPUs: one communicator per device, in rank order,
/// through ncclCommInitAll. Use each from its own thread.
inline std::vector<Communicator<Nccl>> nccl_communicators(std::span<const int> devices, NcclOptions options = {}) {
  if (devices.empty()) throw InvalidArgument("gradsync: nccl_communicators expects at least one device");
  const int n = static_cast<int>(devices.size());
  std::vector<ncclComm_t> comms(devices.size());
  detail::nccl::check_nccl(ncclCommInitAll(comms.data(), n, devices.data()), "ncclCommInitAll");
  std::vector<ncclComm_t> controls(devices.size(), nullptr);
  if (options.check_calls && n > 1) {
    // One thread splits every rank's communicator: NCCL would wait in the
    // first split for the others unless they form one group.
    ncclResult_t rc = ncclGroupStart();
    for (int i = 0; rc == ncclSuccess && i < n; ++i) {
      rc = ncclCommSplit(comms[static_cast<std::size_t>(i)], 0, i, &controls[static_cast<std::size_t>(i)], nullptr);
    }
    const ncclResult_t end = ncclGroupEnd();
    if (rc != ncclSuccess || end != ncclSuccess) {
      for (ncclComm_t c : controls)
        if (c) ncclCommDestroy(c);
      for (ncclComm_t c : comms) ncclCommDestroy(c);
      detail::nccl::check_nccl(rc != ncclSuccess ? rc : end, "ncclCommSplit (the call-agreement communicators)");
    }
  }
  std::vector<Communicator<Nccl>> out;
  out.reserve(devices.size());
  for (std::size_t i = 0; i < devices.size(); ++i) out.emplace_back(Nccl::Endpoint(comms[i], devices[i], controls[i]));
  return out;
}

/// A communicator bound to another stream for as long as the view lives,
/// in the style of Thrust's `par.on(stream)`: collectives run through
/// `view.comm()` are ordered on `stream`. The new stream first waits for
/// the communicator's earlier work, and the old stream, on restore, waits
/// for the view's work, so calls stay in one order per communicator.
class StreamView {
 public:
  StreamView(Communicator<Nccl>& comm, cudaStream_t stream)
      : comm_(&comm), previous_(detail::endpoint_of(comm).stream()) {
    detail::endpoint_of(*comm_).set_stream(stream);
  }
  StreamView(const StreamView&) = delete;
  StreamView& operator=(const StreamView&) = delete;
  ~StreamView() {
    try {
      detail::endpoint_of(*comm_).set_stream(previous_);
    } catch (...) {
      // The stream error resurfaces at the next synchronize.
    }
  }

  Communicator<Nccl>& comm() noexcept { return *comm_; }
  Communicator<Nccl>& operator*() noexcept { return *comm_; }
  cudaStream_t stream() const noexcept { return detail::endpoint_of(*comm_).stream(); }

 private:
  Communicator<Nccl>* comm_;
  cudaStream_t previous_;
};

/// `comm` bound to `stream` (see StreamView).
inline StreamView on(Communicator<Nccl>& comm, cudaStream_t stream) { return StreamView(comm, stream); }

/// A point in a communicator's stream the host can wait for.
class NcclEvent {
 public:
  explicit NcclEvent(Communicator<Nccl>& comm) : comm_(&comm) {
    detail::nccl::DeviceGuard guard(detail::endpoint_of(comm).device());
    detail::nccl::check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    detail::nccl::check_cuda(cudaEventRecord(event_, detail::endpoint_of(comm).stream()), "cudaEventRecord");
    label_ = "work up to collective #" + std::to_string(comm.sequence());
  }
  NcclEvent(const NcclEvent&) = delete;
  NcclEvent& operator=(const NcclEvent&) = delete;
  NcclEvent(NcclEvent&& o) noexcept
      : comm_(o.comm_), event_(std::exchange(o.event_, nullptr)), label_(std::move(o.label_)) {}
  NcclEvent& operator=(NcclEvent&&) = delete;
  ~NcclEvent() {
    if (event_) cudaEventDestroy(event_);
  }

  /// True once the GPU got past the event (no wait).
  bool test() const {
    const cudaError_t q = cudaEventQuery(event_);
    if (q == cudaErrorNotReady) return false;
    detail::nccl::check_cuda(q, "cudaEventQuery");
    return true;
  }
  /// Blocks until then, with the communicator's deadline; on a timeout or an
  /// NCCL error aborts the communicator and throws Timeout or Error.
  void wait() const { detail::endpoint_of(*comm_).wait_event(event_, label_, comm_->timeout()); }
  cudaEvent_t get() const noexcept { return event_; }

 private:
  Communicator<Nccl>* comm_;
  cudaEvent_t event_ = nullptr;
  std::string label_;
};

/// An event at the current end of `comm`'s stream.
inline NcclEvent record(Communicator<Nccl>& comm) { return NcclEvent(comm); }

/// Blocks until everything enqueued on `comm`'s stream is done (see NcclEvent::wait).
inline void synchronize(Communicator<Nccl>& comm) { record(comm).wait(); }

}  // namespace gradsync
