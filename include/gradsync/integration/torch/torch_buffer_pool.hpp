#pragma once
/// \file detail::TorchBufferPool: the bytes of freed fully_shard full buffers and flat gradients, kept
/// for the next that fits.
///
/// A sharded unit frees its gathered parameters after each use and gathers
/// them again for the next, and makes a flat gradient for each backward:
/// fresh bytes every time (malloc hands large blocks back to the kernel)
/// would be page-faulted in and zeroed inside the step, on the rank's
/// thread. The pool keeps freed bytes for the next buffer that fits in
/// them, as PyTorch's caching allocator does for FSDP on a GPU.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

namespace gradsync::detail {

/// Spare CPU allocations, oldest first, bounded by a byte limit shared with
/// what is in use (which the caller reports).
class TorchBufferPool {
 public:
  /// One allocation of `capacity` bytes.
  struct Spare {
    c10::DataPtr data;
    std::size_t capacity = 0;
  };

  /// The smallest spare of at least `bytes`, taken out of the pool; an empty
  /// Spare (null data) when none fits.
  Spare take(std::size_t bytes) {
    auto best = spares_.end();
    for (auto it = spares_.begin(); it != spares_.end(); ++it) {
      if (it->capacity >= bytes && (best == spares_.end() || it->capacity < best->capacity)) best = it;
    }
    if (best == spares_.end()) return {};
    Spare out = std::move(*best);
    spares_.erase(best);
    return out;
  }

  /// Keeps `spare`, then frees the oldest spares until they and `held`
  /// bytes (what is gathered now) are within `limit` bytes.
  void give(Spare spare, std::size_t held, std::size_t limit) noexcept {
    if (spare.data.get() == nullptr || spare.capacity == 0) return;
    try {
      spares_.push_back(std::move(spare));
    } catch (...) {
      return;  // the allocation is freed with `spare`
    }
    std::size_t total = held;
    for (const Spare& s : spares_) total += s.capacity;
    std::size_t drop = 0;
    for (; drop < spares_.size() && total > limit; ++drop) total -= spares_[drop].capacity;
    spares_.erase(spares_.begin(), spares_.begin() + static_cast<std::ptrdiff_t>(drop));
  }

  /// `bytes` under storage `s` (which has fewer): a spare's, the smallest
  /// that fits, else a new allocation. The storage's size is set to `bytes`
  /// even from a larger spare; reclaim() takes that as its capacity.
  void fill(c10::StorageImpl& s, std::size_t bytes) {
    if (s.nbytes() >= bytes) return;
    Spare spare = take(bytes);
    s.set_data_ptr_noswap(spare.data.get() != nullptr ? std::move(spare.data) : s.allocator()->allocate(bytes));
    s.set_nbytes(bytes);
  }

  /// A tensor of `numel` zeros of `options` (CPU) over a spare's bytes
  /// when one fits; reclaim() its storage when done.
  at::Tensor zeros(std::int64_t numel, const at::TensorOptions& options) {
    at::Tensor t = at::empty({0}, options);
    fill(*t.storage().unsafeGetStorageImpl(), static_cast<std::size_t>(numel) * t.element_size());
    t.set_(t.storage(), 0, {numel}, {1});
    return t.zero_();
  }

  /// Storage `s`'s bytes as a spare (give()); `s` keeps none, but stays.
  void reclaim(c10::StorageImpl& s, std::size_t held, std::size_t limit) noexcept {
    const std::size_t bytes = s.nbytes();
    Spare spare{s.set_data_ptr(c10::DataPtr(nullptr, s.device())), bytes};
    s.set_nbytes(0);
    give(std::move(spare), held > bytes ? held - bytes : 0, limit);
  }

  /// Bytes the spares hold.
  std::size_t bytes() const noexcept {
    std::size_t total = 0;
    for (const Spare& s : spares_) total += s.capacity;
    return total;
  }

  void clear() noexcept { spares_.clear(); }

 private:
  std::vector<Spare> spares_;
};

}  // namespace gradsync::detail
