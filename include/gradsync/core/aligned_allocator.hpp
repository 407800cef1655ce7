#pragma once
/// \file AlignedAllocator: a std::allocator whose storage starts on an
/// `Align`-byte boundary.

#include <cstddef>
#include <new>

namespace gradsync::detail {

/// Storage on an `Align`-byte boundary. A trainer keeps its flat arrays in
/// it so that where each tensor starts, relative to a cache line or a
/// vector register, is the same in every process: vectorized math (Eigen,
/// BLAS) chooses its summation order by alignment, and with malloc's 16
/// bytes that order, and so the last bits of training, would depend on what
/// else the process had allocated (a resumed run would not be bitwise the
/// uninterrupted one).
template <class T, std::size_t Align = 64>
struct AlignedAllocator {
  static_assert(Align >= alignof(T) && (Align & (Align - 1)) == 0, "AlignedAllocator: Align must be a power of two");
  using value_type = T;
  template <class U>
  struct rebind {
    using other = AlignedAllocator<U, Align>;
  };

  AlignedAllocator() = default;
  template <class U>
  constexpr AlignedAllocator(const AlignedAllocator<U, Align>&) noexcept {}

  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{Align})); }
  // The sized form only where the compiler declares it: Clang before 19
  // leaves sized deallocation off unless asked (-fsized-deallocation).
  void deallocate(T* p, [[maybe_unused]] std::size_t n) noexcept {
#if defined(__cpp_sized_deallocation)
    ::operator delete(p, n * sizeof(T), std::align_val_t{Align});
#else
    ::operator delete(p, std::align_val_t{Align});
#endif
  }

  template <class U>
  friend constexpr bool operator==(const AlignedAllocator&, const AlignedAllocator<U, Align>&) noexcept {
    return true;
  }
};

}  // namespace gradsync::detail
