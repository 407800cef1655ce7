#pragma once
/// \file Buffer: `count` elements of a run-time DataType at a pointer.
///
/// Algorithms work on these rather than on std::span<T>, so each is compiled
/// once per backend instead of once per element type: the transport beneath
/// them is type-erased already (pointer, count, DataType), and the only
/// per-element work, the local reduce, is dispatched on the type by the
/// backend. Offsets and sizes are in elements, as with std::span.

#include <cstddef>
#include <span>
#include <type_traits>

#include "gradsync/core/local_reduce.hpp"
#include "gradsync/core/types.hpp"

namespace gradsync::detail {

/// `Byte` is std::byte (writable) or const std::byte (read-only).
template <class Byte>
class BasicBuffer {
 public:
  using pointer = std::conditional_t<std::is_const_v<Byte>, const void*, void*>;

  constexpr BasicBuffer() noexcept = default;
  BasicBuffer(pointer p, std::size_t count, DataType type) noexcept
      : p_(static_cast<Byte*>(p)), n_(count), type_(type), elem_(size_of(type)) {}
  /// From a typed span; a read-only buffer also takes a writable span.
  template <Element T>
    requires(std::is_const_v<Byte> || !std::is_const_v<T>)
  BasicBuffer(std::span<T> s) noexcept  // NOLINT: implicit, as span's own conversions
      : BasicBuffer(s.data(), s.size(), data_type_v<T>) {}
  /// A writable buffer is also a read-only one.
  template <class Other>
    requires(std::is_const_v<Byte> && !std::is_const_v<Other>)
  BasicBuffer(BasicBuffer<Other> b) noexcept  // NOLINT: implicit, as span<T> to span<const T>
      : p_(static_cast<Byte*>(b.data())), n_(b.size()), type_(b.type()), elem_(b.element_size()) {}

  pointer data() const noexcept { return p_; }
  std::size_t size() const noexcept { return n_; }
  std::size_t size_bytes() const noexcept { return n_ * elem_; }
  bool empty() const noexcept { return n_ == 0; }
  DataType type() const noexcept { return type_; }
  std::size_t element_size() const noexcept { return elem_; }

  /// Elements [offset, offset + count).
  BasicBuffer subspan(std::size_t offset, std::size_t count) const noexcept {
    return BasicBuffer(p_ + offset * elem_, count, type_, elem_);
  }
  /// Elements [offset, size()).
  BasicBuffer subspan(std::size_t offset) const noexcept { return subspan(offset, n_ - offset); }
  BasicBuffer first(std::size_t count) const noexcept { return subspan(0, count); }

 private:
  template <class>
  friend class BasicBuffer;
  BasicBuffer(Byte* p, std::size_t count, DataType type, std::size_t elem) noexcept
      : p_(p), n_(count), type_(type), elem_(elem) {}

  Byte* p_ = nullptr;
  std::size_t n_ = 0;
  DataType type_ = DataType::float32;
  std::size_t elem_ = 4;
};

using Buffer = BasicBuffer<std::byte>;
using ConstBuffer = BasicBuffer<const std::byte>;

}  // namespace gradsync::detail
