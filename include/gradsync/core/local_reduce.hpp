#pragma once
/// \file Type-erased local reduce: backends receive (DataType, OpKind) and
/// dispatch here once per message, never per element.

#include <cstddef>
#include <cstdint>

#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/types.hpp"

namespace gradsync::detail {

template <class T>
void reduce_into_kind(OpKind op, T* dst, const T* src, std::size_t n) noexcept {
  switch (op) {
    case OpKind::sum:
    case OpKind::avg: reduce_into<Sum>(dst, src, n); return;
    case OpKind::min: reduce_into<Min>(dst, src, n); return;
    case OpKind::max: reduce_into<Max>(dst, src, n); return;
    case OpKind::prod: reduce_into<Prod>(dst, src, n); return;
  }
}

/// dst = op(dst, src) for n elements of `type`.
inline void reduce_into_erased(DataType type, OpKind op, void* dst, const void* src, std::size_t n) noexcept {
  switch (type) {
    case DataType::float32:
      return reduce_into_kind(op, static_cast<float*>(dst), static_cast<const float*>(src), n);
    case DataType::float64:
      return reduce_into_kind(op, static_cast<double*>(dst), static_cast<const double*>(src), n);
    case DataType::int32:
      return reduce_into_kind(op, static_cast<std::int32_t*>(dst), static_cast<const std::int32_t*>(src), n);
    case DataType::int64:
      return reduce_into_kind(op, static_cast<std::int64_t*>(dst), static_cast<const std::int64_t*>(src), n);
    case DataType::bfloat16:
      return reduce_into_kind(op, static_cast<bfloat16*>(dst), static_cast<const bfloat16*>(src), n);
    case DataType::float16:
      return reduce_into_kind(op, static_cast<float16*>(dst), static_cast<const float16*>(src), n);
  }
}

/// Op::finish (Avg's division by the world size) for n elements of `type`.
inline void finish_erased(DataType type, OpKind op, void* data, std::size_t n, int world) noexcept {
  if (op != OpKind::avg) return;
  switch (type) {
    case DataType::float32: return finish<Avg>(static_cast<float*>(data), n, world);
    case DataType::float64: return finish<Avg>(static_cast<double*>(data), n, world);
    case DataType::int32: return finish<Avg>(static_cast<std::int32_t*>(data), n, world);
    case DataType::int64: return finish<Avg>(static_cast<std::int64_t*>(data), n, world);
    case DataType::bfloat16: return finish<Avg>(static_cast<bfloat16*>(data), n, world);
    case DataType::float16: return finish<Avg>(static_cast<float16*>(data), n, world);
  }
}

constexpr std::size_t size_of(DataType t) noexcept {
  switch (t) {
    case DataType::float32: return 4;
    case DataType::float64: return 8;
    case DataType::int32: return 4;
    case DataType::int64: return 8;
    case DataType::bfloat16: return 2;
    case DataType::float16: return 2;
  }
  return 1;
}

}  // namespace gradsync::detail
