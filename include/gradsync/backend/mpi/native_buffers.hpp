#pragma once
/// \file NativeBuffers: the memory an Mpi endpoint's Native collectives run
/// on, and the requests they gave up on.
///
/// MPI can neither cancel nor free a pending collective, and keeps writing
/// into its buffers after a wait gave up on it (a peer never joined). So
/// Native runs on a buffer the endpoint owns, and a request given up on
/// keeps that buffer for as long as MPI may use it: the caller's memory is
/// never touched after a call throws.

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

namespace gradsync::detail::mpi {

class NativeBuffers {
 public:
  /// The Native collectives' buffer, reused and grown to `bytes`.
  std::byte* get(std::size_t bytes) {
    if (!buffer_ || bytes_ < bytes) {
      buffer_.reset();
      bytes_ = 0;
      buffer_ = std::make_unique_for_overwrite<std::byte[]>(bytes ? bytes : 1);
      bytes_ = bytes;
    }
    return buffer_.get();
  }

  /// Gives `req` up: it stays, with the buffer if `with_buffer` (MPI may
  /// write there until it completes), until it completes or MPI ends.
  /// Never throws: a request whose record cannot be kept leaks its buffer.
  void abandon(MPI_Request& req, bool with_buffer) noexcept {
    if (req == MPI_REQUEST_NULL) return;
    Abandoned a{req, nullptr};
    if (with_buffer) {
      a.data = std::move(buffer_);
      bytes_ = 0;
    }
    try {
      abandoned_.push_back(std::move(a));
    } catch (...) {
      (void)a.data.release();  // NOLINT: MPI may still write there
    }
    req = MPI_REQUEST_NULL;
  }

  /// Frees what abandoned collectives held once MPI is done with it. At
  /// destruction, what MPI still holds moves to a list that lives until the
  /// process ends: freeing it would let MPI write into freed memory;
  /// MPI_Finalize (`finalized`) makes everything free.
  void keep_abandoned(bool finalized) noexcept {
    if (!finalized) {
      std::erase_if(abandoned_, [](Abandoned& a) {
        int done = 0;
        if (a.request != MPI_REQUEST_NULL) MPI_Test(&a.request, &done, MPI_STATUS_IGNORE);
        return a.request == MPI_REQUEST_NULL || done != 0;
      });
    }
    if (abandoned_.empty() || finalized) return;
    // Reachable from a static, so leak checkers do not count it.
    static auto* kept = new std::vector<Abandoned>();  // NOLINT: deliberately never freed
    try {
      for (auto& a : abandoned_) kept->push_back(std::move(a));
    } catch (...) {
      for (auto& a : abandoned_) (void)a.data.release();  // NOLINT: MPI may write there
    }
    abandoned_.clear();
  }

  void swap(NativeBuffers& o) noexcept {
    abandoned_.swap(o.abandoned_);
    std::swap(buffer_, o.buffer_);
    std::swap(bytes_, o.bytes_);
  }

 private:
  /// A collective request given up on, with the buffer MPI may still use.
  struct Abandoned {
    MPI_Request request = MPI_REQUEST_NULL;
    std::unique_ptr<std::byte[]> data;
  };

  std::vector<Abandoned> abandoned_;
  std::unique_ptr<std::byte[]> buffer_;
  std::size_t bytes_ = 0;
};

}  // namespace gradsync::detail::mpi
