#pragma once
/// \file gradsync's element types and ops in NCCL's terms.

#include <nccl.h>

#include "gradsync/core/ops.hpp"
#include "gradsync/core/types.hpp"

namespace gradsync::detail::nccl {

constexpr ncclDataType_t datatype(DataType t) noexcept {
  switch (t) {
    case DataType::float32: return ncclFloat32;
    case DataType::float64: return ncclFloat64;
    case DataType::int32: return ncclInt32;
    case DataType::int64: return ncclInt64;
    case DataType::bfloat16: return ncclBfloat16;
    case DataType::float16: return ncclFloat16;
  }
  return ncclFloat32;
}

constexpr bool is_integer(DataType t) noexcept { return t == DataType::int32 || t == DataType::int64; }

/// Avg maps to ncclAvg for floating types. Integers sum and then divide with
/// gradsync's finish kernel, so they truncate toward zero as on the host.
constexpr ncclRedOp_t redop(OpKind op, DataType t) noexcept {
  switch (op) {
    case OpKind::sum: return ncclSum;
    case OpKind::avg: return is_integer(t) ? ncclSum : ncclAvg;
    case OpKind::min: return ncclMin;
    case OpKind::max: return ncclMax;
    case OpKind::prod: return ncclProd;
  }
  return ncclSum;
}

/// Whether Native needs gradsync's finish kernel after NCCL's collective.
constexpr bool needs_finish(OpKind op, DataType t) noexcept { return op == OpKind::avg && is_integer(t); }

}  // namespace gradsync::detail::nccl
