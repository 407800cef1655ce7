#pragma once
/// \file Type-erased local reduce: backends receive (DataType, OpKind) and
/// dispatch here once per message, never per element.

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/types.hpp"
#include "gradsync/core/visit.hpp"

namespace gradsync::detail {

template <class T>
void reduce_into_kind(OpKind op, T* dst, const T* src, std::size_t n) noexcept {
  // Avg reduces as Sum (its division is finish's): one kernel for both.
  visit(op, [&]<class Op>(Op) {
    using Step = std::conditional_t<std::is_same_v<Op, Avg>, Sum, Op>;
    reduce_into<Step>(dst, src, n);
  });
}

/// dst = op(dst, src) for n elements of `type`.
inline void reduce_into_erased(DataType type, OpKind op, void* dst, const void* src, std::size_t n) noexcept {
  visit(type, [&]<class T>(T) { reduce_into_kind(op, static_cast<T*>(dst), static_cast<const T*>(src), n); });
}

/// Op::finish (Avg's division by the world size) for n elements of `type`.
inline void finish_erased(DataType type, OpKind op, void* data, std::size_t n, int world) noexcept {
  if (op != OpKind::avg) return;
  visit(type, [&]<class T>(T) { finish<Avg>(static_cast<T*>(data), n, world); });
}

constexpr std::size_t size_of(DataType t) noexcept {
  return visit(t, []<class T>(T) { return sizeof(T); });
}

}  // namespace gradsync::detail
