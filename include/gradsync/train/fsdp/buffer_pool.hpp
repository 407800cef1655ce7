#pragma once
/// \file detail::fsdp::BufferPool: the storage of freed gathered units and
/// gradient buffers, kept for the next buffer of the same size. Fresh pages
/// would be faulted in (and zeroed) inside the step, on the rank's thread,
/// for every unit of every step; the pool avoids that while never letting
/// spares take the trainer past the transient need its budget was checked
/// against.

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include "gradsync/core/aligned_allocator.hpp"

namespace gradsync::detail::fsdp {

/// Storage of a gathered unit or a gradient buffer of value_type T.
/// Aligned alike in every process: the model's math runs on it, so
/// vectorized sums go in one order whatever else the process allocated.
template <class T>
using Storage = std::vector<T, AlignedAllocator<T>>;

/// Spare buffers of value_type T, bounded by a byte limit shared with what
/// is in use (which the caller reports: `held_now()`, bytes in use).
template <class T>
class BufferPool {
 public:
  /// At most `buffers` spares (reserved now, so keeping one never
  /// allocates), and with what is in use at most `limit_bytes`.
  void reserve(std::size_t buffers, std::size_t limit_bytes) {
    limit_ = limit_bytes;
    spares_.reserve(buffers);
  }

  /// Storage for n elements: a spare of exactly that capacity if one was
  /// kept, else a new one. `zero`: a gradient buffer, which the model adds
  /// into; a gather overwrites all of its buffer.
  template <class HeldNow>
  Storage<T> take(std::size_t n, bool zero, HeldNow&& held_now) {
    Storage<T> v;
    const auto fit = std::ranges::find_if(spares_, [n](const auto& x) { return x.capacity() == n; });
    if (fit != spares_.end()) {
      v = std::move(*fit);
      spares_.erase(fit);
      if (zero) {
        v.assign(n, T(0));
      } else {
        v.resize(n);
      }
      return v;
    }
    trim(n * sizeof(T) + held_now());
    v.assign(n, T(0));
    return v;
  }

  /// Keeps `v`'s storage as a spare (then empties it), within the bound.
  template <class HeldNow>
  void give(Storage<T>& v, HeldNow&& held_now) noexcept {
    if (v.capacity() == 0) return;
    if (spares_.size() < spares_.capacity()) spares_.push_back(std::move(v));
    Storage<T>().swap(v);
    trim(held_now());
  }

 private:
  /// Frees spares, oldest first, until they and `held` bytes are within the limit.
  void trim(std::size_t held) noexcept {
    for (const auto& x : spares_) held += x.capacity() * sizeof(T);
    std::size_t drop = 0;
    for (; drop < spares_.size() && held > limit_; ++drop) held -= spares_[drop].capacity() * sizeof(T);
    spares_.erase(spares_.begin(), spares_.begin() + static_cast<std::ptrdiff_t>(drop));
  }

  std::vector<Storage<T>> spares_;
  std::size_t limit_ = 0;
};

}  // namespace gradsync::detail::fsdp
